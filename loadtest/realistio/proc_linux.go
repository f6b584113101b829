package realistio

import "syscall"

// childAttr makes a process the tests start die with the test process,
// even when that is killed before its cleanups run.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
