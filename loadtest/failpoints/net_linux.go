package failpoints

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
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
//
// A slow link marks every packet a relay's sockets send, every packet of a
// connection it opened and every packet sent to its address (iptables'
// mangle table), and loopback's root qdisc sends marked packets through a
// class of their own: netem's delay and loss where the kernel has netem,
// else an htb rate limit with a bounded queue (tbf) and random drops
// (iptables' statistic match); iptables' CLASSIFY sends marked packets to
// their class. Loopback's MTU is a pod network's 1500 for
// the whole run, so that a rate limit sees packets of a real link's size
// (tbf drops a packet larger than its burst, and loopback's are 64 KiB).

// chaosNetnsEnv is set in the environment of a driver started in its own
// network namespace.
const chaosNetnsEnv = "MESHRELAY_CHAOS_NETNS"

// InNetns reports whether this process runs in the network namespace
// ReexecInNetns made for it.
func InNetns() bool { return os.Getenv(chaosNetnsEnv) != "" }

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
var ErrNoNetns = errors.New("failpoints: cannot create a network namespace (the chaos suite needs root)")

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
		return fmt.Errorf("%w (apt-get install iptables): %w", ErrNoIptables, err)
	}
	return nil
}

// ErrNoIptables says iptables, which the chaos suite cuts links with, is
// not installed. TestChaosShort skips on it, unless CI=true.
var ErrNoIptables = errors.New("failpoints: the chaos suite cuts links with iptables")

// CanShape reports whether Net.Slow can shape links here: it needs tc
// (iproute2).
func CanShape() error {
	if _, err := exec.LookPath("tc"); err != nil {
		return fmt.Errorf("it shapes links with tc (apt-get install iproute2): %w", err)
	}
	return nil
}

// Net sets up and changes the namespace's network (NewNet).
type Net struct {
	uids  []uint32 // each relay's user; its connection mark is its index + 1
	tc    bool     // tc is installed
	netem bool     // the kernel has netem
	slowk bool     // a slow link is in place
}

const (
	chaosChain     = "MESHRELAY-CHAOS"      // filter OUTPUT: cuts
	chaosLossChain = "MESHRELAY-CHAOS-LOSS" // filter OUTPUT: a slow link's drops
	chaosSlowChain = "MESHRELAY-CHAOS-SLOW" // mangle OUTPUT: marks a slow link's packets
	chaosSlowMark  = "0x53"                 // a slow link's packets' mark
	chaosMTU       = 1500                   // loopback's, as a pod network's
)

// setLoopback brings loopback up with an MTU of mtu (ioctls, so that no
// iproute2 is needed).
func setLoopback(mtu int) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("failpoints: loopback: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return fmt.Errorf("failpoints: loopback: %w", err)
	}
	ifr.SetUint32(uint32(mtu))
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFMTU, ifr); err != nil {
		return fmt.Errorf("failpoints: loopback MTU %d: %w", mtu, err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("failpoints: loopback flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("failpoints: loopback up: %w", err)
	}
	return nil
}

func run(name string, args ...string) error {
	var out bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %v: %w: %s", name, args, err, bytes.TrimSpace(out.Bytes()))
	}
	return nil
}

// NewNet brings loopback up and marks every connection a relay
// opens with its index + 1. It must run in the run's own namespace.
func NewNet(uids []uint32) (*Net, error) {
	if !InNetns() {
		return nil, errors.New("failpoints: the chaos network is set up only in a namespace of its own (see ReexecInNetns)")
	}
	if err := setLoopback(chaosMTU); err != nil {
		return nil, err
	}
	for _, c := range [][]string{
		{"-N", chaosChain}, {"-A", "OUTPUT", "-j", chaosChain},
		{"-N", chaosLossChain}, {"-A", "OUTPUT", "-j", chaosLossChain},
	} {
		if err := run("iptables", c...); err != nil {
			return nil, err
		}
	}
	for i, uid := range uids {
		if err := run("iptables", "-t", "mangle", "-A", "OUTPUT", "-m", "conntrack", "--ctstate", "NEW",
			"-m", "owner", "--uid-owner", strconv.Itoa(int(uid)), "-j", "CONNMARK", "--set-mark", strconv.Itoa(i+1)); err != nil {
			return nil, err
		}
	}
	if err := run("iptables", "-t", "mangle", "-N", chaosSlowChain); err != nil {
		return nil, err
	}
	if err := run("iptables", "-t", "mangle", "-A", "OUTPUT", "-j", chaosSlowChain); err != nil {
		return nil, err
	}
	n := &Net{uids: uids}
	if _, err := exec.LookPath("tc"); err == nil {
		n.tc = true
		// netem is a module many small kernels lack: try it.
		if run("tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem", "delay", "1ms") == nil {
			n.netem = true
			if err := run("tc", "qdisc", "del", "dev", "lo", "root"); err != nil {
				return nil, err
			}
		}
	}
	return n, nil
}

