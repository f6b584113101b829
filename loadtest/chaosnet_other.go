//go:build !linux

package loadtest

import (
	"context"
	"errors"
)

// ErrNoNetns says the process may not create a network namespace.
var ErrNoNetns = errors.New("loadtest: the chaos suite needs Linux network namespaces")

// InChaosNetns is false off Linux.
func InChaosNetns() bool { return false }

// CanCreateNetns fails off Linux.
func CanCreateNetns() error { return ErrNoNetns }

// ReexecInNetns fails off Linux.
func ReexecInNetns(context.Context, string, []string, ...string) error { return ErrNoNetns }

type chaosNet struct{}

func setupChaosNet([]uint32) (*chaosNet, error)       { return nil, ErrNoNetns }
func (*chaosNet) cut(a, b int, ipA, ipB string) error { return ErrNoNetns }
func (*chaosNet) heal() error                         { return ErrNoNetns }
