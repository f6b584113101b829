package relay

import (
	"context"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/ledger/ledgerpb"
	"github.com/meshrelay/meshrelay/relay/peers"
)

// Tier-wide ledger answers are gathered from every relay when asked
// (scatter-gather), each relay answering from its own ledger over the
// meshrelay.ledger.v1 service on its xDS port:
//
//   - Gossip (memberlist) carries a few hundred bytes of metadata per relay
//     and exchanges full state every 30 s by default: per-Envoy state does
//     not fit, and bounding its staleness to a second would mean gossiping
//     megabytes a second for answers that are rarely asked.
//   - Streams to each key's owner would make every ACK cross the tier a
//     second time, on the data path, to serve those same rare answers.
//   - A gather costs nothing until asked, and its answer is as fresh as the
//     gather itself: at most Tier.GatherTimeout (1 s) old. A relay that
//     does not answer within it is named in the answer (Missing), never
//     left out silently.

// maxLedgerAnswer bounds a peer's answer: 32 MiB holds the packed state of
// about 300,000 Envoys, and bounds what a faulty peer can make this relay
// decode (and allocate: a decoded Envoy takes ~20 times its packed bytes).
var maxLedgerAnswer = grpc.MaxCallRecvMsgSize(32 << 20)

// Peers lists the other relays of the tier, for answers gathered from every
// relay. shard.Ring implements it. Implementations must be safe for
// concurrent use.
type Peers interface {
	// PeerAddrs returns the xDS addresses of the tier's other live relays.
	PeerAddrs() []string
}

// TierLedger is the tier's ledger, gathered from every relay.
type TierLedger struct {
	*ledger.Report
	// Relays lists the relays whose ledgers it holds, this one included.
	Relays []string
	// Missing holds, by xDS address, the relays that did not answer within
	// the gather's bound: their Envoys are not counted.
	Missing map[string]error
}

// TierLedger gathers the ledgers of every relay of the tier for scope, in
// detail d, and merges them: convergence, stragglers and per-relay figures
// against each key's reference version (its origin's). It waits at most
// Tier.GatherTimeout for the other relays. Brief is enough for every
// answer but the times of each Envoy's types (proxy-status's full view,
// syncz): it moves a fraction of the bytes and costs a fraction of the
// CPU.
func (r *Relay) TierLedger(ctx context.Context, scope ledger.Scope, d ledger.Detail) TierLedger {
	local := r.localSummary(scope, d)
	req := &ledgerpb.SummaryRequest{Scope: ledgerpb.FromScope(scope), Brief: d == ledger.Brief}
	got, missing := gather(ctx, r, func(ctx context.Context, conn *grpc.ClientConn) (*ledger.Summary, error) {
		p, err := ledgerpb.NewLedgerClient(conn).GetSummary(ctx, req, maxLedgerAnswer)
		if err != nil {
			return nil, err
		}
		return ledgerpb.ToSummary(p)
	})
	sums := append(got, <-local)
	out := TierLedger{Report: ledger.Merge(sums...), Missing: missing}
	for _, s := range sums {
		out.Relays = append(out.Relays, s.Relay)
	}
	slices.Sort(out.Relays)
	return out
}

