package snapshot

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Store is what a relay persists its views to.
var (
	_ relay.Snapshots    = (*Store)(nil)
	_ relay.HeldVersions = (*Store)(nil)
)

const (
	typeCluster  = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	typeEndpoint = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
	typeRoute    = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
)

// etcdFor starts an embedded etcd in a temporary directory, stopped at the
// end of the test.
func etcdFor(t *testing.T) *Embedded {
	t.Helper()
	e, err := StartEmbedded(t.Context(), EmbeddedConfig{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e
}

// storeFor starts a Store on endpoints as member, stopped at the end of the
// test. adjust, if set, changes the configuration first.
func storeFor(t *testing.T, endpoints []string, member string, adjust func(*Config)) *Store {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Endpoints = endpoints
	cfg.Member = member
	cfg.FlushInterval = 10 * time.Millisecond
	cfg.RetryMax = 200 * time.Millisecond
	cfg.RequestTimeout = 2 * time.Second
	cfg.GCInterval = -1
	cfg.Registerer = prometheus.NewRegistry()
	if adjust != nil {
		adjust(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.Stop(ctx)
	})
	return s
}

// res makes a resource whose hash is its content's, as the relay's are.
// Its body parses as typeURL (the store checks it for sensitive fields):
// what it says is in a field no Envoy type has.
func res(typeURL, name string, body []byte) *xds.Resource {
	b := protowire.AppendBytes(protowire.AppendTag(nil, 4095, protowire.BytesType), append([]byte(typeURL+"\x00"+name+"\x00"), body...))
	return &xds.Resource{Type: typeURL, Name: name, Hash: ledger.HashBytes(b), Body: &anypb.Any{TypeUrl: typeURL, Value: b}}
}

// viewOf builds a View from resources.
func viewOf(typeURL string, full bool, rs ...*xds.Resource) xds.View {
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, r := range rs {
		b.Set(r.Name, r.Hash, r)
	}
	return xds.View{Type: typeURL, Full: full, Tree: b.Tree()}
}

// waitWritten waits until s has nothing pending or being written.
func waitWritten(t *testing.T, s *Store) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if n, _ := s.Behind(); n == 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	n, d := s.Behind()
	t.Fatalf("store still behind after 60s: %d keys, oldest %s", n, d)
}

// loaded returns what a fresh store finds in etcd: key → type → name → body.
func loaded(t *testing.T, endpoints []string, adjust func(*Config)) map[string]map[string]map[string][]byte {
	t.Helper()
	// What was persisted is checked, not how fast etcd answers: a page of
	// chunks read from an in-process etcd under the race detector, on a
	// machine running other tests, has taken more than the default 10 s.
	s := storeFor(t, endpoints, "reader", func(c *Config) {
		c.RequestTimeout = 2 * time.Minute
		if adjust != nil {
			adjust(c)
		}
	})
	keys, err := s.Load(t.Context())
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	out := map[string]map[string]map[string][]byte{}
	for _, k := range keys {
		out[k.Key] = map[string]map[string][]byte{}
		for _, st := range k.Types {
			m := map[string][]byte{}
			for _, r := range st.Resources {
				m[r.Name] = r.Body
			}
			out[k.Key][st.Type] = m
		}
	}
	return out
}

func want(views ...xds.View) map[string]map[string][]byte {
	out := map[string]map[string][]byte{}
	for _, v := range views {
		m := map[string][]byte{}
		for e := range v.Tree.All() {
			m[e.Name] = e.Value.Body.GetValue()
		}
		out[v.Type] = m
	}
	return out
}

func sameContent(t *testing.T, what string, got, want map[string]map[string][]byte) {
	t.Helper()
	if !maps.EqualFunc(got, want, func(a, b map[string][]byte) bool {
		return maps.EqualFunc(a, b, bytes.Equal)
	}) {
		t.Errorf("%s: loaded types %v, want %v (or bodies differ)", what, slices.Sorted(maps.Keys(got)), slices.Sorted(maps.Keys(want)))
		for typ := range want {
			if !maps.EqualFunc(got[typ], want[typ], bytes.Equal) {
				t.Errorf("%s: %s: loaded %d resources, want %d", what, typ, len(got[typ]), len(want[typ]))
			}
		}
	}
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

func TestRoundTripWithLargeResourceAndSharedContent(t *testing.T) {
	e := etcdFor(t)
	s := storeFor(t, e.Endpoints(), "a", nil)
	shared := res(typeCluster, "shared", []byte("cluster body"))
	big := res(typeRoute, "big", randomBytes(5<<20)) // a 5 MB RouteConfiguration is real
	k1 := []xds.View{viewOf(typeCluster, true, shared, res(typeCluster, "only-1", []byte("x"))), viewOf(typeRoute, false, big)}
	k2 := []xds.View{viewOf(typeCluster, true, shared)}
	s.Save("key-1", 0, k1)
	s.Save("key/2 with odd characters", 0, k2)
	waitWritten(t, s)

	got := loaded(t, e.Endpoints(), nil)
	sameContent(t, "key-1", got["key-1"], want(k1...))
	sameContent(t, "key 2", got["key/2 with odd characters"], want(k2...))

	// The shared resource is stored once.
	resp, err := s.cli.Get(t.Context(), s.resKey(shared.Hash), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	if resp.Count != 1 {
		t.Errorf("shared resource stored %d times, want once", resp.Count)
	}
}

func TestChangesAppendSmallRecordsThenCompact(t *testing.T) {
	e := etcdFor(t)
	s := storeFor(t, e.Endpoints(), "a", func(c *Config) { c.CompactAfter = 5 })
	var eps []*xds.Resource
	for i := range 2000 {
		eps = append(eps, res(typeEndpoint, fmt.Sprintf("outbound|80||svc-%d.ns-1.svc.cluster.local", i), []byte(fmt.Sprintf("endpoints of %d v0", i))))
	}
	s.Save("k", 0, []xds.View{viewOf(typeEndpoint, false, eps...)})
	waitWritten(t, s)
	if got := testutil.ToFloat64(s.m.bases); got != 1 {
		t.Fatalf("bases after the first write = %v, want 1", got)
	}
	for i := range 7 {
		before := testutil.ToFloat64(s.m.bytes)
		eps[i] = res(typeEndpoint, eps[i].Name, []byte(fmt.Sprintf("endpoints of %d v1", i)))
		s.Save("k", 0, []xds.View{viewOf(typeEndpoint, false, eps...)})
		waitWritten(t, s)
		written := testutil.ToFloat64(s.m.bytes) - before
		base := testutil.ToFloat64(s.m.bases)
		// A one-endpoint change writes one resource and one log record,
		// until the log reaches CompactAfter records.
		if i < 5 && (base != 1 || written > 512) {
			t.Errorf("change %d: wrote %v bytes and %v bases, want ≤ 512 bytes and no new base", i, written, base)
		}
		if i == 5 && base != 2 {
			t.Errorf("change %d: bases = %v, want 2 (log compacted)", i, base)
		}
		sameContent(t, fmt.Sprintf("after change %d", i), loaded(t, e.Endpoints(), nil)["k"], want(viewOf(typeEndpoint, false, eps...)))
	}
	// The records the base replaced are collected (after two passes).
	batches := func() int64 {
		resp, err := s.cli.Get(t.Context(), s.root+"batch/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Count
	}
	if got := batches(); got != 6 {
		t.Errorf("batch records before collection = %d, want 6 (5 before the new base, 1 after)", got)
	}
	for range 2 {
		if _, err := s.Collect(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	if got := batches(); got != 1 {
		t.Errorf("batch records after collection = %d, want 1 (the one after the new base)", got)
	}
	sameContent(t, "after collection", loaded(t, e.Endpoints(), nil)["k"], want(viewOf(typeEndpoint, false, eps...)))

	// Removing a type drops it.
	s.Save("k", 0, []xds.View{viewOf(typeCluster, true, res(typeCluster, "c", []byte("c")))})
	waitWritten(t, s)
	if got := loaded(t, e.Endpoints(), nil)["k"]; got[typeEndpoint] != nil || got[typeCluster] == nil {
		t.Errorf("after the type change: loaded types %v, want only clusters", slices.Sorted(maps.Keys(got)))
	}
}

func TestDeposedOwnerCannotOverwrite(t *testing.T) {
	e := etcdFor(t)
	a := storeFor(t, e.Endpoints(), "relay-a", nil)
	b := storeFor(t, e.Endpoints(), "relay-b", nil)
	va := []xds.View{viewOf(typeCluster, true, res(typeCluster, "c", []byte("from a")))}
	vb := []xds.View{viewOf(typeCluster, true, res(typeCluster, "c", []byte("from b")))}
	va2 := []xds.View{viewOf(typeCluster, true, res(typeCluster, "c", []byte("from a, later")))}

	a.Save("k", 7, va)
	waitWritten(t, a)
	b.Save("k", 1, vb) // b became the owner
	waitWritten(t, b)
	a.Save("k", 7, va2) // a, deposed, has not seen the ring change yet
	waitWritten(t, a)
	sameContent(t, "after the deposed write", loaded(t, e.Endpoints(), nil)["k"], want(vb...))
	if got := testutil.ToFloat64(a.m.deposed); got != 1 {
		t.Errorf("a's deposed count = %v, want 1", got)
	}
	// Its next write in the same term is not even tried.
	a.Save("k", 7, va2)
	waitWritten(t, a)
	if got := testutil.ToFloat64(a.m.deposed); got != 1 {
		t.Errorf("a's deposed count after a second save = %v, want still 1", got)
	}
	sameContent(t, "still b", loaded(t, e.Endpoints(), nil)["k"], want(vb...))

	// A later term (a's ring changed and says it owns the key again):
	// a claims the key, and now b is the one fenced off.
	a.Save("k", 8, va2)
	waitWritten(t, a)
	sameContent(t, "a again", loaded(t, e.Endpoints(), nil)["k"], want(va2...))
	b.Save("k", 1, vb)
	waitWritten(t, b)
	sameContent(t, "b fenced", loaded(t, e.Endpoints(), nil)["k"], want(va2...))
}

// TestDeposedOwnerClaimsBackWhatItStillOwns: a relay cut off from the gossip
// believed it owned the key and claimed it. The owner, whose ring never
// moved (its writes come in the same term), claims the key back once
// ReclaimAfter has passed, with the views it was refused and no other
// Save; a relay whose ring says the key is another's does not.
func TestDeposedOwnerClaimsBackWhatItStillOwns(t *testing.T) {
	va := []xds.View{viewOf(typeCluster, true, res(typeCluster, "c", []byte("from the owner")))}
	vb := []xds.View{viewOf(typeCluster, true, res(typeCluster, "c", []byte("from the partitioned relay")))}
	va2 := []xds.View{viewOf(typeCluster, true, res(typeCluster, "c", []byte("from the owner, later")))}
	for _, owns := range []bool{true, false} {
		t.Run(fmt.Sprintf("owns=%v", owns), func(t *testing.T) {
			e := etcdFor(t)
			a := storeFor(t, e.Endpoints(), "owner", func(c *Config) {
				c.ReclaimAfter = 300 * time.Millisecond
				c.Owns = func(string) bool { return owns }
			})
			b := storeFor(t, e.Endpoints(), "partitioned", nil)
			a.Save("k", 3, va)
			waitWritten(t, a)
			b.Save("k", 9, vb)
			waitWritten(t, b)
			a.Save("k", 3, va2) // refused: b claimed the key
			waitWritten(t, a)
			if got := testutil.ToFloat64(a.m.deposed); got != 1 {
				t.Fatalf("the owner's deposed count = %v, want 1", got)
			}
			// The refused views wait for ReclaimAfter, then go to the
			// writer, which claims the key back or drops them.
			for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				a.mu.Lock()
				parked := len(a.parked)
				a.mu.Unlock()
				if parked == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the refused views are still parked after 60s")
				}
			}
			waitWritten(t, a)
			if !owns {
				sameContent(t, "the key is not the relay's", loaded(t, e.Endpoints(), nil)["k"], want(vb...))
				if got := testutil.ToFloat64(a.m.reclaims); got != 0 {
					t.Errorf("reclaims = %v, want 0", got)
				}
				return
			}
			sameContent(t, "claimed back", loaded(t, e.Endpoints(), nil)["k"], want(va2...))
			if got := testutil.ToFloat64(a.m.reclaims); got != 1 {
				t.Errorf("reclaims = %v, want 1", got)
			}
			// The partitioned relay, back in the ring, writes no more; had
			// it a late write, it would be fenced off in turn.
			b.Save("k", 9, vb)
			waitWritten(t, b)
			sameContent(t, "the partitioned relay fenced off", loaded(t, e.Endpoints(), nil)["k"], want(va2...))
		})
	}
}

func TestCollectRemovesOnlyUnreferenced(t *testing.T) {
	e := etcdFor(t)
	s := storeFor(t, e.Endpoints(), "a", nil)
	r1 := res(typeCluster, "r1", []byte("one"))
	r2 := res(typeCluster, "r2", []byte("two"))
	r3 := res(typeCluster, "r3", []byte("three"))
	s.Save("k1", 0, []xds.View{viewOf(typeCluster, true, r1, r2)})
	s.Save("k2", 0, []xds.View{viewOf(typeCluster, true, r2, r3)})
	waitWritten(t, s)
	s.Save("k1", 0, []xds.View{viewOf(typeCluster, true, r2)}) // r1 unreferenced now
	waitWritten(t, s)

	exists := func(h ledger.Hash) bool {
		resp, err := s.cli.Get(t.Context(), s.resKey(h), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Count == 1
	}
	n, err := s.Collect(t.Context())
	if err != nil || n != 0 {
		t.Fatalf("first pass: deleted %d, %v; want 0 (an object must be unreferenced in two passes)", n, err)
	}
	n, err = s.Collect(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if exists(r1.Hash) {
		t.Errorf("r1 (unreferenced) survived two passes")
	}
	for _, r := range []*xds.Resource{r2, r3} {
		if !exists(r.Hash) {
			t.Errorf("%s (referenced) was deleted", r.Name)
		}
	}
	if n < 1 {
		t.Errorf("second pass deleted %d objects, want at least r1", n)
	}
	got := loaded(t, e.Endpoints(), nil)
	sameContent(t, "k1", got["k1"], want(viewOf(typeCluster, true, r2)))
	sameContent(t, "k2", got["k2"], want(viewOf(typeCluster, true, r2, r3)))

	// An object referenced again between passes is kept.
	s.Save("k1", 0, []xds.View{viewOf(typeCluster, true, r2, r3)}) // drops nothing new
	waitWritten(t, s)
	r4 := res(typeCluster, "r4", []byte("four"))
	s.Save("k2", 0, []xds.View{viewOf(typeCluster, true, r4)}) // r3 still referenced by k1
	waitWritten(t, s)
	s.Collect(t.Context())
	s.Save("k2", 0, []xds.View{viewOf(typeCluster, true, r4, r1)}) // r1 back
	waitWritten(t, s)
	s.Collect(t.Context())
	for _, r := range []*xds.Resource{r1, r2, r3, r4} {
		if !exists(r.Hash) {
			t.Errorf("%s (referenced) was deleted", r.Name)
		}
	}
}

func TestSecretsNeverStoredInClear(t *testing.T) {
	const typeSecret = secretType
	privateKey := []byte("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----")
	secret := res(typeSecret, "kubernetes://ingress-cert", privateKey)
	cluster := res(typeCluster, "c", []byte("c"))
	views := []xds.View{viewOf(typeSecret, false, secret), viewOf(typeCluster, true, cluster)}

	// everything returns every value stored under the tier's prefix.
	everything := func(t *testing.T, s *Store) []byte {
		resp, err := s.cli.Get(t.Context(), s.root, clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		var all []byte
		for _, kv := range resp.Kvs {
			all = append(all, kv.Key...)
			all = append(all, kv.Value...)
		}
		return all
	}
	t.Run("no seal key: not stored", func(t *testing.T) {
		e := etcdFor(t)
		s := storeFor(t, e.Endpoints(), "a", nil)
		s.Save("k", 0, views)
		waitWritten(t, s)
		if all := everything(t, s); bytes.Contains(all, []byte("MIIEvQIBADANBgkqhkiG9w0BAQEFAASC")) {
			t.Fatal("the private key is in etcd in clear")
		}
		got := loaded(t, e.Endpoints(), nil)["k"]
		if got[typeSecret] != nil || got[typeCluster] == nil {
			t.Errorf("loaded types %v, want clusters and no secrets", slices.Sorted(maps.Keys(got)))
		}
	})
	t.Run("seal key: sealed", func(t *testing.T) {
		e := etcdFor(t)
		key := randomBytes(32)
		seal := func(c *Config) { c.SealKey = key }
		s := storeFor(t, e.Endpoints(), "a", seal)
		s.Save("k", 0, views)
		waitWritten(t, s)
		if all := everything(t, s); bytes.Contains(all, []byte("MIIEvQIBADANBgkqhkiG9w0BAQEFAASC")) {
			t.Fatal("the private key is in etcd in clear")
		}
		sameContent(t, "with the key", loaded(t, e.Endpoints(), seal)["k"], want(views...))
		// Without the key (or with another), the Secret type is not loaded.
		got := loaded(t, e.Endpoints(), func(c *Config) { c.SealKey = randomBytes(32) })["k"]
		if got[typeSecret] != nil || got[typeCluster] == nil {
			t.Errorf("with another key: loaded types %v, want clusters and no secrets", slices.Sorted(maps.Keys(got)))
		}
	})
}

func TestDamagedRecordsAreLeftOut(t *testing.T) {
	e := etcdFor(t)
	s := storeFor(t, e.Endpoints(), "a", nil)
	c1 := res(typeCluster, "c1", []byte("one"))
	ep := res(typeEndpoint, "e", []byte("endpoints"))
	s.Save("k", 0, []xds.View{viewOf(typeCluster, true, c1), viewOf(typeEndpoint, false, ep)})
	waitWritten(t, s)
	c2 := res(typeCluster, "c2", []byte("two"))
	s.Save("k", 0, []xds.View{viewOf(typeCluster, true, c1, c2), viewOf(typeEndpoint, false, ep)})
	waitWritten(t, s)

	// Drop the resource of c2: the cluster type no longer adds up, the
	// endpoints still do.
	if _, err := s.cli.Delete(t.Context(), s.resKey(c2.Hash)); err != nil {
		t.Fatal(err)
	}
	got := loaded(t, e.Endpoints(), nil)["k"]
	if got[typeCluster] != nil || got[typeEndpoint] == nil {
		t.Errorf("with a resource missing: loaded types %v, want endpoints only", slices.Sorted(maps.Keys(got)))
	}
	// Damage the batch record: it says a root the entries do not have,
	// so the cluster type is left out again.
	forged := batchRecord{Groups: []batchGroup{{Keys: []keyID{idOf("k")}, Types: []logType{{Type: typeCluster, Full: true, Root: ledger.HashBytes([]byte("forged")), Set: []entry{{Name: "c1", Hash: c1.Hash}}}}}}}
	if _, err := s.cli.Put(t.Context(), s.batchKey(0), string(encodeBatch(forged))); err != nil {
		t.Fatal(err)
	}
	// The store passes the forged root on: the relay checks every view
	// against its root as it builds its tree (relay's
	// TestRestoreChecksRoots), and leaves this one out.
	keys, err := s.Load(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		for _, st := range k.Types {
			if st.Type == typeCluster && st.Root != ledger.HashBytes([]byte("forged")) {
				t.Errorf("with a forged record: cluster root %s, want the forged one passed on", st.Root)
			}
		}
	}
	// Garbage in the head: the key is left out, nothing panics.
	if _, err := s.cli.Put(t.Context(), s.headKey(idOf("k")), "garbage"); err != nil {
		t.Fatal(err)
	}
	if got := loaded(t, e.Endpoints(), nil); got["k"] != nil {
		t.Errorf("with a garbage head: key loaded with %v", slices.Sorted(maps.Keys(got["k"])))
	}
}

func TestEtcdDownSaveDoesNotBlockAndCatchesUp(t *testing.T) {
	dir := t.TempDir()
	e, err := StartEmbedded(t.Context(), EmbeddedConfig{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	endpoints := e.Endpoints()
	s := storeFor(t, endpoints, "a", func(c *Config) { c.RequestTimeout = 300 * time.Millisecond })
	v1 := []xds.View{viewOf(typeCluster, true, res(typeCluster, "c", []byte("v1")))}
	s.Save("k", 0, v1)
	waitWritten(t, s)
	e.Close()

	v2 := []xds.View{viewOf(typeCluster, true, res(typeCluster, "c", []byte("v2")))}
	done := make(chan struct{})
	go func() {
		for i := range 100 { // churn while etcd is down
			s.Save("k", 0, []xds.View{viewOf(typeCluster, true, res(typeCluster, "c", fmt.Appendf(nil, "churn %d", i)))})
		}
		s.Save("k", 0, v2)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Save blocked while etcd is down")
	}
	time.Sleep(time.Second) // the writer tries and fails
	if n, _ := s.Behind(); n != 1 {
		t.Errorf("Behind() = %d keys while etcd is down, want 1", n)
	}
	// The same directory: the same socket, so the store's endpoint.
	e2, err := StartEmbedded(t.Context(), EmbeddedConfig{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e2.Close)
	waitWritten(t, s)
	sameContent(t, "after etcd came back", loaded(t, endpoints, nil)["k"], want(v2...))
	if got := testutil.ToFloat64(s.m.writes.WithLabelValues("error")); got < 1 {
		t.Errorf("failed writes counted %v, want at least 1", got)
	}
}

// TestCollectionDoesNotStrandAWriter: a writer that believes etcd holds a
// resource the collector has since deleted (unreferenced for two passes)
// writes it again when a key refers to it anew.
func TestCollectionDoesNotStrandAWriter(t *testing.T) {
	e := etcdFor(t)
	w := storeFor(t, e.Endpoints(), "writer", nil)
	gc := storeFor(t, e.Endpoints(), "collector", nil)
	a := res(typeCluster, "c", []byte("version A"))
	b := res(typeCluster, "c", []byte("version B"))
	w.Save("k", 0, []xds.View{viewOf(typeCluster, true, a)})
	waitWritten(t, w)
	w.Save("k", 0, []xds.View{viewOf(typeCluster, true, b)})
	waitWritten(t, w)
	for range 2 {
		if _, err := gc.Collect(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := w.cli.Get(t.Context(), w.resKey(a.Hash), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	if resp.Count != 0 {
		t.Fatal("version A survived two passes unreferenced: the test proves nothing")
	}
	w.Save("k", 0, []xds.View{viewOf(typeCluster, true, a)}) // back to A
	waitWritten(t, w)
	sameContent(t, "after A came back", loaded(t, e.Endpoints(), nil)["k"], want(viewOf(typeCluster, true, a)))
}

// TestLargeFlushStaysWithinEtcdLimits: many keys changing a lot at once
// are written in several records, each under etcd's request limit.
func TestLargeFlushStaysWithinEtcdLimits(t *testing.T) {
	e := etcdFor(t)
	s := storeFor(t, e.Endpoints(), "a", func(c *Config) { c.FlushInterval = 300 * time.Millisecond })
	const keys, entries, changed = 8, 6000, 2500
	views := func(version string) map[string][]xds.View {
		out := map[string][]xds.View{}
		for k := range keys {
			var rs []*xds.Resource
			for i := range entries {
				v := "v1"
				if i < changed {
					v = version
				}
				rs = append(rs, res(typeEndpoint, fmt.Sprintf("outbound|80||service-%05d.namespace-%d.svc.cluster.local", i, k), []byte(v)))
			}
			out[fmt.Sprint("key-", k)] = []xds.View{viewOf(typeEndpoint, false, rs...)}
		}
		return out
	}
	for k, v := range views("v1") {
		s.Save(k, 0, v)
	}
	waitWritten(t, s)
	bases := testutil.ToFloat64(s.m.bases)
	// 2,500 changed entries a key (about 240 KB of change record each,
	// 1.9 MB for the 8): change records, not bases, in several batches.
	v2 := views("v2")
	for k, v := range v2 {
		s.Save(k, 0, v)
	}
	waitWritten(t, s)
	if got := testutil.ToFloat64(s.m.bases); got != bases {
		t.Errorf("the change wrote %v new bases, want change records only", got-bases)
	}
	got := loaded(t, e.Endpoints(), nil)
	for k, v := range v2 {
		if !maps.EqualFunc(got[k][typeEndpoint], want(v...)[typeEndpoint], bytes.Equal) {
			t.Errorf("%s: endpoints not persisted", k)
		}
	}
}
