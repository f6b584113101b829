package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	envoyadmin "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/anypb"
	"sigs.k8s.io/yaml"

	"github.com/google/go-cmp/cmp"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
	"github.com/meshrelay/meshrelay/shard"
	"github.com/meshrelay/meshrelay/shard/adminpb"
	"github.com/meshrelay/meshrelay/shard/shardtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var update = flag.Bool("update", false, "rewrite the golden files in testdata")

const edsType = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"

// liveTier is a 3-relay tier with 6 Envoys over 3 keys, all on relay-0 (so
// that every answer is the same from run to run but the owners, which
// follow the members' random incarnations). Three Envoys take everything;
// three NACK endpoint updates. One endpoint has moved: the NACKing three
// are behind on EDS.
type liveTier struct {
	tier   *cluster.Tier
	fleet  *traffic.Fleet
	admin  string // relay-2's admin address: asked for the whole tier
	client adminpb.AdminClient
	moved  upstream.Change
}

// startTier starts a synthetic upstream of scenario sc and a tier of
// cfg on it (cfg.Upstream is set), stopped at the end of the test, and
// waits for the tier to converge.
func startTier(t *testing.T, sc upstream.Scenario, cfg cluster.TierConfig) (*upstream.Upstream, *cluster.Tier) {
	t.Helper()
	ctx := context.Background()
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = sc
	up, err := upstream.New(ucfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := up.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { up.Stop(context.Background()) })
	cfg.Upstream = up.Addr()
	tier, err := cluster.StartConvergedTier(ctx, cfg, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tier.Stop(context.Background()) })
	return up, tier
}

