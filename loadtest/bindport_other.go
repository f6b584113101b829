//go:build !linux

package loadtest

import "syscall"

// bindNoPort does nothing off Linux: each connection binds a port.
func bindNoPort(_, _ string, _ syscall.RawConn) error { return nil }
