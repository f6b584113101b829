//go:build linux

package realistio

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// The operating guide's command blocks, run as written (issue 29; they
// were the README's until issue 30 moved them to deploy/OPERATING.md):
// each ```sh block of deploy/OPERATING.md's "Running a relay" and "Istio
// with TLS" runs through bash against a real istiod (startMesh), and the
// relay it starts must become ready and serve a sidecar.
//
// A block runs on a machine of its own, as an operator's would: a network
// namespace the test makes (root only), where the fixed ports the block
// and the flags' defaults name (:15010, :15011, :15012, :15014, :7946) are
// free and eth0 has a pod's address, linked to a second namespace that
// plays istiod's host. The block's /etc/hosts (a mount namespace of its
// own) names that host istiod.istio-system.svc, and there the test
// forwards 15010 and 15012 to the real istiod's loopback ports; the API
// server's loopback port is forwarded into the block's namespace, where
// the kubeconfig names it. Everything in the block the test changes is in
// readmeBlocks.

// readmeBlock is a section of the operating guide (operatingDoc) whose
// command block the test runs, and every change the test makes to the
// block before running it.
type readmeBlock struct {
	section string // the heading's text, any level
	// inRepo: the block runs in the repository's root (it builds), else
	// in the test's working directory, beside the binary it built.
	inRepo bool
	// rewrites are applied in order; {work} and {kubeconfig} in new
	// stand for the working directory and the API server's kubeconfig.
	rewrites []blockRewrite
	// files writes the files the block names into its working
	// directory; mentions are phrases the section must contain, which
	// those files' names and identities come from.
	files    func(t *testing.T, dir string, m *mesh)
	mentions []string
	// serve checks what the block started: ready, and serving a sidecar.
	serve func(t *testing.T, ctx context.Context, m *mesh, h *blockHost, exited <-chan struct{})
}

// blockRewrite replaces old (which must occur in the block) by new; an
// empty old appends new to the block's last command.
type blockRewrite struct{ old, new string }

var readmeBlocks = []readmeBlock{
	{
		section: "Running a relay",
		inRepo:  true,
		rewrites: []blockRewrite{
			// The build runs in the repository; its binary goes to the
			// test's directory, not into the working tree.
			{"go build -o meshrelay ", "go build -o {work}/meshrelay "},
			{"./meshrelay serve", "{work}/meshrelay serve"},
		},
		serve: servesPlaintext,
	},
	{
		section: "Istio with TLS",
		rewrites: []blockRewrite{
			// "Outside a pod add `--kubeconfig` for TokenReview."
			{"", " --kubeconfig {kubeconfig}"},
		},
		files:    writeTLSBlockFiles,
		mentions: []string{"meshrelay.istio-system.svc", tierSPIFFEID, "istio-ca-root-cert"},
		serve:    servesTLS,
	},
}

// tierSPIFFEID is the tier's identity, peer.crt's (deploy/OPERATING.md,
// "Istio with TLS").
const tierSPIFFEID = "spiffe://cluster.local/ns/istio-system/sa/meshrelay"

// reviewsCluster is the cluster istiod builds for startMesh's Service.
const reviewsCluster = "outbound|9080||reviews.ns1.svc.cluster.local"

// operatingDoc is the document whose sections readmeBlocks names, from
// the repository's root.
const operatingDoc = "deploy/OPERATING.md"