func startLiveTier(t *testing.T) *liveTier {
	t.Helper()
	ctx := context.Background()
	sc := upstream.Scenario{Services: 6, Endpoints: 6, Namespaces: 3, LocalFraction: 0}
	up, tier := startTier(t, sc, cluster.TierConfig{Relays: 3, Relay: func(c *relay.Config) { c.Admin.Listen = "127.0.0.1:0" }})
	relays := tier.Running()
	var rejecting atomic.Bool
	fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{
		Scenario: sc, Envoys: 6, Keys: 3, Protocol: envoy.Delta, Target: relays[0].Node.Relay().Addr().String(),
		Configure: func(i int, c *envoy.Config) {
			if i < 3 {
				return
			}
			c.Reject = func(typeURL string, res []*anypb.Any) error {
				if typeURL != edsType || !rejecting.Load() || len(res) == 0 {
					return nil
				}
				return fmt.Errorf("endpoint rejected by %s: priority 7 invalid", c.Node.GetId())
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fleet.Stop(context.Background()) })

	lt := &liveTier{tier: tier, fleet: fleet, admin: relays[2].Node.Relay().AdminAddr().String()}
	conn, err := grpc.NewClient(lt.admin, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	lt.client = adminpb.NewAdminClient(conn)
	lt.waitFor(t, "every Envoy current", func(ctx context.Context) bool {
		c, err := lt.client.GetConvergence(ctx, &adminpb.ConvergenceRequest{})
		return err == nil && c.GetTier().GetEnvoys() == 6 && c.GetTier().GetCurrent() == 6
	})
	rejecting.Store(true)
	if lt.moved, err = up.MoveEndpoint(0); err != nil {
		t.Fatal(err)
	}
	lt.waitFor(t, "three Envoys NACKing, the ring gossiping relay-0's streams", func(ctx context.Context) bool {
		list, err := lt.client.ListEnvoys(ctx, &adminpb.ListEnvoysRequest{Nacking: true})
		c, cerr := lt.client.GetConvergence(ctx, &adminpb.ConvergenceRequest{})
		ring, rerr := lt.client.GetRing(ctx, &adminpb.GetRingRequest{})
		return err == nil && cerr == nil && rerr == nil && len(list.GetEnvoys()) == 3 &&
			c.GetTier().GetCurrent() == 3 && ringEnvoys(ring) == "6,0,0"
	})
	return lt
}

// ringEnvoys lists the members' gossiped Envoy counts, relay-0 first.
func ringEnvoys(r *adminpb.Ring) string {
	counts := make([]string, 3)
	for _, m := range r.GetMembers() {
		if i := strings.IndexByte("012", m.GetName()[len("relay-")]); i >= 0 && i < 3 {
			counts[i] = fmt.Sprint(m.GetEnvoys())
		}
	}
	return strings.Join(counts, ",")
}

func (lt *liveTier) waitFor(t *testing.T, what string, ok func(context.Context) bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		done := ok(ctx)
		cancel()
		if done {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// relayctl runs the command against the tier and returns its exit code and
// output.
func (lt *liveTier) relayctl(args ...string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = run(append([]string{"--admin-address", lt.admin}, args...), &out, &errOut)
	return code, out.String(), errOut.String()
}

// normalize replaces what differs from run to run: addresses, member
// incarnations, ages and durations, and hashes (each distinct one becomes
// h1, h2, … in order of appearance, so equal hashes stay equal); and, as
// column widths follow those, it makes every gap between columns two
// spaces.
func normalize(s string) string {
	s = regexp.MustCompile(`127\.0\.0\.1:\d+`).ReplaceAllString(s, "ADDR")
	s = regexp.MustCompile(`(relay-\d)-[0-9a-f]{8,}`).ReplaceAllString(s, "$1-INC")
	s = regexp.MustCompile(`\b\d+(\.\d+)?(ns|µs|ms|s|m|h)\b`).ReplaceAllString(s, "DUR")
	hashes := map[string]string{}
	s = regexp.MustCompile(`\b[0-9a-f]{12,64}\b`).ReplaceAllStringFunc(s, func(h string) string {
		if _, ok := hashes[h]; !ok {
			hashes[h] = fmt.Sprintf("h%d", len(hashes)+1)
		}
		return hashes[h]
	})
	return regexp.MustCompile(` {2,}`).ReplaceAllString(s, "  ")
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	got = normalize(got)
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./cmd/relayctl -update to write it)", err)
	}
	if got != string(want) {
		t.Errorf("%s: output differs from %s (normalized; -want +got):\n%s", name, path, cmp.Diff(string(want), got))
	}
}

// TestRelayctl runs every command against a live 3-relay tier: the output
// whose content is the same from run to run is compared with golden files
// (normalized), the rest with what the admin API itself answers.
func TestRelayctl(t *testing.T) {
	lt := startLiveTier(t)
	ctx := context.Background()
	nacking := lt.fleet.Envoys()[3].ID()
	shards, err := lt.client.ListShards(ctx, &adminpb.ListShardsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(shards.GetShards()) != 3 {
		t.Fatalf("ListShards: %d shards, want 3", len(shards.GetShards()))
	}
	aKey := shards.GetShards()[0].GetKey()
	located, err := lt.client.LocateEnvoy(ctx, &adminpb.LocateEnvoyRequest{Node: nacking})
	if err != nil {
		t.Fatal(err)
	}
	// The owner follows the members' incarnations.
	ownerOf := func(s string) string {
		return strings.ReplaceAll(s, "Owner:    "+located.GetOwner(), "Owner:    OWNER")
	}
	same := func(s string) string { return s }

	for _, tc := range []struct {
		name string
		args []string
		code int
		fix  func(string) string
	}{
		{"ring", []string{"ring"}, 0, same},
		{"proxy-status", []string{"proxy-status"}, 0, same},
		{"proxy-status-lagging", []string{"proxy-status", "--lagging"}, 0, same},
		{"proxy-status-node", []string{"proxy-status", nacking}, 0, ownerOf},
		{"convergence", []string{"convergence", "--keys"}, 0, same},
		{"stragglers", []string{"stragglers"}, 0, same},
		{"delivery", []string{"delivery", "--type", "eds", "--name", lt.moved.Name, "--hash", movedHash(t, lt)}, 0, same},
		{"wait-reached", []string{"wait", "--share", "0.5"}, 0, same},
		{"wait-timeout", []string{"wait", "--share", "1", "--wait-timeout", "300ms"}, 1, same},
		{"usage-output", []string{"ring", "-o", "xml"}, 2, same},
		{"usage-args", []string{"shards", "extra"}, 2, same},
		{"usage-selector", []string{"convergence", "--key", "a", "--prefix", "b"}, 2, same},
		{"usage-delivery", []string{"delivery", "--type", "eds", "--name", "x"}, 2, same},
		{"unknown-node", []string{"proxy-status", "no-such-node"}, 1, same},
		{"proxy-config", []string{"proxy-config", nacking, "--type", "cds,lds"}, 0, same},
		{"proxy-config-usage", []string{"proxy-config"}, 2, same},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := lt.relayctl(tc.args...)
			if code != tc.code {
				t.Fatalf("relayctl %s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", strings.Join(tc.args, " "), code, tc.code, out, errOut)
			}
			golden(t, tc.name, tc.fix(out)+"--- stderr\n"+errOut)
		})
	}

	// shards and shard name owners, which follow the members' random
	// incarnations: their rows are checked against ListShards.
	t.Run("shards", func(t *testing.T) {
		code, out, errOut := lt.relayctl("shards")
		if code != 0 || errOut != "" {
			t.Fatalf("relayctl shards: exit %d, stderr %q", code, errOut)
		}
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != 5 || strings.Join(strings.Fields(lines[0]), " ") != "KEY OWNER VERSION ENVOYS CURRENT HOLDERS" {
			t.Fatalf("relayctl shards =\n%s\nwant a header, 3 rows and a sum", out)
		}
		if want := "3 keys, 6 Envoys: 2.0 Envoys a key; 0 keys serve one Envoy"; lines[4] != want {
			t.Errorf("relayctl shards sums up %q, want %q", lines[4], want)
		}
		for i, sh := range shards.GetShards() {
			want := []string{sh.GetKey(), sh.GetOwner(), sh.GetLedgerVersion()[:12], fmt.Sprint(sh.GetEnvoys()), fmt.Sprint(sh.GetCurrent()), holders(sh)}
			if got := strings.Fields(lines[i+1]); !slicesEqual(got, want) {
				t.Errorf("relayctl shards row %d = %q, want %q", i, got, want)
			}
			if sh.GetEnvoys() != 2 || sh.GetCurrent() != 1 || !strings.Contains(holders(sh), "relay-0:") {
				t.Errorf("shard %s: %d of %d current, holders %s; want 1 of 2, relay-0 holding it", sh.GetKey(), sh.GetCurrent(), sh.GetEnvoys(), holders(sh))
			}
		}
	})
	t.Run("shard", func(t *testing.T) {
		code, out, _ := lt.relayctl("shard", aKey)
		sh := shards.GetShards()[0]
		want := []string{"Key:      " + aKey, "Owner:    " + sh.GetOwner() + " (" + sh.GetOwnerXdsAddress() + ")",
			"Version:  " + sh.GetLedgerVersion(), "Envoys:   2, 1 on the current version"}
		for _, h := range sh.GetHolders() {
			// Each holder: a row, and a table of its types.
			want = append(want, h.GetRelay()+":")
			if !regexp.MustCompile(`(?m)^` + h.GetRelay() + ` +` + h.GetSource() + ` +no +` + fmt.Sprint(h.GetEnvoys()) + ` +` + h.GetLedgerVersion()[:12]).MatchString(out) {
				t.Errorf("relayctl shard %s: no row for holder %s (%s, %d Envoys):\n%s", aKey, h.GetRelay(), h.GetSource(), h.GetEnvoys(), out)
			}
		}
		for _, w := range append(want, "CDS   ", "EDS   ", "LDS   ", "RDS   ") {
			if code != 0 || !strings.Contains(out, w) {
				t.Errorf("relayctl shard %s: exit %d, output lacks %q:\n%s", aKey, code, w, out)
			}
		}
		if code, _, errOut := lt.relayctl("shard", "no/such/key"); code != 1 || !strings.Contains(errOut, `no relay holds key "no/such/key"`) {
			t.Errorf("relayctl shard no/such/key: exit %d, stderr %q; want 1 and no relay holds it", code, errOut)
		}
	})

	// proxy-config -o json is Envoy's config dump itself.
	t.Run("proxy-config-json", func(t *testing.T) {
		code, out, errOut := lt.relayctl("proxy-config", nacking, "-o", "json")
		var dump envoyadmin.ConfigDump
		if err := protojson.Unmarshal([]byte(out), &dump); code != 0 || err != nil {
			t.Fatalf("relayctl proxy-config -o json: exit %d, %v, %s", code, err, errOut)
		}
		var types []string
		for _, c := range dump.GetConfigs() {
			types = append(types, c.GetTypeUrl()[strings.LastIndex(c.GetTypeUrl(), ".")+1:])
		}
		if want := []string{"ClustersConfigDump", "EndpointsConfigDump", "ListenersConfigDump", "RoutesConfigDump"}; !slicesEqual(types, want) {
			t.Errorf("proxy-config -o json sections %v, want %v", types, want)
		}
	})

	// -o json and -o yaml print the API's answer itself.
	t.Run("json-yaml", func(t *testing.T) {
		want, err := lt.client.GetConvergence(ctx, &adminpb.ConvergenceRequest{Selector: &adminpb.Selector{Key: aKey}})
		if err != nil {
			t.Fatal(err)
		}
		for _, format := range []string{"json", "yaml"} {
			code, out, _ := lt.relayctl("convergence", "--key", aKey, "-o", format)
			b := []byte(out)
			if format == "yaml" {
				if b, err = yaml.YAMLToJSON(b); err != nil {
					t.Fatalf("-o yaml: %v", err)
				}
			}
			got := &adminpb.Convergence{}
			if err := protojson.Unmarshal(b, got); err != nil || code != 0 {
				t.Fatalf("-o %s: exit %d, %v:\n%s", format, code, err, out)
			}
			if !proto.Equal(got, want) {
				t.Errorf("-o %s = %v, want the API's %v", format, got, cmp.Diff(want, got, protocmp.Transform()))
			}
		}
	})
}

// movedHash is the moved endpoint's content hash, as a current Envoy holds
// it.
func movedHash(t *testing.T, lt *liveTier) string {
	t.Helper()
	held, ok := lt.fleet.Envoys()[0].Resources(edsType)[lt.moved.Name]
	if !ok {
		t.Fatalf("Envoy 0 does not hold %s", lt.moved.Name)
	}
	return held.Version
}

func slicesEqual(a, b []string) bool { return strings.Join(a, "\x00") == strings.Join(b, "\x00") }

// TestRelayctlSecureDrain: against a tier whose admin listeners want mTLS
// and a bearer token, relayctl reaches them with the TLS flags and the
// token file, refuses to send a token in clear text, and drains a relay it
// finds in the ring through another.
func TestRelayctlSecureDrain(t *testing.T) {
	const token = "relayctl-test-token"
	certs := shardtest.NewCerts(t)
	_, tier := startTier(t, upstream.Scenario{Services: 3, Endpoints: 3, Namespaces: 1}, cluster.TierConfig{Relays: 3, DrainPeriod: 200 * time.Millisecond,
		Relay: func(c *relay.Config) { c.Admin.Listen, c.Admin.TLS, c.Admin.Token = "127.0.0.1:0", certs.Server, token },
		Node:  func(c *shard.NodeConfig) { c.AllowMutations = true },
	})
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	relays := tier.Running()
	relayctl := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		base := []string{"--admin-address", relays[0].Node.Relay().AdminAddr().String(),
			"--ca-file", certs.CAFile, "--cert-file", certs.ClientCertFile, "--key-file", certs.ClientKeyFile}
		code := run(append(base, args...), &out, &errOut)
		return code, out.String(), errOut.String()
	}

	if code, _, errOut := relayctl("ring"); code != 1 || !strings.Contains(errOut, "Unauthenticated") {
		t.Errorf("relayctl ring without the token: exit %d, %q; want 1, Unauthenticated", code, errOut)
	}
	if code, out, errOut := relayctl("--token-file", tokenFile, "ring"); code != 0 || strings.Count(out, " alive ") != 3 {
		t.Errorf("relayctl ring with TLS and the token: exit %d\n%s%s\nwant 3 members alive", code, out, errOut)
	}
	var out, errOut bytes.Buffer
	code := run([]string{"--admin-address", relays[0].Node.Relay().AdminAddr().String(), "--token-file", tokenFile, "ring"}, &out, &errOut)
	if code != 2 || !strings.Contains(errOut.String(), "clear text") {
		t.Errorf("relayctl --token-file without TLS: exit %d, %q; want 2, refused", code, errOut.String())
	}

	drained := relays[1]
	code, got, stderr := relayctl("--token-file", tokenFile, "drain", drained.ID)
	if want := drained.Node.Ring().Name() + " draining: closing "; code != 0 || !strings.HasPrefix(got, want) || !strings.HasSuffix(got, " streams over 200ms\n") {
		t.Fatalf("relayctl drain %s: exit %d, %q %q; want %q…", drained.ID, code, got, stderr, want)
	}
	if code, got, _ := relayctl("--token-file", tokenFile, "drain", drained.ID); code != 0 || got != drained.Node.Ring().Name()+" is draining already\n" {
		// It left the ring: relayctl finds it no more, or (gossip not
		// settled yet) finds it draining already.
		if code != 1 {
			t.Errorf("relayctl drain %s again: exit %d, %q", drained.ID, code, got)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for len(relays[0].Node.Ring().Members()) != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("relay-0 still sees %d members after the drain", len(relays[0].Node.Ring().Members()))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if code, _, errOut := relayctl("--token-file", tokenFile, "drain", drained.ID); code != 1 || !strings.Contains(errOut, "no relay \""+drained.ID+"\" in the ring") {
		t.Errorf("relayctl drain of a relay out of the ring: exit %d, %q", code, errOut)
	}
}

func TestFindMember(t *testing.T) {
	ring := &adminpb.Ring{Members: []*adminpb.Member{
		{Name: "relay-1-0a0a0a0a"}, {Name: "relay-10-0b0b0b0b"}, {Name: "relay-2-0c0c0c0c"}, {Name: "relay-2-0d0d0d0d"},
	}}
	for _, tc := range []struct{ name, want, err string }{
		{"relay-1", "relay-1-0a0a0a0a", ""},
		{"relay-10", "relay-10-0b0b0b0b", ""},
		{"relay-2-0d0d0d0d", "relay-2-0d0d0d0d", ""},
		{"relay-2", "", "in the ring 2 times"},
		{"relay", "", `no relay "relay"`},
	} {
		m, err := findMember(ring, tc.name)
		if m.GetName() != tc.want || (tc.err == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), tc.err) {
			t.Errorf("findMember(%q) = %q, %v; want %q, %q", tc.name, m.GetName(), err, tc.want, tc.err)
		}
	}
}

// TestRelayctlTokenFileIdentities: relayctl with a service-account JWT in
// --token-file against a tier whose admin API proves identities. The same
// file, rewritten between commands as kubelet rotates it, makes relayctl
// a caller of ns-1 (proxy-status lists exactly ns-1's Envoys; another
// namespace's proxy config and a drain are refused), then an admin (every
// Envoy); an expired token is refused without being repeated.
func TestRelayctlTokenFileIdentities(t *testing.T) {
	const adminID = "spiffe://cluster.local/ns/istio-system/sa/istioctl"
	ctx := context.Background()
	mesh, issuer := authtest.NewCA(t, "mesh root"), authtest.NewIssuer(t)
	pair, err := tlsfiles.LoadKeyPair(mesh.Serving(t).Write(t, ""))
	if err != nil {
		t.Fatal(err)
	}
	caFile := mesh.WriteRoot(t)
	roots, err := tlsfiles.LoadCAPool(caFile)
	if err != nil {
		t.Fatal(err)
	}
	lcfg := auth.DefaultLocalConfig()
	lcfg.Issuer, lcfg.Keys = issuer.URL, auth.KeysFromFile(issuer.WriteJWKS(t))
	local, err := auth.NewLocal(ctx, lcfg)
	if err != nil {
		t.Fatal(err)
	}
	authn, err := auth.NewAuthenticator(auth.ModeAny, &auth.CertVerifier{TrustDomain: "cluster.local", Roots: roots.Certificates}, local)
	if err != nil {
		t.Fatal(err)
	}
	sc := upstream.Scenario{Services: 3, Endpoints: 3, Namespaces: 3}
	_, tier := startTier(t, sc, cluster.TierConfig{Relays: 2,
		Relay: func(c *relay.Config) {
			c.Admin.Listen = "127.0.0.1:0"
			c.Admin.TLS = tlsfiles.ServerConfig(pair, roots, tls.VerifyClientCertIfGiven, "h2", "http/1.1")
			c.Admin.Authenticator, c.Admin.Identities = authn, []string{adminID}
		},
		Node: func(c *shard.NodeConfig) { c.AllowMutations = true },
	})
	fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: sc, Envoys: 6, Keys: 3, Protocol: envoy.Delta, Target: tier.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fleet.Stop(context.Background()) })
	var all, ns1 []string
	for i, e := range fleet.Envoys() {
		all = append(all, e.ID())
		if i%3 == 1 {
			ns1 = append(ns1, e.ID())
		}
	}
	slices.Sort(all)
	slices.Sort(ns1)
	ns0Node := fleet.Envoys()[0].ID()

	relays := tier.Running()
	tokenPath := filepath.Join(t.TempDir(), "token")
	useToken := func(tk authtest.Token) string {
		tok := issuer.Sign(t, tk)
		tmp := tokenPath + ".tmp"
		if err := os.WriteFile(tmp, []byte(tok+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, tokenPath); err != nil {
			t.Fatal(err)
		}
		return tok
	}
	relayctl := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		base := []string{"--admin-address", relays[0].Node.Relay().AdminAddr().String(), "--ca-file", caFile, "--token-file", tokenPath}
		code := run(append(base, args...), &out, &errOut)
		return code, out.String(), errOut.String()
	}
	listed := func(t *testing.T) []string {
		t.Helper()
		code, out, errOut := relayctl("-o", "json", "proxy-status")
		if code != 0 {
			t.Fatalf("relayctl proxy-status: exit %d, %s", code, errOut)
		}
		var list adminpb.EnvoyList
		if err := protojson.Unmarshal([]byte(out), &list); err != nil {
			t.Fatalf("relayctl -o json proxy-status: %v\n%s", err, out)
		}
		var ids []string
		for _, e := range list.GetEnvoys() {
			ids = append(ids, e.GetNode())
		}
		slices.Sort(ids)
		return ids
	}

	useToken(authtest.Token{Namespace: "istio-system", ServiceAccount: "istioctl"})
	for deadline := time.Now().Add(30 * time.Second); !slicesEqual(listed(t), all); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("proxy-status as the admin lists %q, want %q", listed(t), all)
		}
	}

	t.Run("ns-1", func(t *testing.T) {
		useToken(authtest.Token{Namespace: "ns-1", ServiceAccount: "wl-0"})
		if got := listed(t); !slicesEqual(got, ns1) {
			t.Errorf("proxy-status as ns-1 lists %q, want %q", got, ns1)
		}
		if code, _, errOut := relayctl("proxy-config", ns1[0]); code != 0 {
			t.Errorf("proxy-config of an Envoy of ns-1 as ns-1: exit %d, %s", code, errOut)
		}
		if code, _, errOut := relayctl("proxy-config", ns0Node); code != 1 || !strings.Contains(errOut, "PermissionDenied") {
			t.Errorf("proxy-config of an Envoy of ns-0 as ns-1: exit %d, %q; want 1, PermissionDenied", code, errOut)
		}
		if code, _, errOut := relayctl("drain", relays[1].ID); code != 1 || !strings.Contains(errOut, "PermissionDenied") {
			t.Errorf("drain as ns-1 with mutations allowed: exit %d, %q; want 1, PermissionDenied", code, errOut)
		}
	})
	t.Run("rotated to the admin's", func(t *testing.T) {
		useToken(authtest.Token{Namespace: "istio-system", ServiceAccount: "istioctl"})
		if got := listed(t); !slicesEqual(got, all) {
			t.Errorf("proxy-status as the admin lists %q, want %q", got, all)
		}
	})
	t.Run("expired", func(t *testing.T) {
		tok := useToken(authtest.Token{Namespace: "istio-system", ServiceAccount: "istioctl", IssuedAt: time.Now().Add(-3 * time.Hour), TTL: time.Hour})
		code, _, errOut := relayctl("proxy-status")
		if code != 1 || !strings.Contains(errOut, "Unauthenticated") || strings.Contains(errOut, tok) {
			t.Errorf("proxy-status with an expired token: exit %d, %q; want 1, Unauthenticated, without the token", code, errOut)
		}
	})
	for _, r := range relays {
		if !r.Node.Relay().Ready() {
			t.Errorf("relay %s is not ready: a refused drain drained it", r.ID)
		}
	}
}

func TestSplitLines(t *testing.T) {
	shards := []*adminpb.Shard{
		{Key: "sidecar/default/reviews#1"},
		{Key: "sidecar/default/ratings#2", Splits: []string{"metadata.INSTANCE_IPS like sidecar~10.0.0.3~r.default~default.svc.cluster.local"}},
	}
	got := splitLines(shards)
	if len(got) != 1 || !strings.Contains(got[0], "sidecar/default/ratings#2 diverged") || !strings.Contains(got[0], "metadata.INSTANCE_IPS like sidecar~10.0.0.3~") {
		t.Errorf("splitLines = %q, want one line naming the split key and its split", got)
	}
}
