package relay

import (
	"context"
	"errors"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/divergence"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// The relay's side of the divergence check (package divergence, which
// says what the check is; each key's schedule is in keystate.go): the
// loop over the keys this relay holds, the check slots, asking a key's
// owner to check this relay's Envoys, the check another relay asks for
// (CheckMember), the relay's upstream lent to a check (prober), and the
// splits a check finds or merges back.

// maxDivergenceChecks bounds the checks one relay runs at a time
// (Relay.checkSlots), its own and those other relays ask for.
const maxDivergenceChecks = 2

// checkDivergence runs the keys' divergence checks until ctx ends: each
// aggregated key this relay holds, every DivergenceInterval (the first at a
// random point of it), and, for a key this relay is the upstream source
// of, at once when it gets its second member. A key this relay is the
// upstream source of is checked here; a key it gets from its owner is
// checked by the owner, asked (CheckMember) about this relay's own Envoys,
// since the owner sees only the node each relay presents.
func (r *Relay) checkDivergence(ctx context.Context) {
	tick := time.NewTicker(min(time.Second, r.cfg.Keys.DivergenceInterval))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-r.cache.divergenceWake:
		}
		now := time.Now()
		for _, k := range r.cache.heldKeys() {
			m, ok := k.checkDue(now, r.cfg.Keys.DivergenceInterval)
			recheck := false
			if !ok {
				if m, ok = k.recheckDue(now, r.cfg.Keys.DivergenceInterval); !ok {
					continue
				}
				recheck = true
			}
			release, ok := r.checkSlots.tryAcquire()
			if !ok {
				k.checkLater(m) // no slot: its turn comes again at the next tick
				continue
			}
			if !r.goRun(func(ctx context.Context) {
				defer release()
				if recheck {
					r.recheckSplit(ctx, k, m)
				} else {
					r.checkKey(ctx, k, m)
				}
			}) {
				release()
				return
			}
		}
	}
}

// recheckSplit checks m, the member of k, against the key it left by a
// split: here if this relay is that key's upstream source, else by asking
// its owner. If the upstream gives m's node that key's config again, the
// split is merged back (mergeBack) and m returns to it (followSplits).
func (r *Relay) recheckSplit(ctx context.Context, k *keyState, m member) {
	base := k.splitBase()
	node, _ := m.presents()
	var err error
	var differ []string
	by := r.cfg.ID
	bk := r.cache.key(base)
	switch owner, self := r.ownerOf(base); {
	case bk != nil && sourceKind(bk.source.Load()) != sourcePeer && bk.presentedNode.Load() != nil:
		if !bk.startCheck() {
			k.checkLater(m)
			return
		}
		differ, _, err = r.runCheck(ctx, bk, m)
		bk.endCheck()
	case self || r.cfg.Upstream.ForwardCredentials:
		// Nothing to compare with here (the key it left has no source
		// here), or the owner would need the member's token: the split
		// stays.
		err = divergence.ErrNotComparable
	default:
		var res *inspectpb.CheckMemberResult
		res, err = r.askCheck(ctx, owner, base, node)
		differ, by = res.GetTypes(), owner
		if err == nil && !res.GetDiverged() {
			// The owner merges back only the splits it knows: one this
			// relay found while cut off from it (issue 28's simulation,
			// seed 1137 under -race) is merged back here, and the tier
			// learns of it from here.
			r.mergeBack(base, node)
		}
	}
	k.recheckDone(m, err == nil && len(differ) > 0 || errors.Is(err, divergence.ErrNotComparable), r.cfg.Keys.DivergenceInterval)
	switch {
	case ctx.Err() != nil:
	case err != nil:
		r.log.Debug("split re-check without an answer", "key", base, "node", node.GetId(), "by", by, "err", err)
	case len(differ) == 0:
		r.log.Debug("split re-check: the same config as the key it left", "key", base, "node", node.GetId(), "by", by)
	default:
		r.log.Debug("split re-check: still other config", "key", base, "node", node.GetId(), "by", by)
	}
}

