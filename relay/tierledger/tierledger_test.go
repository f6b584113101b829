package tierledger

import (
	"context"
	"errors"
	"net"
	"slices"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/test/bufconn"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/ledger/ledgerpb"
	"github.com/meshrelay/meshrelay/relay/peers"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func tracker(t *testing.T, relay string) *ledger.Tracker {
	cfg := ledger.DefaultTrackerConfig()
	cfg.Relay = relay
	tr, err := ledger.NewTracker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// relay serves a ledger to the tier, or, silent, never answers.
type relay struct {
	ledgerpb.UnimplementedLedgerServer
	tr     *ledger.Tracker
	silent bool
}

func (r relay) GetSummary(ctx context.Context, req *ledgerpb.SummaryRequest) (*ledgerpb.Summary, error) {
	if r.silent {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return ledgerpb.FromSummary(r.tr.Summary(ledgerpb.ToScope(req.GetScope()), time.Now(), ledger.Brief)), nil
}

// tier serves each relay on its own in-memory listener, named by its
// address, and returns a pool that dials them there.
func tier(t *testing.T, relays map[string]relay) *peers.Pool {
	lis := map[string]*bufconn.Listener{}
	for addr, r := range relays {
		l := bufconn.Listen(1 << 20)
		srv := grpc.NewServer()
		ledgerpb.RegisterLedgerServer(srv, r)
		go func() { _ = srv.Serve(l) }()
		t.Cleanup(srv.Stop)
		lis[addr] = l
	}
	pool := peers.NewPool(4<<20, grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
		l := lis[addr]
		if l == nil {
			return nil, errors.New("no relay at " + addr)
		}
		return l.DialContext(ctx)
	}))
	t.Cleanup(func() { pool.Close() })
	return pool
}

// TestLedgerNamesWhoDidNotAnswer: the tier's ledger holds every relay that
// answered, this one included, and names the one that did not answer
// within the gather's bound; a relay alone gathers only itself.
func TestLedgerNamesWhoDidNotAnswer(t *testing.T) {
	pool := tier(t, map[string]relay{
		"10.0.0.2:15010": {tr: tracker(t, "relay-b")},
		"10.0.0.3:15010": {silent: true},
	})
	asPeer := func(ctx context.Context) context.Context { return ctx }
	for _, tc := range []struct {
		name        string
		peers       func() []string
		wantRelays  []string
		wantMissing []string
	}{
		{"a tier of three", func() []string { return []string{"10.0.0.2:15010", "10.0.0.3:15010"} }, []string{"relay-a", "relay-b"}, []string{"10.0.0.3:15010"}},
		{"a relay alone", nil, []string{"relay-a"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, err := New(Config{Local: tracker(t, "relay-a"), Peers: tc.peers, Pool: pool, AsPeer: asPeer,
				GatherTimeout: 300 * time.Millisecond, PollInterval: 10 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			tl := g.Ledger(t.Context(), ledger.Scope{}, ledger.Brief)
			var missing []string
			for addr := range tl.Missing {
				missing = append(missing, addr)
			}
			if !slices.Equal(tl.Relays, tc.wantRelays) || !slices.Equal(missing, tc.wantMissing) {
				t.Fatalf("Ledger = relays %v, missing %v; want %v, %v", tl.Relays, missing, tc.wantRelays, tc.wantMissing)
			}
		})
	}
}

// TestWaitEndsWithItsContext: a wait for a share the tier does not reach
// while a relay is silent ends with ctx, returning the latest gather, and a
// share out of (0, 1] is refused.
func TestWaitEndsWithItsContext(t *testing.T) {
	pool := tier(t, map[string]relay{"10.0.0.3:15010": {silent: true}})
	g, err := New(Config{Local: tracker(t, "relay-a"), Peers: func() []string { return []string{"10.0.0.3:15010"} }, Pool: pool,
		AsPeer: func(ctx context.Context) context.Context { return ctx }, GatherTimeout: 100 * time.Millisecond, PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.Wait(t.Context(), ledger.Scope{}, 0, nil); !errors.Is(err, ledger.ErrBadShare) {
		t.Fatalf("Wait(share 0) = %v, want ErrBadShare", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	gathers := 0
	tl, err := g.Wait(ctx, ledger.Scope{}, 1, func(Ledger) {
		if gathers++; gathers == 2 {
			cancel()
		}
	})
	if !errors.Is(err, context.Canceled) || tl.Report == nil || len(tl.Missing) != 1 {
		t.Fatalf("Wait = %v, missing %v, report %v; want context.Canceled with the last gather, the silent relay missing", err, tl.Missing, tl.Report != nil)
	}
}