// TestReadmeBlocks runs deploy/OPERATING.md's command blocks of "Running
// a relay" and "Istio with TLS" as written (but for readmeBlocks'
// rewrites), each on a network namespace of its own in front of a real
// istiod: each relay becomes ready and serves a sidecar its clusters, over
// plaintext ADS, or over TLS with the sidecar's real service-account
// token.
func TestReadmeBlocks(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "..", filepath.FromSlash(operatingDoc)))
	if err != nil {
		t.Fatal(err)
	}
	blocks := make([]string, len(readmeBlocks))
	for i, b := range readmeBlocks {
		if blocks[i], err = shBlock(string(readme), b.section, b.mentions); err != nil {
			t.Fatalf("%s: %v", operatingDoc, err)
		}
	}
	binaries(t)
	if err := canMakeBlockHosts(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s's blocks run in network namespaces (CI=true): %v", operatingDoc, err)
		}
		t.Skipf("%s's blocks run in network namespaces: %v", operatingDoc, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	m := startMesh(t, ctx)
	if err := m.kube.AddServiceAccount(ctx, "ns1", "default"); err != nil {
		t.Fatal(err)
	}
	repo, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	for i, b := range readmeBlocks {
		t.Run(b.section, func(t *testing.T) {
			// A block's build, on 2 cores with a cold cache, and its
			// relay's start.
			ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
			defer cancel()
			script := blocks[i]
			for _, rw := range b.rewrites {
				var err error
				if script, err = rw.apply(script, strings.NewReplacer("{work}", work, "{kubeconfig}", m.kube.Kubeconfig)); err != nil {
					t.Fatalf("%s, %q: %v (update readmeBlocks)", operatingDoc, b.section, err)
				}
			}
			dir := work
			if b.inRepo {
				dir = repo
			} else {
				ensureBlockBinary(t, ctx, repo, work)
			}
			if b.files != nil {
				b.files(t, dir, m)
			}
			t.Logf("runs in %s:\n%s", dir, script)
			h := newBlockHost(t, m)
			exited := h.run(t, dir, script, processLog(t, m.dir, "readme-"+strconv.Itoa(i)))
			b.serve(t, ctx, m, h, exited)
		})
	}
}

func (rw blockRewrite) apply(script string, vars *strings.Replacer) (string, error) {
	val := vars.Replace(rw.new)
	if rw.old == "" {
		return strings.TrimRight(script, " \n") + val + "\n", nil
	}
	if !strings.Contains(script, rw.old) {
		return "", fmt.Errorf("the block no longer contains %q", rw.old)
	}
	return strings.ReplaceAll(script, rw.old, val), nil
}

// mdHeading matches a Markdown heading; its group is the heading's text.
var mdHeading = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*$`)

// shBlock returns the one ```sh block of the document's section heading
// (a heading of any level), up to the next heading: a subsection's blocks
// are its own. The section must contain each of mentions.
func shBlock(readme, heading string, mentions []string) (string, error) {
	var (
		found, in, fenced, sh bool
		text, block           strings.Builder
		blocks                []string
	)
	sc := bufio.NewScanner(strings.NewReader(readme))
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
			if fenced {
				sh = in && strings.TrimSpace(strings.TrimPrefix(line, "```")) == "sh"
			} else if sh {
				blocks = append(blocks, block.String())
				block.Reset()
				sh = false
			}
			continue
		}
		if h := mdHeading.FindStringSubmatch(line); h != nil && !fenced {
			if in = h[1] == heading; in {
				found = true
			}
			continue
		}
		if in {
			text.WriteString(line + "\n")
		}
		if sh {
			block.WriteString(line + "\n")
		}
	}
	switch {
	case !found:
		return "", fmt.Errorf("no section %q: TestReadmeBlocks runs its command block (readmeBlocks names the sections)", heading)
	case len(blocks) != 1:
		return "", fmt.Errorf("section %q has %d ```sh blocks, want 1: readmeBlocks knows how to run and check one", heading, len(blocks))
	}
	for _, s := range mentions {
		if !strings.Contains(text.String(), s) {
			return "", fmt.Errorf("section %q no longer mentions %s, which the test's files for its block are named by", heading, s)
		}
	}
	return blocks[0], nil
}

// ensureBlockBinary builds ./meshrelay in work if "Running a relay" did
// not (a -run that leaves it out).
func ensureBlockBinary(t *testing.T, ctx context.Context, repo, work string) {
	t.Helper()
	bin := filepath.Join(work, "meshrelay")
	if _, err := os.Stat(bin); err == nil {
		return
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/meshrelay")
	cmd.Dir = repo
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build meshrelay: %v\n%s", err, out)
	}
}

