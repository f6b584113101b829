package realistio

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshrelay/meshrelay/loadtest/failpoints"
)

// podNet is the network the sidecar tests build: a bridge in the test's
// own network namespace (ownNetns) with the host side's addresses (istiod, the relays,
// the backends), and a network namespace per pod, each with a veth on
// the bridge, its own hosts file (`ip netns exec` mounts
// /etc/netns/<name>/hosts over /etc/hosts) and the iptables rule that
// sends its outbound service traffic to its Envoy, as Istio's init
// container does. Everything is removed when the test ends, also on
// failure.
type podNet struct {
	t      *testing.T
	id     string // prefix of every name the test creates here
	bridge string
	subnet string // "10.77.0.", the /24 every address is in
	pods   int
}

// needPodNet skips the test where network namespaces cannot be made
// (not root, no ip or iptables), failing instead with CI=true.
func needPodNet(t *testing.T) {
	t.Helper()
	why := ""
	if os.Geteuid() != 0 {
		why = "sidecars run in network namespaces, which need root"
	} else {
		for _, tool := range []string{"ip", "iptables"} {
			if _, err := exec.LookPath(tool); err != nil {
				why = tool + " not found (iproute2, iptables)"
			}
		}
	}
	if why == "" {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true: %s", why)
	}
	t.Skip(why)
}

// ownNetns runs test name again in a network namespace of its own, so
// that the bridge, its addresses and everything listening on them (the
// API server, istiod, the relays, the backends) live and die there, not
// on the host: it returns false here, after the run, and true in the run
// inside (whose loopback it brings up).
func ownNetns(t *testing.T, name string) bool {
	t.Helper()
	if failpoints.InNetns() {
		if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
			t.Fatalf("ip link set lo up: %v: %s", err, out)
		}
		return true
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	if err := failpoints.ReexecInNetns(ctx, os.Args[0], []string{"-test.run=^" + name + "$", "-test.v", "-test.count=1"}); err != nil {
		t.Fatalf("%s in its own network namespace: %v", name, err)
	}
	return false
}

// hostAddr is the bridge's own address: istiod listens there.
const hostAddr = "10.77.0.1"

func newPodNet(t *testing.T) *podNet {
	t.Helper()
	needPodNet(t)
	id := fmt.Sprintf("mr%d", os.Getpid()%100000)
	n := &podNet{t: t, id: id, bridge: id + "br", subnet: "10.77.0."}
	n.ip("link", "add", n.bridge, "type", "bridge")
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", n.bridge).Run() })
	n.ip("addr", "add", hostAddr+"/24", "dev", n.bridge)
	n.ip("link", "set", n.bridge, "up")
	return n
}

