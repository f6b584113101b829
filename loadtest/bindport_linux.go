package loadtest

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// bindNoPort is a net.Dialer's Control for a dialer bound to a local
// address: the port is chosen at connect, for the 4-tuple, not at bind
// (IP_BIND_ADDRESS_NO_PORT), so that a flood of connections from one
// loopback address is not bounded by the ephemeral ports free to bind.
func bindNoPort(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_BIND_ADDRESS_NO_PORT, 1)
	})
	if err != nil {
		return err
	}
	return serr
}