// TierDelivery answers, for the tier's Envoys of scope (each counted once,
// where it is connected), whether typeURL/name at hash (or a later content)
// reached them. Every relay judges the few roots its own Envoys ACKed, each
// by a Merkle proof against its history of the key. Missing names the
// relays that did not answer (their Envoys are not counted).
func (r *Relay) TierDelivery(ctx context.Context, scope ledger.Scope, typeURL, name string, hash ledger.Hash) (*ledger.Delivery, map[string]error, error) {
	type answer struct {
		sum      *ledger.Summary
		verdicts []ledger.Verdicts
	}
	verdicts, err := r.ledger.Verdicts(scope, typeURL, name, hash)
	if err != nil {
		return nil, nil, err
	}
	local := r.localSummary(scope, ledger.Brief)
	sreq := &ledgerpb.SummaryRequest{Scope: ledgerpb.FromScope(scope), Brief: true}
	dreq := &ledgerpb.DeliveryRequest{Scope: sreq.Scope, Type: typeURL, Name: name, Hash: hash[:]}
	got, missing := gather(ctx, r, func(ctx context.Context, conn *grpc.ClientConn) (answer, error) {
		c := ledgerpb.NewLedgerClient(conn)
		pv, err := c.CheckDelivery(ctx, dreq, maxLedgerAnswer)
		if err != nil {
			return answer{}, err
		}
		vs, err := ledgerpb.ToVerdicts(pv)
		if err != nil {
			return answer{}, err
		}
		ps, err := c.GetSummary(ctx, sreq, maxLedgerAnswer)
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

// TierWait returns when the share of the tier's Envoys of scope on their
// key's current version reaches share, or when ctx ends, with the latest
// complete gather (every relay answered, if one was) and ctx's error. It
// gathers every Tier.PollInterval and hands progress, if set, each
// gather short of the share that ended before ctx.
func (r *Relay) TierWait(ctx context.Context, scope ledger.Scope, share float64, progress func(TierLedger)) (TierLedger, error) {
	if !(share > 0 && share <= 1) {
		return TierLedger{}, ledger.ErrBadShare
	}
	t := time.NewTicker(r.cfg.Tier.PollInterval)
	defer t.Stop()
	var last TierLedger
	for {
		// Each gather is bounded by Tier.GatherTimeout alone: one cut
		// short by ctx's deadline would name live relays missing (their
		// side of the call may end first). The wait may overrun ctx by
		// that much.
		tl := r.TierLedger(context.WithoutCancel(ctx), scope, ledger.Brief)
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
func (r *Relay) localSummary(scope ledger.Scope, d ledger.Detail) <-chan *ledger.Summary {
	ch := make(chan *ledger.Summary, 1)
	go func() { ch <- r.ledger.Summary(scope, time.Now(), d) }()
	return ch
}

// gather calls every other relay of the tier at once and returns the
// answers, and the errors of those that failed or did not answer in time.
func gather[T any](ctx context.Context, r *Relay, call func(context.Context, *grpc.ClientConn) (T, error)) ([]T, map[string]error) {
	if r.cfg.Tier.Peers == nil {
		return nil, nil
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Tier.GatherTimeout)
	defer cancel()
	ctx = r.asPeer(ctx)
	return peers.Gather(ctx, r.pool, r.cfg.Tier.Peers.PeerAddrs(), call)
}

// ledgerServer serves this relay's ledger to the tier's other relays.
type ledgerServer struct {
	ledgerpb.UnimplementedLedgerServer
	r    *Relay
	port port
}

// checkPeerCall admits only calls that prove they come from a relay of the
// tier (when the tier has a peer secret); service names the exchange in
// errors and logs.
func (r *Relay) checkPeerCall(ctx context.Context, p port, service string) error {
	md, _ := metadata.FromIncomingContext(ctx)
	ids := md.Get(peers.MDRelay)
	if len(ids) != 1 || ids[0] == "" {
		return status.Errorf(codes.PermissionDenied, "the %s exchange is for the relays of the tier", service)
	}
	if err := r.checkPort(p, true); err != nil {
		return err
	}
	return r.provePeer(ctx, md, p, ids[0], service+" exchange")
}

func (s ledgerServer) GetSummary(ctx context.Context, req *ledgerpb.SummaryRequest) (*ledgerpb.Summary, error) {
	if err := s.r.checkPeerCall(ctx, s.port, "ledger"); err != nil {
		return nil, err
	}
	d := ledger.Full
	if req.GetBrief() {
		d = ledger.Brief
	}
	return ledgerpb.FromSummary(s.r.ledger.Summary(ledgerpb.ToScope(req.GetScope()), time.Now(), d)), nil
}

func (s ledgerServer) CheckDelivery(ctx context.Context, req *ledgerpb.DeliveryRequest) (*ledgerpb.DeliveryVerdicts, error) {
	if err := s.r.checkPeerCall(ctx, s.port, "ledger"); err != nil {
		return nil, err
	}
	h, err := ledger.HashFromBytes(req.GetHash())
	if err != nil || h.IsZero() {
		return nil, status.Errorf(codes.InvalidArgument, "want the 32 bytes of a content hash: %v", err)
	}
	vs, err := s.r.ledger.Verdicts(ledgerpb.ToScope(req.GetScope()), req.GetType(), req.GetName(), h)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return ledgerpb.FromVerdicts(vs), nil
}
