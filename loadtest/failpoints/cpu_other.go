//go:build !linux

package failpoints

import "errors"

// CPUCap would hold a process to a share of one CPU; off Linux there are
// no cgroups.
type CPUCap struct{}

// CapCPU fails off Linux.
func CapCPU(int, float64) (*CPUCap, error) {
	return nil, errors.New("failpoints: cgroups are Linux only")
}

// Release does nothing off Linux.
func (*CPUCap) Release() error { return nil }

// Throttled says nothing off Linux.
func (*CPUCap) Throttled() string { return "" }

// How says nothing off Linux.
func (*CPUCap) How() string { return "" }

// StarveHow is how the chaos suite starves a relay: by signals off Linux.
func StarveHow() string { return "SIGSTOP/SIGCONT bursts" }

// SweepCPUGroups does nothing off Linux.
func SweepCPUGroups() {}
