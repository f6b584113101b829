// Package tierledger gathers the tier's ledger: convergence, stragglers and
// deliveries of every relay's Envoys, each relay answering from its own
// ledger (the meshrelay.ledger.v1 service on its xDS port) when asked.
//
// Why a gather (scatter-gather when asked) and not gossip or streams:
//
//   - Gossip (memberlist) carries a few hundred bytes of metadata per relay
//     and exchanges full state every 30 s by default: per-Envoy state does
//     not fit, and bounding its staleness to a second would mean gossiping
//     megabytes a second for answers that are rarely asked.
//   - Streams to each key's owner would make every ACK cross the tier a
//     second time, on the data path, to serve those same rare answers.
//   - A gather costs nothing until asked, and its answer is as fresh as the
//     gather itself: at most GatherTimeout (1 s by default) old. A relay
//     that does not answer within it is named in the answer (Missing),
//     never left out silently.
package tierledger

import (
	"context"
	"errors"
	"slices"
	"time"

	"google.golang.org/grpc"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/ledger/ledgerpb"
	"github.com/meshrelay/meshrelay/relay/peers"
)

// MaxAnswer bounds a relay's answer: 32 MiB holds the packed state of about
// 300,000 Envoys, and bounds what a faulty relay can make this one decode
// (and allocate: a decoded Envoy takes ~20 times its packed bytes).
var MaxAnswer = grpc.MaxCallRecvMsgSize(32 << 20)

// Config is what a Gatherer gathers with. Local, Pool and AsPeer are
// required.
type Config struct {
	// Local is this relay's own ledger.
	Local *ledger.Tracker
	// Peers names the tier's other live relays by xDS address; nil: a
	// relay alone, whose ledger is the tier's.
	Peers func() []string
	// Pool connects to them.
	Pool *peers.Pool
	// AsPeer marks a call's context as the relay's to a relay of its tier.
	AsPeer func(context.Context) context.Context
	// GatherTimeout bounds a gather: a relay that has not answered by then
	// is named in Missing.
	GatherTimeout time.Duration
	// PollInterval is how often Wait gathers.
	PollInterval time.Duration
}

// Gatherer gathers the tier's ledger. Safe for concurrent use.
type Gatherer struct{ cfg Config }

// New returns a Gatherer gathering with cfg.
func New(cfg Config) (*Gatherer, error) {
	switch {
	case cfg.Local == nil:
		return nil, errors.New("tierledger: Local is required")
	case cfg.Pool == nil:
		return nil, errors.New("tierledger: Pool is required")
	case cfg.AsPeer == nil:
		return nil, errors.New("tierledger: AsPeer is required")
	case cfg.GatherTimeout <= 0 || cfg.PollInterval <= 0:
		return nil, errors.New("tierledger: GatherTimeout and PollInterval must be positive")
	}
	return &Gatherer{cfg: cfg}, nil
}

// Ledger is the tier's ledger, gathered from every relay.
type Ledger struct {
	*ledger.Report
	// Relays lists the relays whose ledgers it holds, this one included.
	Relays []string
	// Missing holds, by xDS address, the relays that did not answer within
	// the gather's bound: their Envoys are not counted.
	Missing map[string]error
}

// Ledger gathers the ledgers of every relay of the tier for scope, in
// detail d, and merges them: convergence, stragglers and per-relay figures
// against each key's reference version (its origin's). It waits at most
// GatherTimeout for the other relays. Brief is enough for every answer but
// the times of each Envoy's types (proxy-status's full view, syncz): it
// moves a fraction of the bytes and costs a fraction of the CPU.
func (g *Gatherer) Ledger(ctx context.Context, scope ledger.Scope, d ledger.Detail) Ledger {
	local := g.localSummary(scope, d)
	req := &ledgerpb.SummaryRequest{Scope: ledgerpb.FromScope(scope), Brief: d == ledger.Brief}
	got, missing := Gather(ctx, g, func(ctx context.Context, conn *grpc.ClientConn) (*ledger.Summary, error) {
		p, err := ledgerpb.NewLedgerClient(conn).GetSummary(ctx, req, MaxAnswer)
		if err != nil {
			return nil, err
		}
		return ledgerpb.ToSummary(p)
	})
	sums := append(got, <-local)
	out := Ledger{Report: ledger.Merge(sums...), Missing: missing}
	for _, s := range sums {
		out.Relays = append(out.Relays, s.Relay)
	}
	slices.Sort(out.Relays)
	return out
}

