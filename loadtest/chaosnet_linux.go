package loadtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
)

// The chaos suite's network. The whole run (driver, relays, etcd, the
// upstream) lives in a network namespace of its own, created by starting
// the driver with CLONE_NEWNET and gone with its last process: nothing it
// does to the network can leak to the host, and it may use fixed loopback
// addresses and ports. Each relay runs as a user of its own, so packet
// filters tell relays apart by their sockets' owner (iptables' owner
// match), with no seam in the relay: cutting relays a and b drops every
// packet a's sockets send to b's address or on a connection b opened (its
// connection mark), and the same the other way. Envoys, etcd and the
// upstream are never cut.

// chaosNetnsEnv is set in the environment of a driver started in its own
// network namespace.
const chaosNetnsEnv = "MESHRELAY_CHAOS_NETNS"

// InChaosNetns reports whether this process runs in the network namespace
// ReexecInNetns made for it.
func InChaosNetns() bool { return os.Getenv(chaosNetnsEnv) != "" }

// ReexecInNetns runs path with args in a new network namespace (root
// only), its stdout and stderr this process's, and returns its exit error.
// The child is killed if ctx ends or this process dies.
func ReexecInNetns(ctx context.Context, path string, args []string, env ...string) error {
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Env = append(append(os.Environ(), chaosNetnsEnv+"=1"), env...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	return cmd.Run()
}

// ErrNoNetns says the process may not create a network namespace.
var ErrNoNetns = errors.New("loadtest: cannot create a network namespace (the chaos suite needs root)")

// CanCreateNetns reports whether ReexecInNetns can work here: root, and
// the kernel lets it unshare a network namespace (checked with `true`).
func CanCreateNetns() error {
	if os.Geteuid() != 0 {
		return ErrNoNetns
	}
	cmd := exec.Command("true")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%w: %v", ErrNoNetns, err)
	}
	if _, err := exec.LookPath("iptables"); err != nil {
		return fmt.Errorf("loadtest: the chaos suite cuts links with iptables (apt-get install iptables): %w", err)
	}
	return nil
}

// chaosNet sets up and changes the namespace's network.
type chaosNet struct {
	uids []uint32 // each relay's user; its connection mark is its index + 1
}

const chaosChain = "MESHRELAY-CHAOS"

func run(name string, args ...string) error {
	var out bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %v: %w: %s", name, args, err, bytes.TrimSpace(out.Bytes()))
	}
	return nil
}

// setupChaosNet brings loopback up and marks every connection a relay
// opens with its index + 1. It must run in the run's own namespace.
func setupChaosNet(uids []uint32) (*chaosNet, error) {
	if !InChaosNetns() {
		return nil, errors.New("loadtest: the chaos network is set up only in a namespace of its own (see ReexecInNetns)")
	}
	if err := run("ip", "link", "set", "lo", "up"); err != nil {
		return nil, err
	}
	if err := run("iptables", "-N", chaosChain); err != nil {
		return nil, err
	}
	if err := run("iptables", "-A", "OUTPUT", "-j", chaosChain); err != nil {
		return nil, err
	}
	for i, uid := range uids {
		if err := run("iptables", "-t", "mangle", "-A", "OUTPUT", "-m", "conntrack", "--ctstate", "NEW",
			"-m", "owner", "--uid-owner", strconv.Itoa(int(uid)), "-j", "CONNMARK", "--set-mark", strconv.Itoa(i+1)); err != nil {
			return nil, err
		}
	}
	return &chaosNet{uids: uids}, nil
}

// cut drops every packet between relays a and b (at addresses ipA, ipB).
func (n *chaosNet) cut(a, b int, ipA, ipB string) error {
	ua, ub := strconv.Itoa(int(n.uids[a])), strconv.Itoa(int(n.uids[b]))
	rules := [][]string{
		{"-m", "owner", "--uid-owner", ua, "-d", ipB},
		{"-m", "owner", "--uid-owner", ub, "-d", ipA},
		{"-m", "owner", "--uid-owner", ua, "-m", "connmark", "--mark", strconv.Itoa(b + 1)},
		{"-m", "owner", "--uid-owner", ub, "-m", "connmark", "--mark", strconv.Itoa(a + 1)},
	}
	for _, r := range rules {
		if err := run("iptables", append(append([]string{"-A", chaosChain}, r...), "-j", "DROP")...); err != nil {
			return err
		}
	}
	return nil
}

// heal removes every cut.
func (n *chaosNet) heal() error { return run("iptables", "-F", chaosChain) }
