package snapshot

import (
	"bytes"
	"context"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// inlineKey is the private key of the Cluster below: what must never be
// found in clear in etcd, its database file or its WAL.
var inlineKey = []byte("MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7VJTUt9Us8cKj")

// clusterWithInlineKey is a Cluster whose transport socket carries an
// UpstreamTlsContext with its private key inline (not an SDS Secret).
func clusterWithInlineKey(t *testing.T, name string) *xds.Resource {
	t.Helper()
	tc, err := anypb.New(&tlsv3.UpstreamTlsContext{
		Sni: "db.example.com",
		CommonTlsContext: &tlsv3.CommonTlsContext{TlsCertificates: []*tlsv3.TlsCertificate{{
			CertificateChain: &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: "-----BEGIN CERTIFICATE-----\n…"}},
			PrivateKey: &core.DataSource{Specifier: &core.DataSource_InlineBytes{
				InlineBytes: append(append([]byte("-----BEGIN PRIVATE KEY-----\n"), inlineKey...), "\n-----END PRIVATE KEY-----\n"...)}},
		}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return clusterResource(t, &cluster.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &cluster.Cluster_Type{Type: cluster.Cluster_STRICT_DNS},
		TransportSocket:      &core.TransportSocket{Name: "envoy.transport_sockets.tls", ConfigType: &core.TransportSocket_TypedConfig{TypedConfig: tc}},
	})
}

// clusterResource is c as the relay holds it: its hash is the content
// hash of its serialized body.
func clusterResource(t *testing.T, c *cluster.Cluster) *xds.Resource {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	return &xds.Resource{Type: typeCluster, Name: c.GetName(), Hash: xds.ContentHash(typeCluster, b), Body: &anypb.Any{TypeUrl: typeCluster, Value: b}}
}

// inClear fails the test if the key is anywhere in etcd's values (read
// through the client) or, once etcd is stopped, in any file of its data
// directory (the bbolt database and the WAL).
func inClear(t *testing.T, endpoints []string, dir string, stop func()) {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(t.Context(), "", clientv3.WithFromKey())
	cli.Close()
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		t.Fatal("etcd holds nothing: the check would prove nothing")
	}
	for _, kv := range resp.Kvs {
		if bytes.Contains(kv.Value, inlineKey) {
			t.Errorf("etcd value of %s holds the private key in clear", kv.Key)
		}
	}
	stop() // the database is flushed and closed
	files := 0
	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		files++
		if bytes.Contains(b, inlineKey) {
			t.Errorf("%s holds the private key in clear", path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 2 {
		t.Fatalf("found %d files in etcd's data directory, want its database and WAL at least", files)
	}
}

// TestSealedInlineKey (issue 31, finding 4): a Cluster whose transport
// socket carries an inline private key is never in clear in etcd, with a
// seal key (sealed, and loads back whole) or without (not persisted: the
// key's clusters start cold, its other types warm).
func TestSealedInlineKey(t *testing.T) {
	plain := res(typeCluster, "plain", []byte("no TLS"))
	views := func(t *testing.T) []xds.View {
		return []xds.View{
			viewOf(typeCluster, true, plain, clusterWithInlineKey(t, "db")),
			viewOf(typeEndpoint, false, res(typeEndpoint, "e", []byte("endpoints"))),
		}
	}
	start := func(t *testing.T) (*Embedded, string) {
		dir := t.TempDir()
		e, err := StartEmbedded(t.Context(), EmbeddedConfig{Dir: dir})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Close)
		return e, dir
	}
	t.Run("seal key: sealed", func(t *testing.T) {
		e, dir := start(t)
		key := randomBytes(32)
		seal := func(c *Config) { c.SealKey = key }
		vs := views(t)
		s := storeFor(t, e.Endpoints(), "a", seal)
		s.Save("k", 0, vs)
		waitWritten(t, s)
		sameContent(t, "with the key", loaded(t, e.Endpoints(), seal)["k"], want(vs...))
		// A store with another key loads what it can: not the clusters.
		got := loaded(t, e.Endpoints(), func(c *Config) { c.SealKey = randomBytes(32) })["k"]
		if got[typeCluster] != nil || got[typeEndpoint] == nil {
			t.Errorf("with another key: loaded types %v, want endpoints only", slices.Sorted(maps.Keys(got)))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s.Stop(ctx)
		inClear(t, e.Endpoints(), dir, e.Close)
	})
	t.Run("no seal key: not persisted", func(t *testing.T) {
		e, dir := start(t)
		vs := views(t)
		s := storeFor(t, e.Endpoints(), "a", nil)
		s.Save("k", 0, vs)
		waitWritten(t, s)
		got := loaded(t, e.Endpoints(), nil)["k"]
		if got[typeCluster] != nil || got[typeEndpoint] == nil {
			t.Errorf("loaded types %v, want endpoints only", slices.Sorted(maps.Keys(got)))
		}
		// Once the key is gone from the clusters, they are persisted.
		later := []xds.View{viewOf(typeCluster, true, plain), vs[1]}
		s.Save("k", 0, later)
		waitWritten(t, s)
		sameContent(t, "without the inline key", loaded(t, e.Endpoints(), nil)["k"], want(later...))
		// A version a drained client holds is not kept either.
		if err := s.SaveHeld(t.Context(), "k", vs[0], nil); err != nil {
			t.Fatal(err)
		}
		if _, ok, _ := s.LoadHeld(t.Context(), "k", typeCluster, vs[0].Tree.Root(), func(ledger.Hash) bool { return false }); ok {
			t.Error("a held version with an inline key was kept without a seal key")
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s.Stop(ctx)
		inClear(t, e.Endpoints(), dir, e.Close)
	})
}

// TestClearRecordOfSensitiveResourceIsNotTrusted: a record an older relay
// wrote in clear, though it holds a sensitive field, is not served from,
// and is written again sealed.
func TestClearRecordOfSensitiveResourceIsNotTrusted(t *testing.T) {
	e := etcdFor(t)
	key := randomBytes(32)
	seal := func(c *Config) { c.SealKey = key }
	db := clusterWithInlineKey(t, "db")
	vs := []xds.View{viewOf(typeCluster, true, db)}
	s := storeFor(t, e.Endpoints(), "a", seal)
	s.Save("k", 0, vs)
	waitWritten(t, s)
	// As an older relay wrote it: in clear.
	clear := encodeResource(resourceRecord{Type: db.Type, Name: db.Name, Body: db.Body.GetValue()})
	if _, err := s.cli.Put(t.Context(), s.resKey(db.Hash), string(clear)); err != nil {
		t.Fatal(err)
	}
	if got := loaded(t, e.Endpoints(), seal)["k"]; got[typeCluster] != nil {
		t.Error("a Cluster with an inline key, stored in clear, was loaded")
	}
	// A relay that loads it writes it again, sealed.
	s2 := storeFor(t, e.Endpoints(), "b", seal)
	if _, err := s2.Load(t.Context()); err != nil {
		t.Fatal(err)
	}
	s2.Save("k", 1, vs)
	waitWritten(t, s2)
	sameContent(t, "written again", loaded(t, e.Endpoints(), seal)["k"], want(vs...))
	resp, err := s2.cli.Get(t.Context(), s2.resKey(db.Hash))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("read back: %v, %d records", err, len(resp.Kvs))
	}
	if bytes.Contains(resp.Kvs[0].Value, inlineKey) {
		t.Error("the record is still in clear")
	}
}
