//go:build !linux

package loadtest

import (
	"context"
	"errors"
	"time"
)

// ErrNoNetns says the process may not create a network namespace.
var ErrNoNetns = errors.New("loadtest: the chaos suite needs Linux network namespaces")

// ErrNoIptables says iptables is not installed (never returned off Linux).
var ErrNoIptables = errors.New("loadtest: the chaos suite cuts links with iptables")

// InChaosNetns is false off Linux.
func InChaosNetns() bool { return false }

// CanCreateNetns fails off Linux.
func CanCreateNetns() error { return ErrNoNetns }

// ReexecInNetns fails off Linux.
func ReexecInNetns(context.Context, string, []string, ...string) error { return ErrNoNetns }

type chaosNet struct{}

func chaosKindsHere(kinds []FaultKind) ([]FaultKind, []string) { return kinds, nil }
func setupChaosNet([]uint32) (*chaosNet, error)                { return nil, ErrNoNetns }
func (*chaosNet) cut(a, b int, ipA, ipB string) error          { return ErrNoNetns }
func (*chaosNet) heal() error                                  { return ErrNoNetns }
func (*chaosNet) slowHow() string                              { return "none" }
func (*chaosNet) fast() error                                  { return ErrNoNetns }
func (*chaosNet) slow(int, string, time.Duration, int, float64) (string, error) {
	return "", ErrNoNetns
}
