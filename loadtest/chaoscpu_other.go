//go:build !linux

package loadtest

import "errors"

type cpuCap struct{ how string }

func capCPU(int, float64) (*cpuCap, error) {
	return nil, errors.New("loadtest: cgroups are Linux only")
}
func (*cpuCap) release() error    { return nil }
func (*cpuCap) throttled() string { return "" }
func cpuStarveHow() string        { return "SIGSTOP/SIGCONT bursts" }
func sweepCPUGroups()             {}
