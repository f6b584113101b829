package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/adsclient"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// The divergence check (DESIGN.md, "The data path" 2). A key is a promise
// that the upstream gives its members the same config. The relay that holds
// a key's upstream stream tests the promise now and then: it opens a second
// upstream stream presenting another member's node, asks it what the key's
// stream asks, and compares the two by content. A difference that outlasts
// the upstream's churn means the key's profile is too coarse for this mesh:
// the key splits (aggkey.Split), and the diverging member and its
// look-alikes move to keys of their own, make-before-break (stream.rekey),
// while the rest stay aggregated.
//
// The cost is bounded: one check per key at a time (so at most one stream
// beside the key's own), at most maxDivergenceChecks per relay at a time,
// each opened at the upstream's pace (Config.Upstream.StreamRate) and ended
// after divergenceCheckFor at most.

// maxDivergenceChecks bounds the checks one relay runs at a time
// (Relay.checkSlots), its own and those other relays ask for.
const maxDivergenceChecks = 2

// divergenceSettle is how long a difference must stay the same, with no
// change on either stream, to count: the upstream pushes to its streams
// one after the other, so during a push the two disagree for a while.
const divergenceSettle = 3 * confirmAfter / 2

// divergenceCheckFor bounds one check: a key whose content keeps changing
// for longer is checked again at its next turn.
const divergenceCheckFor = 2 * time.Minute

// errRehomed ends a check of a key whose stream came to present another
// node: what the check got is compared with another node's config.
var errRehomed = errors.New("relay: the key's stream re-homed during the check")

// errNotComparable ends a check of a key whose views are not yet its
// upstream's answer to everything its members subscribe to, or that found
// every first-answer slot taken by keys: it runs again at the next tick.
var errNotComparable = errors.New("relay: the key's views are not its upstream's yet")

// errWantGrew ends a check that found the same config in the types it
// asked for while the key's members came to subscribe to more types.
var errWantGrew = errors.New("relay: the key's members subscribed to more types during the check")

// wantGrew reports whether now holds a cached type before lacked, or one
// before wanted by name that now is wanted whole.
func wantGrew(now, before map[string]bool) bool {
	for typeURL, wildcard := range now {
		if was, ok := before[typeURL]; xds.Cached(typeURL) && (!ok || wildcard && !was) {
			return true
		}
	}
	return false
}

// errChurning ends a check that found no settled answer in
// divergenceCheckFor.
var errChurning = errors.New("relay: the key's content kept changing")

// checkDivergence runs the keys' divergence checks until ctx ends: each
// aggregated key this relay holds, every DivergenceInterval (the first at a
// random point of it), and at once when a key gets its second member. A key
// this relay is the upstream source of is checked here; a key it gets from
// its owner is checked by the owner, asked (CheckMember) about this relay's
// own Envoys, since the owner sees only the node each relay presents.
func (r *Relay) checkDivergence(ctx context.Context) {
	tick := time.NewTicker(min(time.Second, r.cfg.Keys.DivergenceInterval))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-r.divergenceWake:
		}
		now := time.Now()
		for _, k := range r.heldKeys() {
			m, ok := k.checkDue(now, r.cfg.Keys.DivergenceInterval)
			recheck := false
			if !ok {
				if m, ok = k.recheckDue(now, r.cfg.Keys.DivergenceInterval); !ok {
					continue
				}
				recheck = true
			}
			select {
			case r.checkSlots <- struct{}{}:
			default:
				k.checkLater(m) // no slot: its turn comes again at the next tick
				continue
			}
			if !r.goRun(func(ctx context.Context) {
				defer func() { <-r.checkSlots }()
				if recheck {
					r.recheckSplit(ctx, k, m)
				} else {
					r.checkKey(ctx, k, m)
				}
			}) {
				<-r.checkSlots
				return
			}
		}
	}
}

