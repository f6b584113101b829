package relay

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/ledger/ledgerpb"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/tierledger"
)

// Peers lists the other relays of the tier, for answers gathered from every
// relay. shard.Ring implements it. Implementations must be safe for
// concurrent use.
type Peers interface {
	// PeerAddrs returns the xDS addresses of the tier's other live relays.
	PeerAddrs() []string
}

// TierLedger is the tier's ledger, gathered from every relay.
type TierLedger = tierledger.Ledger

// newGatherer builds the relay's gatherer of the tier's ledger, once its
// ledger is.
func (r *Relay) newGatherer() (*tierledger.Gatherer, error) {
	cfg := tierledger.Config{Local: r.ledger, Pool: r.pool, AsPeer: r.asPeer,
		GatherTimeout: r.cfg.Tier.GatherTimeout, PollInterval: r.cfg.Tier.PollInterval}
	if r.cfg.Tier.Peers != nil {
		cfg.Peers = r.cfg.Tier.Peers.PeerAddrs
	}
	return tierledger.New(cfg)
}

// TierLedger gathers the ledgers of every relay of the tier for scope, in
// detail d, and merges them (tierledger.Gatherer.Ledger); it waits at most
// Tier.GatherTimeout for the other relays.
func (r *Relay) TierLedger(ctx context.Context, scope ledger.Scope, d ledger.Detail) TierLedger {
	return r.gatherer.Ledger(ctx, scope, d)
}

// TierDelivery answers, for the tier's Envoys of scope, whether
// typeURL/name at hash (or a later content) reached them
// (tierledger.Gatherer.Delivery).
func (r *Relay) TierDelivery(ctx context.Context, scope ledger.Scope, typeURL, name string, hash ledger.Hash) (*ledger.Delivery, map[string]error, error) {
	return r.gatherer.Delivery(ctx, scope, typeURL, name, hash)
}

// TierWait returns when the share of the tier's Envoys of scope on their
// key's current version reaches share, or when ctx ends
// (tierledger.Gatherer.Wait), gathering every Tier.PollInterval.
func (r *Relay) TierWait(ctx context.Context, scope ledger.Scope, share float64, progress func(TierLedger)) (TierLedger, error) {
	return r.gatherer.Wait(ctx, scope, share, progress)
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