func (n *podNet) ip(args ...string) {
	n.t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		n.t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// hostIP adds addr to the bridge (a relay's or a backend's address on the
// host side) and returns it.
func (n *podNet) hostIP(last int) string {
	n.t.Helper()
	addr := fmt.Sprintf("%s%d", n.subnet, last)
	n.ip("addr", "add", addr+"/32", "dev", n.bridge)
	return addr
}

// pod creates a network namespace with address n.subnet+last, hosts
// mapping names to addresses (in order: a client tries them in turn),
// an empty resolv.conf (names the agent's DNS proxy does not know go
// nowhere), and outbound traffic to serviceCIDR redirected to Envoy's
// 15001. It returns the namespace's name.
func (n *podNet) pod(last int, hosts map[string][]string, serviceCIDR string) (name, addr string) {
	n.t.Helper()
	n.pods++
	name = fmt.Sprintf("%sp%d", n.id, n.pods)
	addr = fmt.Sprintf("%s%d", n.subnet, last)
	etc := filepath.Join("/etc/netns", name)
	if err := os.MkdirAll(etc, 0o755); err != nil {
		n.t.Fatal(err)
	}
	n.ip("netns", "add", name)
	n.t.Cleanup(func() {
		// Every process still in the namespace (pilot-agent, Envoy)
		// goes with it.
		if out, err := exec.Command("ip", "netns", "pids", name).Output(); err == nil {
			for _, pid := range strings.Fields(string(out)) {
				_ = exec.Command("kill", "-9", pid).Run()
			}
		}
		_ = exec.Command("ip", "netns", "del", name).Run()
		_ = os.RemoveAll(etc)
	})
	var hf strings.Builder
	hf.WriteString("127.0.0.1 localhost\n")
	for host, addrs := range hosts {
		for _, a := range addrs {
			fmt.Fprintf(&hf, "%s %s\n", a, host)
		}
	}
	for file, body := range map[string]string{"hosts": hf.String(), "resolv.conf": ""} {
		if err := os.WriteFile(filepath.Join(etc, file), []byte(body), 0o644); err != nil {
			n.t.Fatal(err)
		}
	}
	host, peer := fmt.Sprintf("%sh%d", n.id, n.pods), fmt.Sprintf("%sv%d", n.id, n.pods)
	n.ip("link", "add", host, "type", "veth", "peer", "name", peer)
	n.ip("link", "set", peer, "netns", name)
	n.ip("link", "set", host, "master", n.bridge, "up")
	n.ip("-n", name, "addr", "add", addr+"/24", "dev", peer)
	n.ip("-n", name, "link", "set", peer, "up")
	n.ip("-n", name, "link", "set", "lo", "up")
	n.ip("-n", name, "route", "add", "default", "via", hostAddr)
	if out, err := exec.Command("ip", "netns", "exec", name, "iptables", "-t", "nat", "-A", "OUTPUT",
		"-p", "tcp", "-d", serviceCIDR, "-j", "REDIRECT", "--to-ports", "15001").CombinedOutput(); err != nil {
		n.t.Fatalf("iptables in %s: %v: %s", name, err, out)
	}
	return name, addr
}

// dialIn dials addr from inside the named network namespace ns (ip
// netns): the socket stays there.
func dialIn(ctx context.Context, ns, network, addr string) (c net.Conn, err error) {
	if ierr := inNetns(filepath.Join("/var/run/netns", ns), func() error {
		c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return nil
	}); ierr != nil {
		return nil, ierr
	}
	return c, err
}

// inNetns runs fn on a thread that entered the network namespace at path:
// the sockets fn opens belong to it, and stay there once the thread has
// left. The thread returns to the test's namespace before it runs
// anything else; if it cannot, it stays locked and ends with its
// goroutine. (Threads are not ended otherwise: a process the tests start
// with Pdeathsig dies with the thread that started it.)
func inNetns(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		home, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer home.Close()
		f, err := os.Open(path)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("setns %s: %w", path, err)
			return
		}
		err = fn()
		if rerr := unix.Setns(int(home.Fd()), unix.CLONE_NEWNET); rerr != nil {
			errc <- errors.Join(err, fmt.Errorf("setns back: %w", rerr)) // the thread ends locked
			return
		}
		runtime.UnlockOSThread()
		errc <- err
	}()
	return <-errc
}

// podClient is an HTTP client whose connections start inside ns, and
// whose names resolve through the agent's DNS proxy there (15053, which
// Istio's init container points port 53 at).
func podClient(ns string) *http.Client {
	resolver := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		return dialIn(ctx, ns, network, "127.0.0.1:15053")
	}}
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			DisableKeepAlives: true, // each request a new connection: through the config as it is now
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				host, port, err := net.SplitHostPort(addr)
				if err != nil {
					return nil, err
				}
				if net.ParseIP(host) == nil {
					ips, err := resolver.LookupIP(ctx, "ip4", host)
					if err != nil {
						return nil, err
					}
					host = ips[0].String()
				}
				return dialIn(ctx, ns, network, net.JoinHostPort(host, port))
			},
		},
	}
}
