//go:build !linux

package loadtest

import "syscall"

// childSysProcAttr is nil off Linux: there is no Pdeathsig, and a child
// learns of its parent's death from EOF on its stdin.
func childSysProcAttr() *syscall.SysProcAttr { return nil }
