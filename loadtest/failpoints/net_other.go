//go:build !linux

package failpoints

import (
	"context"
	"errors"
	"time"
)

// ErrNoNetns says the process may not create a network namespace.
var ErrNoNetns = errors.New("failpoints: the chaos suite needs Linux network namespaces")

// ErrNoIptables says iptables is not installed (never returned off Linux).
var ErrNoIptables = errors.New("failpoints: the chaos suite cuts links with iptables")

// InNetns is false off Linux.
func InNetns() bool { return false }

// CanCreateNetns fails off Linux.
func CanCreateNetns() error { return ErrNoNetns }

// CanShape fails off Linux.
func CanShape() error { return ErrNoNetns }

// ReexecInNetns fails off Linux.
func ReexecInNetns(context.Context, string, []string, ...string) error { return ErrNoNetns }

// Net is the chaos network; off Linux there is none.
type Net struct{}

// NewNet fails off Linux.
func NewNet([]uint32) (*Net, error) { return nil, ErrNoNetns }

// Cut fails off Linux.
func (*Net) Cut(a, b int, ipA, ipB string) error { return ErrNoNetns }

// Heal fails off Linux.
func (*Net) Heal() error { return ErrNoNetns }

// SlowHow says no link is shaped off Linux.
func (*Net) SlowHow() string { return "none" }

// Fast fails off Linux.
func (*Net) Fast() error { return ErrNoNetns }

// Slow fails off Linux.
func (*Net) Slow(int, string, time.Duration, int, float64) (string, error) {
	return "", ErrNoNetns
}