// divergence is a key's divergence check state, under keyState.mu.
type divergence struct {
	// next is when the key is checked next; zero until it first has two
	// members.
	next time.Time
	// soon is a member to check at once: the second to join.
	soon member
	// running is set while a check of the key runs.
	running bool
	// checked holds the members checked since the key last went round.
	checked map[member]bool
	// compared is what the members subscribed to (by type, whether whole)
	// when the last check began: a check answers for those types only.
	// When the members come to subscribe to more (an Envoy asks for
	// listeners once it holds clusters), the key is due again, and its
	// members are checked again from the first.
	compared map[string]bool
	// recheck is, for a key of a node of its own since a split, the wait
	// before its next re-check (recheckDue): splitRecheck at first,
	// doubled each time the split is proven again, up to the interval.
	recheck time.Duration
}

// splitRecheck is the first wait before a split is checked again. A split
// made during a fault (a frozen or slow peer, an upstream stream behind)
// may not hold once the fault ends: rechecked soon, and then less and less
// often while it is proven again, it is merged back within about a minute
// of the fault's end rather than at the next interval, and a split that
// holds costs a few checks more (issue 28: one a seed of fifty kept a key
// at two upstream streams to the run's end).
const splitRecheck = 30 * time.Second

// checkDue reports whether k's check is due now, and the member to check.
// It marks the check running; checkDone ends it.
func (k *keyState) checkDue(now time.Time, every time.Duration) (member, bool) {
	fromOwner := sourceKind(k.source.Load()) == sourcePeer
	if fromOwner && k.r.cfg.Upstream.ForwardCredentials {
		return nil, false // the owner would need the member's token
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	d := &k.div
	presented := k.presentedNode.Load()
	if d.running || len(k.members) < 2 || presented == nil || !comparable(k.views.Load(), k.wantedLocked()) {
		return nil, false // nothing to compare yet
	}
	if d.next.IsZero() {
		d.next = now.Add(randN(k.r.rand, every) + time.Nanosecond)
	}
	if d.compared != nil && wantGrew(k.wantedLocked(), d.compared) {
		d.next, d.compared = now, nil
		clear(d.checked)
	}
	candidate := func(m member) bool {
		node, cred := m.presents()
		if node == nil || node.GetId() == presented.GetId() {
			return false // the key's stream presents it
		}
		if fromOwner && m.peerRelayID() != "" {
			return false // another relay's stream: its relay asks
		}
		// In forward mode, the upstream wants the member's own token: a
		// relay's stream carries none.
		return !k.r.cfg.Upstream.ForwardCredentials || cred != nil
	}
	var pick member
	if d.soon != nil && slices.Contains(k.members, d.soon) && candidate(d.soon) {
		pick = d.soon
	} else if !now.Before(d.next) {
		for round := 0; round < 2 && pick == nil; round++ {
			for _, m := range k.members {
				if !d.checked[m] && candidate(m) {
					pick = m
					break
				}
			}
			if pick == nil {
				clear(d.checked) // every member was checked: go round again
			}
		}
	}
	d.soon = nil
	if pick == nil {
		return nil, false
	}
	d.running = true
	return pick, true
}

// recheckDue reports whether it is time to check again that the member of
// k, a key of a node of its own since a split (splitFrom), is given other
// config than the key it left: every interval, the first at a random point
// of it. It marks the check running; checkDone ends it.
func (k *keyState) recheckDue(now time.Time, every time.Duration) (member, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	d := &k.div
	if k.splitFrom == "" || d.running {
		return nil, false
	}
	i := slices.IndexFunc(k.members, func(m member) bool {
		node, _ := m.presents()
		return node != nil && m.peerRelayID() == ""
	})
	if i < 0 {
		return nil, false // its Envoy is at another relay, which checks it
	}
	if d.recheck == 0 {
		d.recheck = min(every, splitRecheck)
	}
	if d.next.IsZero() {
		d.next = now.Add(randN(k.r.rand, d.recheck) + time.Nanosecond)
	}
	if now.Before(d.next) {
		return nil, false
	}
	d.running = true
	return k.members[i], true
}

// recheckDone ends k's re-check of m: the next in recheck if the split
// was proven again (the wait then doubles, up to every), or could not be
// checked; merged back, the key is left and its state goes with it.
func (k *keyState) recheckDone(m member, proven bool, every time.Duration) {
	k.mu.Lock()
	d := &k.div
	wait := d.recheck
	if proven {
		d.recheck = min(2*d.recheck, every)
	}
	k.mu.Unlock()
	k.checkDone(m, time.Now().Add(wait), nil)
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
	r.mu.Lock()
	bk := r.keys[base]
	r.mu.Unlock()
	switch owner, self := r.ownerOf(base); {
	case bk != nil && sourceKind(bk.source.Load()) != sourcePeer && bk.presentedNode.Load() != nil:
		if !bk.startCheck() {
			k.checkLater(m)
			return
		}
		differ, _, err = r.runCheck(ctx, bk, m)
		bk.checkDone(nil, time.Time{}, nil)
	case self || r.cfg.Upstream.ForwardCredentials:
		// Nothing to compare with here (the key it left has no source
		// here), or the owner would need the member's token: the split
		// stays.
		err = errNotComparable
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
	k.recheckDone(m, err == nil && len(differ) > 0 || errors.Is(err, errNotComparable), r.cfg.Keys.DivergenceInterval)
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

// checkLater ends k's running check of m, which could not run (no check
// slot here, or the owner busy): m is checked first at the next tick, as
// the member that just joined is, instead of losing its turn until the
// next round.
func (k *keyState) checkLater(m member) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.div.running = false
	if k.div.soon == nil {
		k.div.soon = m
	}
}

// startCheck marks a check of k running, unless one runs: for a check
// another relay asked for.
func (k *keyState) startCheck() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.div.running {
		return false
	}
	k.div.running = true
	return true
}

// checkDone ends k's running check of m (nil: none, or not a member); a
// check of a member sets the next at next (zero: the next turn).
func (k *keyState) checkDone(m member, next time.Time, compared map[string]bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	d := &k.div
	d.running = false
	if m != nil {
		if d.checked == nil {
			d.checked = make(map[member]bool)
		}
		d.checked[m] = true
		d.next = next
		d.compared = compared
	}
}

// forget drops m from k's divergence state as it leaves. The caller holds
// k.mu.
func (d *divergence) forget(m member) {
	delete(d.checked, m)
	if d.soon == m {
		d.soon = nil
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
		if errors.Is(err, errWantGrew) || errors.Is(err, errNotComparable) {
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
	ctx, cancel := context.WithTimeout(ctx, divergenceCheckFor+r.cfg.Tier.GatherTimeout)
	defer cancel()
	ctx = r.asPeer(ctx)
	var md metadata.MD
	res, err := inspectpb.NewInspectClient(conn).CheckMember(ctx, &inspectpb.CheckMemberRequest{Key: string(key), Node: b}, grpc.Header(&md))
	if v := md.Get(peers.MDSplits); len(v) == 1 {
		// The owner's records of the key's splits, the check's included
		// (a split it found, or merged back).
		if splits, derr := aggkey.DecodeSplits([]byte(v[0])); derr == nil {
			r.learnSplits(key, splits)
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
	s.r.mu.Lock()
	k := s.r.keys[aggkey.Key(req.GetKey())]
	s.r.mu.Unlock()
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
	select {
	case s.r.checkSlots <- struct{}{}:
		defer func() { <-s.r.checkSlots }()
	default:
		return nil, status.Error(codes.Unavailable, "as many checks as the relay runs at a time run already")
	}
	if !k.startCheck() {
		return nil, status.Errorf(codes.Unavailable, "key %q: a check runs already", req.GetKey())
	}
	differ, split, err := s.r.runCheck(ctx, k, nodeMember{node})
	k.checkDone(nil, time.Time{}, nil)
	if splits := s.r.splits.of(k.key); len(splits) > 0 {
		_ = grpc.SetHeader(ctx, metadata.Pairs(peers.MDSplits, string(aggkey.EncodeSplits(splits))))
	}
	switch {
	case errors.Is(err, errWantGrew) || errors.Is(err, errNotComparable):
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
	presented := k.presentedNode.Load()
	node, _ := m.presents()
	differ, err := r.probe(ctx, k, m)
	if err == nil && k.presentedNode.Load() != presented {
		err = errRehomed
	}
	switch {
	case err != nil:
		if ctx.Err() == nil {
			r.metrics.divergenceChecks.WithLabelValues("inconclusive").Inc()
		}
		return nil, aggkey.Split{}, err
	case len(differ) == 0:
		r.metrics.divergenceChecks.WithLabelValues("same").Inc()
		r.mergeBack(k.key, node)
		return nil, aggkey.Split{}, nil
	}
	r.metrics.divergenceChecks.WithLabelValues("diverged").Inc()
	for _, typeURL := range differ {
		r.metrics.divergences.WithLabelValues(xds.ShortType(typeURL)).Inc()
	}
	split := aggkey.NewSplit(node, presented)
	split.Epoch = uint64(r.clock.Now())
	short := make([]string, len(differ))
	for i, t := range differ {
		short[i] = xds.ShortType(t)
	}
	r.log.Warn("key diverges: the upstream gives a member other config than the node the key presents, so the key profile is too coarse for this mesh; the member and its look-alikes move to keys of their own",
		"key", k.key, "node", node.GetId(), "presented", presented.GetId(),
		"fields_differing", aggkey.Differing(node, presented), "types", short, "split", split.String())
	if fresh := r.splits.add(k.key, split); len(fresh) > 0 {
		r.splitsChanged(k.key, fresh)
	}
	return differ, split, nil
}

// mergeBack merges back every split of k that moves node: a check found
// the upstream gives node the key's config, so nothing proves the split
// any more, and the nodes it moved return to the key, make-before-break
// (stream.followSplits). The tier learns of it as of a split.
func (r *Relay) mergeBack(k aggkey.Key, node *core.Node) {
	var merged []aggkey.Split
	for _, s := range r.splits.active(k) {
		if s.Matches(node) {
			s.Epoch, s.Merged = uint64(r.clock.Now()), true
			merged = append(merged, s)
		}
	}
	if len(merged) == 0 {
		return
	}
	fresh := r.splits.add(k, merged...)
	for _, s := range fresh {
		r.metrics.splitMerges.Inc()
		r.log.Info("key split merged back: the upstream gives a node it moved the key's config again", "key", k, "node", node.GetId(), "split", s.String())
	}
	r.splitsChanged(k, fresh)
}

// probe runs one check: an upstream stream presenting m's node asks for
// what k's views hold, until its answers and k's views agree (nil), or
// differ the same way for divergenceSettle with no change on either side
// (the types that differ).
func (r *Relay) probe(ctx context.Context, k *keyState, m member) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, divergenceCheckFor)
	defer cancel()
	node, cred := m.presents()
	presented := k.presentedNode.Load()
	wanted := k.wantedTypes()
	asked := askedOf(k.views.Load(), wanted)
	if len(asked) == 0 {
		return nil, errNotComparable
	}
	if r.upstreamRate != nil {
		if err := r.upstreamRate.Wait(ctx); err != nil {
			return nil, err
		}
	}
	if r.cfg.Upstream.ForwardCredentials {
		ctx = withCredential(ctx, cred)
	}
	// A check's first answers are a sync like a key's (Config.Upstream.Syncs),
	// taken only from a free slot: a cold tier's checks wait until its keys'
	// first answers are in, and never add to them.
	release, ok := r.syncs.tryAcquire()
	if !ok {
		return nil, errNotComparable
	}
	defer release()
	r.metrics.divergenceOpen.Inc()
	defer r.metrics.divergenceOpen.Dec()
	p := &probeStream{r: r, asked: asked, got: make(map[string]map[string]ledger.Hash)}
	s, err := adsclient.Open(ctx, r.upConn, adsclient.Config{
		Delta:       r.cfg.Upstream.Protocol == ProtocolDelta,
		Node:        node,
		CallOptions: []grpc.CallOption{grpc.MaxCallRecvMsgSize(r.cfg.MaxMsgSize)},
	})
	if err != nil {
		return nil, fmt.Errorf("open check stream: %w", err)
	}
	defer s.Close()
	for _, typeURL := range p.types() {
		names := p.asked[typeURL]
		if err := s.Subscribe(typeURL, names == nil, names); err != nil {
			return nil, fmt.Errorf("check stream: %w", err)
		}
	}

	tick := time.NewTicker(confirmAfter / 4)
	defer tick.Stop()
	// Each difference, from when it was first seen: one that lasts
	// divergenceSettle counts. A push makes passing differences, each
	// gone once both streams have it; a divergence stays the same.
	seen := make(map[difference]time.Time)
	// lastAnswer is when the check's stream last answered; compared is
	// when every type first had an answer to compare.
	lastAnswer := time.Now()
	var compared, unconfirmed time.Time
	for {
		select {
		case <-ctx.Done():
			return nil, errChurning
		case err := <-s.Err():
			return nil, fmt.Errorf("check stream: %w", err)
		case m := <-s.Responses():
			err := p.handle(m)
			if err == nil {
				err = s.ACK(m)
			}
			m.Release()
			if err != nil {
				return nil, fmt.Errorf("check stream: %w", err)
			}
			lastAnswer = time.Now()
		case <-tick.C:
		}
		now := time.Now()
		v := k.views.Load()
		if !v.Stale && !v.Restored {
			unconfirmed = time.Time{}
		}
		diffs, ok := p.compare(v)
		if ok || now.Sub(lastAnswer) >= confirmAfter {
			release() // every type answered, or the answers paused
		}
		if ok && compared.IsZero() {
			compared = now
		}
		switch {
		case k.presentedNode.Load() != presented:
			return nil, errRehomed
		case (v.Stale || v.Restored) && !unconfirmed.IsZero() && now.Sub(unconfirmed) >= 2*confirmAfter:
			return nil, errors.New("relay: the key's views stayed unconfirmed by its upstream")
		case v.Stale || v.Restored:
			// The key's views are not its upstream's now: nothing to
			// compare until they are again.
			clear(seen)
			compared = time.Time{}
			if unconfirmed.IsZero() {
				unconfirmed = now
			}
		case !ok && now.Sub(lastAnswer) >= 2*confirmAfter:
			// The upstream says nothing of a type (a SotW server may not
			// answer names it lacks): nothing to compare it with.
			return nil, errors.New("relay: the upstream did not answer every type the check asked")
		case !ok: // not every type answered yet
		case len(diffs) > 0 && now.Sub(compared) >= 2*divergenceSettle:
			// Any difference there from the first comparison on would
			// have lasted divergenceSettle by now: the ones left are a
			// push's passing differences, under churn that never pauses.
			if differ := settled(seen, diffs, now); len(differ) > 0 {
				return differ, nil
			}
			fallthrough
		case len(diffs) == 0:
			if wantGrew(k.wantedTypes(), wanted) {
				// The same in what it asked, but the members now want
				// types it did not (an Envoy asks for listeners once it
				// has clusters): not an answer for the whole.
				return nil, errWantGrew
			}
			return nil, nil
		default:
			if differ := settled(seen, diffs, time.Now()); len(differ) > 0 {
				return differ, nil
			}
		}
	}
}
