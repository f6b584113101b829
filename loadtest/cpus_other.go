//go:build !linux

package loadtest

// AllowedCPUs is Linux only.
func AllowedCPUs() (CPUSet, error) { return nil, errNoAffinity }

// startPinned runs start; pinning is Linux only.
func startPinned(cpus CPUSet, start func() error) error {
	if len(cpus) > 0 {
		return errNoAffinity
	}
	return start()
}

// PinProcess is Linux only.
func PinProcess(cpus CPUSet) error {
	if len(cpus) > 0 {
		return errNoAffinity
	}
	return nil
}

// ProcessCPUs is Linux only.
func ProcessCPUs(int) (CPUSet, error) { return nil, errNoAffinity }