// Delivery answers, for the tier's Envoys of scope (each counted once,
// where it is connected), whether typeURL/name at hash (or a later content)
// reached them. Every relay judges the few roots its own Envoys ACKed, each
// by a Merkle proof against its history of the key. Missing names the
// relays that did not answer (their Envoys are not counted).
func (g *Gatherer) Delivery(ctx context.Context, scope ledger.Scope, typeURL, name string, hash ledger.Hash) (*ledger.Delivery, map[string]error, error) {
	type answer struct {
		sum      *ledger.Summary
		verdicts []ledger.Verdicts
	}
	verdicts, err := g.cfg.Local.Verdicts(scope, typeURL, name, hash)
	if err != nil {
		return nil, nil, err
	}
	local := g.localSummary(scope, ledger.Brief)
	sreq := &ledgerpb.SummaryRequest{Scope: ledgerpb.FromScope(scope), Brief: true}
	dreq := &ledgerpb.DeliveryRequest{Scope: sreq.Scope, Type: typeURL, Name: name, Hash: hash[:]}
	got, missing := Gather(ctx, g, func(ctx context.Context, conn *grpc.ClientConn) (answer, error) {
		c := ledgerpb.NewLedgerClient(conn)
		pv, err := c.CheckDelivery(ctx, dreq, MaxAnswer)
		if err != nil {
			return answer{}, err
		}
		vs, err := ledgerpb.ToVerdicts(pv)
		if err != nil {
			return answer{}, err
		}
		ps, err := c.GetSummary(ctx, sreq, MaxAnswer)
		if err != nil {
			return answer{}, err
		}
		s, err := ledgerpb.ToSummary(ps)
		return answer{s, vs}, err
	})
	sums := []*ledger.Summary{<-local}
	for _, a := range got {
		sums = append(sums, a.sum)
		verdicts = append(verdicts, a.verdicts...)
	}
	return ledger.Merge(sums...).Delivery(typeURL, name, hash, verdicts), missing, nil
}

// Wait returns when the share of the tier's Envoys of scope on their key's
// current version reaches share, or when ctx ends, with the latest complete
// gather (every relay answered, if one was) and ctx's error. It gathers
// every PollInterval and hands progress, if set, each gather short of the
// share that ended before ctx.
func (g *Gatherer) Wait(ctx context.Context, scope ledger.Scope, share float64, progress func(Ledger)) (Ledger, error) {
	if !(share > 0 && share <= 1) {
		return Ledger{}, ledger.ErrBadShare
	}
	t := time.NewTicker(g.cfg.PollInterval)
	defer t.Stop()
	var last Ledger
	for {
		// Each gather is bounded by GatherTimeout alone: one cut short by
		// ctx's deadline would name live relays missing (their side of
		// the call may end first). The wait may overrun ctx by that much.
		tl := g.Ledger(context.WithoutCancel(ctx), scope, ledger.Brief)
		complete := len(tl.Missing) == 0
		if complete && tl.Convergence().Share() >= share {
			return tl, nil
		}
		if complete || last.Report == nil {
			last = tl
		}
		if ctx.Err() != nil {
			return last, ctx.Err()
		}
		if progress != nil {
			progress(tl)
		}
		select {
		case <-ctx.Done():
			return last, ctx.Err()
		case <-t.C:
		}
	}
}

// localSummary builds this relay's summary while the other relays build
// theirs.
func (g *Gatherer) localSummary(scope ledger.Scope, d ledger.Detail) <-chan *ledger.Summary {
	ch := make(chan *ledger.Summary, 1)
	go func() { ch <- g.cfg.Local.Summary(scope, time.Now(), d) }()
	return ch
}

// Gather calls every other relay of the tier at once, within GatherTimeout,
// and returns the answers, and the errors of those that failed or did not
// answer in time. A relay alone gathers nothing.
func Gather[T any](ctx context.Context, g *Gatherer, call func(context.Context, *grpc.ClientConn) (T, error)) ([]T, map[string]error) {
	if g.cfg.Peers == nil {
		return nil, nil
	}
	ctx, cancel := context.WithTimeout(ctx, g.cfg.GatherTimeout)
	defer cancel()
	ctx = g.cfg.AsPeer(ctx)
	return peers.Gather(ctx, g.cfg.Pool, g.cfg.Peers(), call)
}