// slowHow says how this namespace makes a slow link.
func (n *Net) SlowHow() string {
	switch {
	case !n.tc:
		return "none (no tc)"
	case n.netem:
		return "tc netem (delay and loss)"
	}
	return "tc htb rate limit with a tbf queue, and iptables statistic drops (this kernel has no netem)"
}

// slow sends every packet to or from relay i (at ip) through a slow link
// until fast: with netem, delay (±20 %) and loss each way; without,
// rateKbit each way through a queue of at most 400 ms, and loss. It
// returns what it did.
func (n *Net) Slow(i int, ip string, delay time.Duration, rateKbit int, loss float64) (string, error) {
	if !n.tc {
		return "", errors.New("failpoints: a slow link needs tc")
	}
	uid := strconv.Itoa(int(n.uids[i]))
	mark := []string{"-j", "MARK", "--set-mark", chaosSlowMark}
	n.slowk = true
	for _, m := range [][]string{
		{"-m", "owner", "--uid-owner", uid},               // what its sockets send
		{"-m", "connmark", "--mark", strconv.Itoa(i + 1)}, // on connections it opened
		{"-d", ip}, // to its address
	} {
		if err := run("iptables", append(append([]string{"-t", "mangle", "-A", chaosSlowChain}, m...), mark...)...); err != nil {
			return "", err
		}
	}
	// Marked packets go to the slow class: CLASSIFY sets the priority htb
	// reads as a class id. (tc's own classifiers by mark, fw and basic's
	// meta, are missing from small kernels, and a u32 "match mark" there
	// is taken without its key and matches every packet: the whole
	// namespace's loopback would be the slow link.)
	if err := run("iptables", "-t", "mangle", "-A", chaosSlowChain, "-m", "mark", "--mark", chaosSlowMark,
		"-j", "CLASSIFY", "--set-class", "1:20"); err != nil {
		return "", err
	}
	rate := "10gbit"
	if !n.netem {
		rate = fmt.Sprintf("%dkbit", rateKbit)
	}
	for _, c := range [][]string{
		{"qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10"},
		{"class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit"},
		{"class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb", "rate", rate},
	} {
		if err := run("tc", c...); err != nil {
			return "", err
		}
	}
	pct := strconv.FormatFloat(100*loss, 'f', 2, 64) + "%"
	if n.netem {
		ms := delay.Milliseconds()
		err := run("tc", "qdisc", "add", "dev", "lo", "parent", "1:20", "handle", "20:", "netem",
			"delay", fmt.Sprintf("%dms", ms), fmt.Sprintf("%dms", ms/5), "loss", pct)
		return fmt.Sprintf("tc netem: %dms ±%dms delay and %s loss each way", ms, ms/5, pct), err
	}
	if err := run("tc", "qdisc", "add", "dev", "lo", "parent", "1:20", "handle", "20:", "tbf",
		"rate", rate, "burst", "32kbit", "latency", "400ms"); err != nil {
		return "", err
	}
	if err := run("iptables", "-A", chaosLossChain, "-m", "mark", "--mark", chaosSlowMark,
		"-m", "statistic", "--mode", "random", "--probability", strconv.FormatFloat(loss, 'f', 4, 64), "-j", "DROP"); err != nil {
		return "", err
	}
	return fmt.Sprintf("no netem in this kernel: tc htb %s each way with a tbf queue of 400ms, and iptables statistic drops of %s", rate, pct), nil
}

// fast removes a slow link; it does nothing if there is none.
func (n *Net) Fast() error {
	if !n.slowk {
		return nil
	}
	n.slowk = false
	var errs []error
	if n.tc {
		// Fails only if slow failed before the qdisc was added.
		_ = run("tc", "qdisc", "del", "dev", "lo", "root")
	}
	errs = append(errs, run("iptables", "-t", "mangle", "-F", chaosSlowChain), run("iptables", "-F", chaosLossChain))
	return errors.Join(errs...)
}

// cut drops every packet between relays a and b (at addresses ipA, ipB).
func (n *Net) Cut(a, b int, ipA, ipB string) error {
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
func (n *Net) Heal() error { return run("iptables", "-F", chaosChain) }
