package loadtest

import "syscall"

// childSysProcAttr puts a child in its own process group and has the kernel
// kill it if the parent dies. (Pdeathsig fires when the thread that started
// the child exits; Go's runtime does not end its threads unless a goroutine
// exits while locked to one, which this package never does. Go sets it
// after changing the child's user, which would otherwise clear it.)
func childSysProcAttr(user *ChildUser) *syscall.SysProcAttr {
	a := &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if user != nil {
		a.Credential = &syscall.Credential{Uid: user.UID, Gid: user.GID}
	}
	return a
}

// signalGroup sends sig to the process group led by pid.
func signalGroup(pid int, sig syscall.Signal) error { return syscall.Kill(-pid, sig) }
