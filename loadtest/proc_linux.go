package loadtest

import "syscall"

// childSysProcAttr puts a child in its own process group and has the kernel
// kill it if the parent dies. (Pdeathsig fires when the thread that started
// the child exits; Go's runtime does not end its threads unless a goroutine
// exits while locked to one, which this package never does.)
func childSysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
