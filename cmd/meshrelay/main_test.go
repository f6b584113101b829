package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestServeFlags(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{"no upstream", []string{"--xds-listen", "127.0.0.1:0", "--admin-listen", ""}, "field Upstream.Addr is empty"},
		{"bad key profile", []string{"--upstream", "x:1", "--key-profile", "by-moon-phase"}, `unknown key profile "by-moon-phase"`},
		{"bad protocol", []string{"--upstream", "x:1", "--upstream-protocol", "rest"}, `unknown protocol "rest"`},
		{"bad log level", []string{"--upstream", "x:1", "--log-level", "loud"}, "--log-level"},
		{"extra metadata needs istio", []string{"--upstream", "x:1", "--key-profile", "per-node", "--key-metadata", "A"}, "needs the istio profile"},
		{"fields profile without fields", []string{"--upstream", "x:1", "--key-profile", "fields"}, "--key-fields or --key-config"},
		{"key fields without the fields profile", []string{"--upstream", "x:1", "--key-fields", "cluster"}, `for --key-profile fields, not "istio"`},
		{"key fields and key config", []string{"--upstream", "x:1", "--key-profile", "fields", "--key-fields", "cluster", "--key-config", "/dev/null"}, "give one"},
		{"bad key field", []string{"--upstream", "x:1", "--key-profile", "fields", "--key-fields", "cluster,nodeid"}, `unknown field "nodeid"`},
		{"missing key config", []string{"--upstream", "x:1", "--key-profile", "fields", "--key-config", "/nonexistent/keys.yaml"}, "--key-config"},
		{"bad key config", []string{"--upstream", "x:1", "--key-profile", "fields", "--key-config", "/dev/null"}, "at least one rule"},
		{"key metadata with fields", []string{"--upstream", "x:1", "--key-profile", "fields", "--key-fields", "cluster", "--key-metadata", "A"}, "--key-metadata is for the istio profile"},
		{"unknown flag", []string{"--upstrem", "x:1"}, "unknown flag: --upstrem"},
		// One convention, relayctl's: a long flag takes two dashes.
		{"long flag with one dash", []string{"-upstream", "x:1"}, "unknown shorthand flag: 'u' in -upstream"},
		{"bad gossip listen", []string{"--upstream", "x:1", "--gossip-listen", "nowhere"}, "--gossip-listen"},
		{"missing gossip key", []string{"--upstream", "x:1", "--gossip-key-file", "/nonexistent/key"}, "gossip key"},
		{"bad ring load", []string{"--upstream", "x:1", "--xds-listen", "127.0.0.1:0", "--gossip-listen", "127.0.0.1:0", "--ring-load", "0.5"}, "field Load"},
		{"bad etcd mode", []string{"--upstream", "x:1", "--etcd", "somewhere"}, `--etcd "somewhere"`},
		{"external etcd without endpoints", []string{"--upstream", "x:1", "--etcd", "external"}, "needs --etcd-endpoints"},
		{"embedded etcd and endpoints", []string{"--upstream", "x:1", "--etcd", "embedded", "--etcd-endpoints", "http://127.0.0.1:1"}, "exclude each other"},
		{"embedded etcd on TCP without client certificates", []string{"--upstream", "x:1", "--etcd", "embedded", "--etcd-data-dir", "/nonexistent/etcd", "--etcd-listen", "127.0.0.1:2379"}, "set --etcd-listen-cert-file, --etcd-listen-key-file and --etcd-listen-client-ca-file"},
		{"embedded etcd on TCP without a client CA", []string{"--upstream", "x:1", "--etcd", "embedded", "--etcd-data-dir", "/nonexistent/etcd", "--etcd-listen", "0.0.0.0:2379", "--etcd-listen-cert-file", "c", "--etcd-listen-key-file", "k"}, "--etcd-listen-client-ca-file"},
		{"etcd listen with external etcd", []string{"--upstream", "x:1", "--etcd-endpoints", "http://127.0.0.1:1", "--etcd-listen", "127.0.0.1:2379"}, "not an external one"},
		{"missing etcd CA", []string{"--upstream", "x:1", "--etcd-endpoints", "https://127.0.0.1:1", "--etcd-ca-file", "/nonexistent/ca.pem"}, "--etcd-ca-file"},
		{"missing seal key", []string{"--upstream", "x:1", "--etcd-endpoints", "http://127.0.0.1:1", "--snapshot-seal-key-file", "/nonexistent/key"}, "seal key file"},
		{"admin token in clear text", []string{"--upstream", "x:1", "--admin-token-file", "/dev/null"}, "need --admin-tls-cert"},
		{"admin client CA without TLS", []string{"--upstream", "x:1", "--admin-client-ca", "/dev/null"}, "need --admin-tls-cert"},
		{"admin cert without key", []string{"--upstream", "x:1", "--admin-tls-cert", "/nonexistent/cert.pem"}, "go together"},
		{"xds client CA without TLS", []string{"--upstream", "x:1", "--xds-client-ca", "/dev/null"}, "need --xds-tls-cert"},
		{"xds cert without key", []string{"--upstream", "x:1", "--xds-tls-cert", "/nonexistent/cert.pem"}, "go together"},
		{"missing xds cert", []string{"--upstream", "x:1", "--xds-tls-cert", "/nonexistent/cert.pem", "--xds-tls-key", "/nonexistent/key.pem"}, "--xds-tls-cert"},
		{"bad xds auth", append(tlsArgs(t), "--upstream", "x:1", "--xds-auth", "maybe"), `unknown mode "maybe"`},
		{"mtls without client CA", append(tlsArgs(t), "--upstream", "x:1", "--xds-auth", "mtls"), "needs --xds-client-ca"},
		{"tokenreview outside a cluster", append(tlsArgs(t), "--upstream", "x:1", "--xds-auth", "jwt"), "in-cluster config"},
		{"local verifier, issuer unreachable", append(tlsArgs(t), "--upstream", "x:1", "--xds-auth", "jwt", "--jwt-verifier", "local", "--jwt-issuer", "http://127.0.0.1:1"), "fetch the issuer's keys"},
		{"bad jwt verifier", append(tlsArgs(t), "--upstream", "x:1", "--xds-auth", "jwt", "--jwt-verifier", "trust-me"), `--jwt-verifier "trust-me"`},
		{"tier over TLS only", append(tlsArgs(t), "--upstream", "x:1", "--xds-auth", "none", "--gossip-listen", "127.0.0.1:0"), "needs a port its relays dial"},
		{"peer cert without CA", []string{"--upstream", "x:1", "--peer-listen", "127.0.0.1:0", "--peer-tls-cert", "/nonexistent/c.pem", "--peer-tls-key", "/nonexistent/k.pem"}, "go together"},
		{"peer TLS without a peer port", []string{"--upstream", "x:1", "--peer-tls-cert", "/nonexistent/c.pem", "--peer-tls-key", "/nonexistent/k.pem", "--peer-tls-ca", "/nonexistent/ca.pem"}, "needs --peer-listen"},
		{"peer identity without TLS", []string{"--upstream", "x:1", "--peer-identity", "spiffe://cluster.local/ns/x/sa/y"}, "needs --peer-tls-cert"},
		{"bad upstream auth", []string{"--upstream", "x:1", "--upstream-auth", "sudo"}, `--upstream-auth "sudo"`},
		{"forward without a TLS port", []string{"--upstream", "x:1", "--upstream-auth", "forward"}, "needs --xds-tls-cert"},
		{"forward without tokens to forward", append(tlsArgs(t), "--upstream", "x:1", "--xds-auth", "mtls", "--xds-client-ca", authtest.NewCA(t, "mesh root").WriteRoot(t), "--upstream-auth", "forward"), "use relay-identity"},
		{"relay identity without a token", []string{"--upstream", "x:1", "--upstream-auth", "relay-identity"}, "needs --upstream-token-file"},
		{"relay identity with an empty token", []string{"--upstream", "x:1", "--upstream-auth", "relay-identity", "--upstream-token-file", "/dev/null"}, "is empty"},
		{"upstream CA in plaintext", []string{"--upstream", "x:1", "--upstream-ca", "/dev/null"}, "need --upstream-auth forward or relay-identity"},
		{"missing upstream CA", []string{"--upstream", "x:1", "--upstream-auth", "relay-identity", "--upstream-token-file", "/etc/hostname", "--upstream-ca", "/nonexistent/ca.pem"}, "--upstream-ca"},
		{"admin identities without an authenticating xDS port", append(adminTLSArgs(t), "--upstream", "x:1", "--admin-identities", "spiffe://cluster.local/ns/istio-system/sa/istioctl"), "needs --xds-tls-cert"},
		{"missing admin cert", []string{"--upstream", "x:1", "--admin-tls-cert", "/nonexistent/cert.pem", "--admin-tls-key", "/nonexistent/key.pem"}, "--admin-tls-cert"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := serve(context.Background(), tt.args)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("serve(%q) = %v, want an error containing %q", tt.args, err, tt.wantErr)
			}
		})
	}
}