// checkKey checks m, a member of k: here if this relay is k's upstream
// source, else by asking k's owner.
func (r *Relay) checkKey(ctx context.Context, k *keyState, m member) {
	node, _ := m.presents()
	wanted := k.wantedTypes()
	var (
		differ []string
		split  string
		err    error
		by     = r.cfg.ID
	)
	if owner, self := r.ownerOf(k.key); sourceKind(k.source.Load()) == sourcePeer && !self {
		var res *inspectpb.CheckMemberResult
		res, err = r.askCheck(ctx, owner, k.key, node)
		differ, split, by = res.GetTypes(), res.GetSplit(), owner
		if status.Code(err) == codes.Unavailable && ctx.Err() == nil {
			// The owner is busy (or away): ask at the next tick.
			k.checkLater(m)
			r.log.Debug("divergence check: the owner cannot check now", "key", k.key, "node", node.GetId(), "by", by, "err", err)
			return
		}
	} else {
		var s aggkey.Split
		differ, s, err = r.runCheck(ctx, k, m)
		split = s.String()
		if errors.Is(err, divergence.ErrWantGrew) || errors.Is(err, divergence.ErrNotComparable) {
			k.checkLater(m) // compare the whole of it at the next tick
			r.log.Debug("divergence check: the members subscribed to more meanwhile", "key", k.key, "node", node.GetId())
			return
		}
	}
	k.checkDone(m, time.Now().Add(r.cfg.Keys.DivergenceInterval), wanted)
	switch {
	case ctx.Err() != nil:
	case err != nil:
		r.log.Info("divergence check without an answer", "key", k.key, "node", node.GetId(), "by", by, "err", err)
	case len(differ) == 0:
		r.log.Debug("divergence check: same config", "key", k.key, "node", node.GetId(), "by", by)
	default:
		r.log.Debug("divergence check: the key split", "key", k.key, "node", node.GetId(), "by", by, "split", split)
	}
}

// ownerOf returns k's owner's address, and whether this relay owns k (or
// there is no tier).
func (r *Relay) ownerOf(k aggkey.Key) (string, bool) {
	if r.cfg.Tier.Owners == nil {
		return "", true
	}
	return r.cfg.Tier.Owners.Owner(string(k))
}

// askCheck asks the owner at addr to check node, a member of key here.
func (r *Relay) askCheck(ctx context.Context, addr string, key aggkey.Key, node *core.Node) (*inspectpb.CheckMemberResult, error) {
	b, err := proto.Marshal(node)
	if err != nil {
		return nil, err
	}
	conn, err := r.pool.Conn(addr)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, divergence.CheckFor+r.cfg.Tier.GatherTimeout)
	defer cancel()
	ctx = r.asPeer(ctx)
	var md metadata.MD
	res, err := inspectpb.NewInspectClient(conn).CheckMember(ctx, &inspectpb.CheckMemberRequest{Key: string(key), Node: b}, grpc.Header(&md))
	if v := md.Get(peers.MDSplits); len(v) == 1 {
		// The owner's records of the key's splits, the check's included
		// (a split it found, or merged back).
		if splits, derr := aggkey.DecodeSplits([]byte(v[0])); derr == nil {
			r.cache.learnSplits(key, splits)
		} else {
			r.log.Warn("a key's owner sent splits this relay cannot read", "key", key, "err", derr)
		}
	}
	return res, err
}

// CheckMember runs a check another relay asked for (see inspect.proto).
func (s inspectServer) CheckMember(ctx context.Context, req *inspectpb.CheckMemberRequest) (*inspectpb.CheckMemberResult, error) {
	if err := s.r.checkPeerCall(ctx, s.port, "inspect"); err != nil {
		return nil, err
	}
	node := new(core.Node)
	if err := proto.Unmarshal(req.GetNode(), node); err != nil || node.GetId() == "" {
		return nil, status.Errorf(codes.InvalidArgument, "node: want a serialized Node with an id (%v)", err)
	}
	k := s.r.cache.key(aggkey.Key(req.GetKey()))
	switch {
	case k == nil:
		return nil, status.Errorf(codes.NotFound, "key %q: %v", req.GetKey(), ErrNotHeld)
	case s.r.cfg.Keys.DivergenceInterval == 0:
		return nil, status.Error(codes.FailedPrecondition, "divergence checks are off here")
	case s.r.cfg.Upstream.ForwardCredentials:
		return nil, status.Error(codes.FailedPrecondition, "forward mode: a check presents the member's own token, which stays at its relay")
	case sourceKind(k.source.Load()) == sourcePeer || k.presentedNode.Load() == nil:
		return nil, status.Errorf(codes.FailedPrecondition, "key %q: not its upstream source", req.GetKey())
	}
	release, ok := s.r.checkSlots.tryAcquire()
	if !ok {
		return nil, status.Error(codes.Unavailable, "as many checks as the relay runs at a time run already")
	}
	defer release()
	if !k.startCheck() {
		return nil, status.Errorf(codes.Unavailable, "key %q: a check runs already", req.GetKey())
	}
	differ, split, err := s.r.runCheck(ctx, k, nodeMember{node})
	k.endCheck()
	if splits := s.r.cache.splits.of(k.key); len(splits) > 0 {
		_ = grpc.SetHeader(ctx, metadata.Pairs(peers.MDSplits, string(aggkey.EncodeSplits(splits))))
	}
	switch {
	case errors.Is(err, divergence.ErrWantGrew) || errors.Is(err, divergence.ErrNotComparable):
		return nil, status.Errorf(codes.Unavailable, "check: %v", err) // ask again
	case err != nil:
		return nil, status.Errorf(codes.Aborted, "check: %v", err)
	}
	out := &inspectpb.CheckMemberResult{Relay: s.r.cfg.ID, Diverged: len(differ) > 0}
	for _, t := range differ {
		out.Types = append(out.Types, xds.ShortType(t))
	}
	if out.Diverged {
		out.Split = split.String()
	}
	return out, nil
}