// writeTLSBlockFiles writes the files "Istio with TLS" names into dir,
// signed by the mesh's root as the section says: root-cert.pem (the mesh
// root, istio-ca-root-cert), tls.crt and tls.key (serving
// meshrelay.istio-system.svc, the name sidecars dial), peer.crt and
// peer.key (the tier's SPIFFE ID), and gossip.key (the tier's gossip key,
// as openssl rand -base64 32 writes it).
func writeTLSBlockFiles(t *testing.T, dir string, m *mesh) {
	t.Helper()
	root := m.istiod.Root
	serving, err := root.Make(authtest.Leaf{DNSNames: []string{"meshrelay.istio-system.svc"}})
	if err != nil {
		t.Fatal(err)
	}
	peer, err := root.Make(authtest.Leaf{URIs: []string{tierSPIFFEID}})
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range map[string][]byte{
		"root-cert.pem": root.RootPEM(),
		"tls.crt":       serving.CertPEM, "tls.key": serving.KeyPEM,
		"peer.crt": peer.CertPEM, "peer.key": peer.KeyPEM,
		"gossip.key": []byte(base64.StdEncoding.EncodeToString([]byte("meshrelay readme test gossip key")) + "\n"),
	} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// servesPlaintext: the relay of "Running a relay" is ready on its admin
// port (:15014, cleartext) and serves a sidecar of ns1/reviews its
// clusters on :15010.
func servesPlaintext(t *testing.T, ctx context.Context, m *mesh, h *blockHost, exited <-chan struct{}) {
	hc := h.pod.httpClient(nil)
	defer hc.CloseIdleConnections()
	waitBlockReady(t, ctx, hc, "http://127.0.0.1:15014/readyz", exited)
	conn, err := grpc.NewClient("passthrough:///127.0.0.1:15010",
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(h.pod.dial))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	waitBlockServes(t, ctx, conn, sidecarNode("ns1", "reviews", 0), "", exited)
}

// servesTLS: the relay of "Istio with TLS" is ready on its admin port
// (TLS: health needs no identity) and serves a sidecar of ns1/reviews,
// dialling meshrelay.istio-system.svc with the mesh root and its own
// service-account token, its clusters on :15012 (which it fetched from
// istiod's 15012 with that token: --upstream-auth forward).
func servesTLS(t *testing.T, ctx context.Context, m *mesh, h *blockHost, exited <-chan struct{}) {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(m.istiod.Root.RootPEM())
	tc := &tls.Config{RootCAs: pool, ServerName: "meshrelay.istio-system.svc", MinVersion: tls.VersionTLS12}
	hc := h.pod.httpClient(tc)
	defer hc.CloseIdleConnections()
	waitBlockReady(t, ctx, hc, "https://127.0.0.1:15014/readyz", exited)
	conn, err := grpc.NewClient("passthrough:///127.0.0.1:15012",
		grpc.WithTransportCredentials(credentials.NewTLS(tc)), grpc.WithContextDialer(h.pod.dial))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	waitBlockServes(t, ctx, conn, sidecarNode("ns1", "reviews", 0), m.kube.Token(t, ctx, "ns1", "default"), exited)
}

// waitBlockReady polls url until it answers 200, failing the test if the
// block's processes exit or ctx ends first.
func waitBlockReady(t *testing.T, ctx context.Context, hc *http.Client, url string, exited <-chan struct{}) {
	t.Helper()
	for last := ""; ; {
		resp, err := hc.Get(url)
		if err == nil {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			last = fmt.Sprintf("%s: %s", resp.Status, b)
		} else {
			last = err.Error()
		}
		select {
		case <-exited:
			t.Fatalf("the block ended before %s answered 200 (last: %s)", url, last)
		case <-ctx.Done():
			t.Fatalf("%s never answered 200: %s", url, last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// waitBlockServes asks conn for node's clusters over SotW ADS (presenting
// token if not empty) on new streams until they include reviewsCluster;
// the relay refuses streams (Unavailable) until it reached istiod, and
// istiod builds the Service's cluster a moment after it is written.
func waitBlockServes(t *testing.T, ctx context.Context, conn *grpc.ClientConn, node *core.Node, token string, exited <-chan struct{}) {
	t.Helper()
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	for {
		names, err := clusterNames(ctx, conn, node)
		if err == nil && slices.Contains(names, reviewsCluster) {
			return
		}
		if err != nil && status.Code(err) != codes.Unavailable {
			t.Fatalf("clusters of %s: %v", node.GetId(), err)
		}
		select {
		case <-exited:
			t.Fatalf("the block ended before it served %s (last: %v, %v)", reviewsCluster, names, err)
		case <-ctx.Done():
			t.Fatalf("%s never served (last: %v, %v)", reviewsCluster, names, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// clusterNames is the first CDS answer to node on a new stream, by name.
func clusterNames(ctx context.Context, conn *grpc.ClientConn, node *core.Node) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		return nil, err
	}
	if err := st.Send(&discovery.DiscoveryRequest{Node: node, TypeUrl: xds.TypeCluster}); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	resp, err := st.Recv()
	for err == nil && resp.GetTypeUrl() != xds.TypeCluster {
		resp, err = st.Recv()
	}
	if err != nil {
		return nil, err
	}
	var names []string
	for _, a := range resp.GetResources() {
		var c cluster.Cluster
		if err := a.UnmarshalTo(&c); err != nil {
			return nil, err
		}
		names = append(names, c.GetName())
	}
	return names, nil
}

// canMakeBlockHosts reports whether newBlockHost can work here: root, nsenter
// and unshare (util-linux), ip (iproute2), and a kernel that lets it
// unshare a network namespace.
func canMakeBlockHosts() error {
	if os.Geteuid() != 0 {
		return errors.New("not root")
	}
	for _, bin := range []string{"nsenter", "unshare", "ip", "sleep"} {
		if _, err := exec.LookPath(bin); err != nil {
			return err
		}
	}
	cmd := exec.Command("true")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	return cmd.Run()
}

// The addresses of a block's link: its eth0, and istiod's host.
const (
	blockPodAddr    = "10.15.0.2"
	blockIstiodAddr = "10.15.0.1"
)

// blockHost is the machine a block runs on (pod), and the host its
// istiod.istio-system.svc names (istiod), each a network namespace the
// test made, linked by a veth pair.
type blockHost struct {
	pod, istiod *blockNetns
	hosts       string // the /etc/hosts the block sees
}

// newBlockHost makes a block's network: loopback and eth0 (blockPodAddr)
// in pod; blockIstiodAddr in istiod, where 15010 and 15012 forward to the
// real istiod's plaintext and TLS ports; in pod, the API server's
// loopback address forwards to the real one. Everything ends with the
// test.
func newBlockHost(t *testing.T, m *mesh) *blockHost {
	t.Helper()
	h := &blockHost{pod: newBlockNetns(t), istiod: newBlockNetns(t)}
	h.pod.ip(t, "link", "add", "eth0", "type", "veth", "peer", "name", "istiod0", "netns", strconv.Itoa(h.istiod.pid))
	h.pod.ip(t, "addr", "add", blockPodAddr+"/24", "dev", "eth0")
	h.pod.ip(t, "link", "set", "eth0", "up")
	h.istiod.ip(t, "addr", "add", blockIstiodAddr+"/24", "dev", "istiod0")
	h.istiod.ip(t, "link", "set", "istiod0", "up")
	h.istiod.forward(t, blockIstiodAddr+":15010", m.istiod.PlainAddr)
	h.istiod.forward(t, blockIstiodAddr+":15012", m.istiod.TLSAddr)
	u, err := url.Parse(m.kube.URL)
	if err != nil {
		t.Fatal(err)
	}
	h.pod.forward(t, u.Host, u.Host)
	h.hosts = filepath.Join(t.TempDir(), "hosts")
	if err := os.WriteFile(h.hosts, []byte("127.0.0.1 localhost\n::1 localhost\n"+blockIstiodAddr+" istiod.istio-system.svc\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return h
}

// run starts script through bash in dir, on pod, in a mount namespace
// whose /etc/hosts is h.hosts and a PID namespace whose processes all
// die with it: at the end of the test, or when the test process dies. Its
// output goes to log; the channel closes when it ends.
func (h *blockHost) run(t *testing.T, dir, script string, log io.Writer) <-chan struct{} {
	t.Helper()
	file := filepath.Join(t.TempDir(), "block.sh")
	if err := os.WriteFile(file, []byte(script), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("nsenter", "--net="+h.pod.path(), "--",
		"unshare", "--mount", "--pid", "--kill-child", "--",
		"sh", "-c", `mount --bind "$1" /etc/hosts && exec bash "$2"`, "block", h.hosts, file)
	cmd.Dir, cmd.Stdout, cmd.Stderr = dir, log, log
	cmd.SysProcAttr = childAttr()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		// Killing the PID namespace's first process (bash) kills every
		// process in it, and unshare ends once they are gone; killing
		// unshare alone would leave that to happen after it.
		kids, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
		for _, f := range strings.Fields(string(kids)) {
			if pid, err := strconv.Atoi(f); err == nil {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	return exited
}

// blockNetns is a network namespace the test made, held by a process of its
// own until the test ends.
type blockNetns struct{ pid int }

func newBlockNetns(t *testing.T) *blockNetns {
	t.Helper()
	cmd := exec.Command("sleep", "infinity")
	cmd.SysProcAttr = childAttr()
	cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWNET
	if err := cmd.Start(); err != nil {
		t.Fatalf("a network namespace: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	n := &blockNetns{pid: cmd.Process.Pid}
	n.ip(t, "link", "set", "lo", "up")
	return n
}

func (n *blockNetns) path() string { return fmt.Sprintf("/proc/%d/ns/net", n.pid) }

// ip runs iproute2's ip in the namespace.
func (n *blockNetns) ip(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command("nsenter", append([]string{"--net=" + n.path(), "ip"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// in runs fn in the namespace (inNetns).
func (n *blockNetns) in(fn func() error) error { return inNetns(n.path(), fn) }

// dial connects to addr (an IP address and port) in the namespace.
func (n *blockNetns) dial(ctx context.Context, addr string) (c net.Conn, err error) {
	if ierr := n.in(func() error {
		c, err = (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		return nil
	}); ierr != nil {
		return nil, ierr
	}
	return c, err
}

// httpClient dials in the namespace; tc (nil: none) is its TLS.
func (n *blockNetns) httpClient(tc *tls.Config) *http.Client {
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext:     func(ctx context.Context, _, addr string) (net.Conn, error) { return n.dial(ctx, addr) },
		TLSClientConfig: tc,
	}}
}

// forward listens on addr in the namespace and joins each connection
// to a new one to to, dialled from the test's own namespace, until the
// test ends.
func (n *blockNetns) forward(t *testing.T, addr, to string) {
	t.Helper()
	var l net.Listener
	if err := n.in(func() (err error) {
		l, err = net.Listen("tcp", addr)
		return err
	}); err != nil {
		t.Fatalf("forward %s: %v", addr, err)
	}
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		conns  = map[net.Conn]bool{}
		closed bool
	)
	track := func(cs ...net.Conn) bool {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range cs {
			conns[c] = true
		}
		return !closed
	}
	join := func(c net.Conn) {
		defer wg.Done()
		defer c.Close()
		up, err := net.Dial("tcp", to)
		if err != nil {
			return
		}
		defer up.Close()
		if !track(c, up) {
			return
		}
		done := make(chan struct{}, 2)
		for _, p := range [][2]net.Conn{{up, c}, {c, up}} {
			go func() {
				_, _ = io.Copy(p[0], p[1])
				_ = p[0].(*net.TCPConn).CloseWrite()
				done <- struct{}{}
			}()
		}
		<-done
		<-done
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go join(c)
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		closed = true
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}