// TestServeStartsAndStops: a relay with valid flags serves until its
// context ends, then stops cleanly (goleak checks nothing is left).
func TestServeStartsAndStops(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err := serve(ctx, []string{"--upstream", "127.0.0.1:1", "--xds-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
		"--gossip-listen", "127.0.0.1:0", "--log-level", "error"})
	if err != nil {
		t.Fatalf("serve = %v, want nil after the context ended", err)
	}
}

// TestServeWithEmbeddedEtcd: --etcd embedded starts an etcd in the data
// directory, the relay runs with snapshots, and everything stops cleanly.
func TestServeWithEmbeddedEtcd(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "etcd")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	err := serve(ctx, []string{"--upstream", "127.0.0.1:1", "--xds-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
		"--gossip-listen", "", "--log-level", "error", "--etcd", "embedded", "--etcd-data-dir", dir})
	if err != nil {
		t.Fatalf("serve = %v, want nil after the context ended", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "member")); err != nil {
		t.Errorf("the embedded etcd left no data in %s: %v", dir, err)
	}
	// It listened on a socket private to this user, and on no TCP port
	// (--etcd-listen unset); the socket is gone once it stopped.
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("data directory: %v, mode %v; want 0700", err, fi.Mode().Perm())
	}
	if _, err := os.Stat(filepath.Join(dir, "etcd.sock")); !os.IsNotExist(err) {
		t.Errorf("the socket outlived the embedded etcd: %v", err)
	}
}

