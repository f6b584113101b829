package claims

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/xds"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func clusterAny(t testing.TB, name string) *anypb.Any {
	a, err := anypb.New(&cluster.Cluster{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func decode(t testing.TB, s *xds.Store, name string) *xds.Resource {
	r, err := s.Decode(xds.TypeCluster, clusterAny(t, name), name)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func treeOf(rs ...*xds.Resource) ledger.Tree[*xds.Resource] {
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, r := range rs {
		b.Set(r.Name, r.Hash, r)
	}
	return b.Tree()
}

// peer is a relay of the tier as GetVersion shows it: it holds one version
// and answers with Content, or answers err.
type peer struct {
	inspectpb.UnimplementedInspectServer
	id    string
	held  ledger.Tree[*xds.Resource]
	view  ledger.Tree[*xds.Resource] // its key's view now
	err   error
	asked chan *inspectpb.VersionRequest
}

func (p *peer) GetVersion(_ context.Context, req *inspectpb.VersionRequest) (*inspectpb.VersionContent, error) {
	p.asked <- proto.CloneOf(req)
	if p.err != nil {
		return nil, p.err
	}
	if req.GetRoot() != p.held.Root().String() {
		return nil, status.Errorf(codes.NotFound, "version %s not in history", req.GetRoot())
	}
	return Content(p.id, p.held, p.view, req.GetBodies(), func(ledger.Hash) *xds.Resource { return nil }), nil
}

// conns serves each peer on its own bufconn listener and dials it by name.
type conns map[string]*grpc.ClientConn

func (c conns) Conn(addr string) (*grpc.ClientConn, error) {
	if cc := c[addr]; cc != nil {
		return cc, nil
	}
	return nil, fmt.Errorf("no relay at %s", addr)
}

func serve(t *testing.T, peers ...*peer) conns {
	c := conns{}
	for _, p := range peers {
		p.asked = make(chan *inspectpb.VersionRequest, 8)
		lis := bufconn.Listen(1 << 20)
		srv := grpc.NewServer()
		inspectpb.RegisterInspectServer(srv, p)
		go func() { _ = srv.Serve(lis) }()
		cc, err := grpc.NewClient("passthrough:///"+p.id,
			grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
			grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close(); srv.Stop() })
		c[p.id] = cc
	}
	return c
}

// held is a snapshot store's hand-over of one version.
type held struct {
	v     xds.HeldVersion
	found bool
}

func (h held) LoadHeld(context.Context, string, string, ledger.Hash, func(ledger.Hash) bool) (xds.HeldVersion, bool, error) {
	return h.v, h.found, nil
}

// TestVersion asks the tier, then the store, what a SotW client's version
// of c0 and c1 held, the asker holding only c0's body.
func TestVersion(t *testing.T) {
	theirs := xds.NewStore()
	c0, c1 := decode(t, theirs, "c0"), decode(t, theirs, "c1")
	version := treeOf(c0, c1)
	root := version.Root()

	for _, tc := range []struct {
		name     string
		peers    []*peer
		store    Held
		want     bool
		from     string
		bodiesOf int // answers asked again with every body
	}{
		{name: "a relay holds it", peers: []*peer{{id: "r1", held: version}}, want: true, from: "tier"},
		{name: "its answer leaves out a body the asker lacks", want: true, from: "tier", bodiesOf: 1,
			peers: []*peer{{id: "r1", held: version, view: version}}}, // c0 and c1 unchanged: no bodies at first
		{name: "one relay does not hold it, another does", want: true, from: "tier",
			peers: []*peer{{id: "r1", held: treeOf(c0)}, {id: "r2", held: version}}},
		{name: "no relay holds it, the store does", want: true, from: "store",
			peers: []*peer{{id: "r1", held: treeOf(c0)}},
			store: held{found: true, v: xds.HeldVersion{Entries: []xds.HeldEntry{
				{Name: "c0", Hash: c0.Hash}, {Name: "c1", Hash: c1.Hash, Body: c1.Body.GetValue()}}}}},
		{name: "the store's hand-over lacks a body", want: false, from: "store",
			peers: []*peer{{id: "r1", err: status.Error(codes.PermissionDenied, "not a peer")}},
			store: held{found: true, v: xds.HeldVersion{Entries: []xds.HeldEntry{{Name: "c0", Hash: c0.Hash}, {Name: "c1", Hash: c1.Hash}}}}},
		{name: "a relay answers another version", want: false, from: "store",
			peers: []*peer{{id: "r1", held: treeOf(c1)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mine := xds.NewStore()
			mineC0 := decode(t, mine, "c0") // the asker holds c0's body, not c1's
			defer runtime.KeepAlive(mineC0) // the store holds bodies weakly
			c := serve(t, tc.peers...)
			var addrs []string
			for _, p := range tc.peers {
				addrs = append(addrs, p.id)
			}
			l, err := New(Config{Store: mine, Conns: c, Peers: func() []string { return addrs }, Held: tc.store,
				AsPeer:   func(ctx context.Context) context.Context { return ctx },
				WaitWarn: time.Minute, GatherTimeout: 10 * time.Second, MaxMsgSize: 4 << 20})
			if err != nil {
				t.Fatal(err)
			}
			req := &inspectpb.VersionRequest{Key: "k", Type: xds.TypeCluster, Root: root.String(), Wildcard: true}
			if !l.Askable() {
				t.Fatal("Askable = false with relays to ask")
			}
			got, ok, from := l.Version(t.Context(), req, root)
			if ok != tc.want || from != tc.from {
				t.Fatalf("Version = ok %v from %q, want ok %v from %q", ok, from, tc.want, tc.from)
			}
			if ok && (got.Root() != root || got.Len() != 2) {
				t.Fatalf("Version = %d resources of root %s, want c0 and c1 of %s", got.Len(), got.Root(), root)
			}
			all := 0
			for _, p := range tc.peers {
				for len(p.asked) > 0 {
					if (<-p.asked).GetBodies() {
						all++
					}
				}
			}
			if all != tc.bodiesOf {
				t.Errorf("asked again for every body %d times, want %d", all, tc.bodiesOf)
			}
		})
	}
}

// TestVersionWaitsForASilentRelay: a relay that does not answer may be the
// one that knows, so the lookup asks again until it answers, and ends when
// the context does.
func TestVersionWaitsForASilentRelay(t *testing.T) {
	s := xds.NewStore()
	c0 := decode(t, s, "c0")
	root := treeOf(c0).Root()
	p := &peer{id: "r1", err: status.Error(codes.Unavailable, "frozen")}
	c := serve(t, p)
	l, err := New(Config{Store: s, Conns: c, Peers: func() []string { return []string{"r1"} },
		AsPeer:   func(ctx context.Context) context.Context { return ctx },
		WaitWarn: time.Minute, GatherTimeout: 10 * time.Second, MaxMsgSize: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan bool)
	go func() {
		_, ok, _ := l.Version(ctx, &inspectpb.VersionRequest{Key: "k", Type: xds.TypeCluster, Root: root.String(), Wildcard: true}, root)
		done <- ok
	}()
	<-p.asked
	<-p.asked // asked again: its silence is no answer
	cancel()
	if <-done {
		t.Fatal("Version = ok from a relay that never answered")
	}
}

// TestAnswered: a tier lookup of a SotW client's version ends only on
// answers; a relay that could not be reached, or did not answer in time,
// may be the one that knows the version (a frozen one whose Envoys moved).
func TestAnswered(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{status.Error(codes.NotFound, "no such version"), true},
		{status.Error(codes.PermissionDenied, "not a peer"), true},
		{fmt.Errorf("%w: %w", errWrongAnswer, errBodyMissing), true},
		{status.Error(codes.Unavailable, "connection refused"), false},
		{status.Error(codes.DeadlineExceeded, "too slow"), false},
		{errors.New("dial tcp: connection refused"), false},
	} {
		if got := answered(tc.err); got != tc.want {
			t.Errorf("answered(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

// FuzzVersionAnswer reads arbitrary bytes as another relay's answer to
// GetVersion for the version of c0 and c1: an answer is taken only if it is
// that version, and every resource in it has its body.
func FuzzVersionAnswer(f *testing.F) {
	s := xds.NewStore()
	c0 := decode(f, s, "c0") // the asker holds c0
	c1 := clusterAny(f, "c1")
	c1Hash := xds.ContentHash(xds.TypeCluster, c1.GetValue())
	b := ledger.Tree[*xds.Resource]{}.Edit()
	b.Set("c0", c0.Hash, c0)
	b.Set("c1", c1Hash, nil)
	root := b.Tree().Root()
	add := func(m *inspectpb.VersionContent) {
		raw, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(raw)
	}
	add(&inspectpb.VersionContent{Relay: "r", Entries: []*inspectpb.VersionEntry{
		{Name: "c0", Hash: c0.Hash[:]}, {Name: "c1", Hash: c1Hash[:], Body: c1}}})
	add(&inspectpb.VersionContent{Relay: "r", Entries: []*inspectpb.VersionEntry{ // c1 without its body
		{Name: "c0", Hash: c0.Hash[:]}, {Name: "c1", Hash: c1Hash[:]}}})
	add(&inspectpb.VersionContent{Relay: "r", Entries: []*inspectpb.VersionEntry{ // c1's body under c0's name
		{Name: "c0", Hash: c1Hash[:], Body: c1}}})
	add(&inspectpb.VersionContent{Entries: []*inspectpb.VersionEntry{{Name: "c0", Hash: []byte("short")}}})
	f.Add([]byte("\x12\xff\xff garbage"))

	f.Fuzz(func(t *testing.T, raw []byte) {
		var got inspectpb.VersionContent
		if proto.Unmarshal(raw, &got) != nil {
			return
		}
		tree, err := Tree(s, xds.TypeCluster, &got, root)
		if err != nil {
			return
		}
		if tree.Root() != root {
			t.Fatalf("took version %s, asked %s", tree.Root(), root)
		}
		for e := range tree.All() {
			if e.Value == nil || e.Value.Hash != e.Hash || e.Value.Name != e.Name {
				t.Fatalf("took %q without its body, or with another", e.Name)
			}
		}
		runtime.KeepAlive(c0) // the store holds bodies weakly
	})
}

// TestAskable: a relay alone, without a store that keeps hand-overs, has
// nobody to ask; a tier's other relays, or such a store, are someone.
func TestAskable(t *testing.T) {
	none := func() []string { return nil }
	for _, tc := range []struct {
		name  string
		peers func() []string
		held  Held
		want  bool
	}{
		{"alone", nil, nil, false},
		{"a tier of one", none, nil, false},
		{"a tier", func() []string { return []string{"r1"} }, nil, true},
		{"a store", none, held{}, true},
	} {
		l, err := New(Config{Store: xds.NewStore(), Conns: conns{}, Peers: tc.peers, Held: tc.held,
			AsPeer: func(ctx context.Context) context.Context { return ctx }, MaxMsgSize: 4 << 20})
		if err != nil {
			t.Fatal(err)
		}
		if got := l.Askable(); got != tc.want {
			t.Errorf("%s: Askable = %v, want %v", tc.name, got, tc.want)
		}
	}
}
