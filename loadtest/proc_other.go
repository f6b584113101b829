//go:build !linux

package loadtest

import (
	"errors"
	"os"
	"syscall"
)

// childSysProcAttr is nil off Linux: there is no Pdeathsig, and a child
// learns of its parent's death from EOF on its stdin. A user is not
// supported.
func childSysProcAttr(*ChildUser) *syscall.SysProcAttr { return nil }

// signalGroup signals the process alone (no process groups here).
func signalGroup(pid int, sig syscall.Signal) error {
	p, err := os.FindProcess(pid)
	if err != nil {
		return err
	}
	if err := p.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	return nil
}