// nodeMember is a member of a key at another relay, known by its node, as a
// check presents it.
type nodeMember struct{ node *core.Node }

func (m nodeMember) presents() (*core.Node, *credential) { return m.node, nil }
func (nodeMember) peerRelayID() string                   { return "" }
func (nodeMember) viewsChanged()                         {}

// runCheck checks m against the node k's stream presents, and splits k if
// the upstream gives them different config: it returns the types that
// differ (none: the same) and the split.
func (r *Relay) runCheck(ctx context.Context, k *keyState, m member) ([]string, aggkey.Split, error) {
	node, cred := m.presents()
	if r.cfg.Upstream.ForwardCredentials {
		ctx = withCredential(ctx, cred)
	}
	differ, presented, err := r.prober().Check(ctx, checkedKey{k}, node)
	switch {
	case err != nil:
		if ctx.Err() == nil {
			r.metrics.DivergenceChecks.WithLabelValues("inconclusive").Inc()
		}
		return nil, aggkey.Split{}, err
	case len(differ) == 0:
		r.metrics.DivergenceChecks.WithLabelValues("same").Inc()
		r.mergeBack(k.key, node)
		return nil, aggkey.Split{}, nil
	}
	r.metrics.DivergenceChecks.WithLabelValues("diverged").Inc()
	for _, typeURL := range differ {
		r.metrics.Divergences.WithLabelValues(xds.ShortType(typeURL)).Inc()
	}
	split := aggkey.NewSplit(node, presented)
	split.Epoch = uint64(r.cache.clock.Now())
	short := make([]string, len(differ))
	for i, t := range differ {
		short[i] = xds.ShortType(t)
	}
	r.log.Warn("key diverges: the upstream gives a member other config than the node the key presents, so the key profile is too coarse for this mesh; the member and its look-alikes move to keys of their own",
		"key", k.key, "node", node.GetId(), "presented", presented.GetId(),
		"fields_differing", aggkey.Differing(node, presented), "types", short, "split", split.String())
	if fresh := r.cache.splits.add(k.key, split); len(fresh) > 0 {
		r.cache.splitsChanged(k.key, fresh)
	}
	return differ, split, nil
}

// mergeBack merges back every split of k that moves node: a check found
// the upstream gives node the key's config, so nothing proves the split
// any more, and the nodes it moved return to the key, make-before-break
// (stream.followSplits). The tier learns of it as of a split.
func (r *Relay) mergeBack(k aggkey.Key, node *core.Node) {
	var merged []aggkey.Split
	for _, s := range r.cache.splits.active(k) {
		if s.Matches(node) {
			s.Epoch, s.Merged = uint64(r.cache.clock.Now()), true
			merged = append(merged, s)
		}
	}
	if len(merged) == 0 {
		return
	}
	fresh := r.cache.splits.add(k, merged...)
	for _, s := range fresh {
		r.metrics.SplitMerges.Inc()
		r.log.Info("key split merged back: the upstream gives a node it moved the key's config again", "key", k, "node", node.GetId(), "split", s.String())
	}
	r.cache.splitsChanged(k, fresh)
}

// prober lends the relay's upstream to a divergence check: opened at
// Config.Upstream.StreamRate, from a free first-answer slot
// (Config.Upstream.Syncs), counted in the check streams open.
func (r *Relay) prober() *divergence.Prober {
	p := &divergence.Prober{
		Conn:       r.upConn,
		Delta:      r.cfg.Upstream.Protocol == ProtocolDelta,
		MaxMsgSize: r.cfg.MaxMsgSize,
		Store:      r.store,
		Confirm:    confirmAfter,
		Slot:       r.cache.syncs.tryAcquire,
		Streams:    r.metrics.DivergenceOpen,
	}
	if r.cache.upstreamRate != nil {
		p.Pace = r.cache.upstreamRate.Wait
	}
	return p
}