func TestDemoFlags(t *testing.T) {
	for _, args := range [][]string{{"--protocol", "rest"}, {"--upstream-protocol", "x"}} {
		if err := runDemo(context.Background(), args); err == nil {
			t.Errorf("runDemo(%q) = nil, want an error", args)
		}
	}
}

// TestServeTier runs two relays as the serve command wires them, the second
// joining the first, with an encrypted gossip key: both see a ring of two.
func TestServeTier(t *testing.T) {
	up, err := upstream.New(upstream.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := up.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer up.Stop(context.Background())
	keyFile := filepath.Join(t.TempDir(), "gossip.key")
	if err := os.WriteFile(keyFile, []byte("MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	gossipA := freeAddr(t)
	adminA, adminB := freeAddr(t), freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, 2)
	run := func(id, gossip, admin string, join ...string) {
		args := []string{"--id", id, "--upstream", up.Addr(), "--xds-listen", "127.0.0.1:0", "--admin-listen", admin,
			"--gossip-listen", gossip, "--gossip-key-file", keyFile, "--drain-period", "10ms", "--log-level", "error"}
		if len(join) > 0 {
			args = append(args, "--join", strings.Join(join, ","))
		}
		go func() { errs <- serve(ctx, args) }()
	}
	run("a", gossipA, adminA)
	// b binds ports of the system's choosing: start it once a holds its
	// gossip port (a ring of one), or b might take that port.
	for deadline := time.Now().Add(20 * time.Second); !strings.Contains(scrape(adminA), "meshrelay_ring_members 1") && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	run("b", "127.0.0.1:0", adminB, gossipA)
	defer func() {
		cancel()
		for range 2 {
			if err := <-errs; err != nil {
				t.Errorf("serve: %v", err)
			}
		}
	}()
	for _, admin := range []string{adminA, adminB} {
		deadline := time.Now().Add(20 * time.Second)
		for !strings.Contains(scrape(admin), "meshrelay_ring_members 2") {
			if time.Now().After(deadline) {
				t.Fatalf("relay at %s does not see a ring of 2", admin)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

func scrape(admin string) string {
	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// freeAddr returns a loopback address free for TCP and UDP.
func freeAddr(t *testing.T) string {
	t.Helper()
	for range 20 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		if u, err := net.ListenPacket("udp", addr); err == nil {
			u.Close()
			return addr
		}
	}
	t.Fatal("no free address")
	return ""
}

// tlsArgs are the flags of a TLS xDS port with a serving pair of a test
// CA, listening on loopback.
func tlsArgs(t *testing.T) []string {
	t.Helper()
	cert, key := authtest.NewCA(t, "mesh root").Serving(t).Write(t, "")
	return []string{"--xds-tls-cert", cert, "--xds-tls-key", key, "--xds-tls-listen", "127.0.0.1:0", "--admin-listen", ""}
}

// adminTLSArgs are the flags of an admin listener on TLS.
func adminTLSArgs(t *testing.T) []string {
	t.Helper()
	cert, key := authtest.NewCA(t, "admin root").Serving(t).Write(t, "")
	return []string{"--admin-tls-cert", cert, "--admin-tls-key", key, "--admin-listen", "127.0.0.1:0"}
}
