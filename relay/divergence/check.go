package divergence

import (
	"context"
	"errors"
	"fmt"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/adsclient"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// CheckFor bounds one check: a key whose content keeps changing for
// longer is checked again at its next turn. A relay that asks another to
// check for it waits this long, and the time the call takes.
const CheckFor = 2 * time.Minute

// ErrNotComparable ends a check of a key whose views are not yet its
// upstream's answer to everything its members subscribe to, or that found
// every first-answer slot taken by keys: it runs again at the next tick.
var ErrNotComparable = errors.New("divergence: the key's views are not its upstream's yet")

// ErrWantGrew ends a check that found the same config in the types it
// asked for while the key's members came to subscribe to more types: the
// whole of it is compared at the next tick.
var ErrWantGrew = errors.New("divergence: the key's members subscribed to more types during the check")

// errRehomed ends a check of a key whose stream came to present another
// node: what the check got is compared with another node's config.
var errRehomed = errors.New("divergence: the key's stream re-homed during the check")

// errChurning ends a check that found no settled answer in CheckFor.
var errChurning = errors.New("divergence: the key's content kept changing")

// Key is what a key offers its check: its views, what its members
// subscribe to, and the node its upstream stream presents, each read as
// it is now. The check's goroutine calls it while the key goes on being
// fed and joined, so its methods must be safe for concurrent use.
type Key interface {
	// Views returns the key's views as published now.
	Views() *views.Set
	// Wanted returns the types the key's members subscribe to, and
	// whether any subscribes to everything of each.
	Wanted() map[string]bool
	// Presented returns the node the key's upstream stream presents now
	// (nil before the first).
	Presented() *core.Node
}

// Prober is what the relay lends a check: its upstream, opened at the
// upstream's pace and only from a free first-answer slot. Fill it in
// full (Pace, Slot and Streams may be nil) and do not change it after:
// then Check is safe for concurrent use.
type Prober struct {
	// Conn is the connection to the upstream the check's stream opens on.
	Conn grpc.ClientConnInterface
	// Delta opens the check's stream with the incremental protocol, as
	// the key's own; false: State of the World.
	Delta bool
	// MaxMsgSize bounds a response the check's stream reads, in bytes.
	MaxMsgSize int
	// Store decodes the check's answers as the relay's views are decoded
	// (content the store holds is hashed, not decoded again).
	Store *xds.Store
	// Confirm is the relay's silence window: how long an upstream may
	// stay silent on a new stream before its silence confirms a key's
	// views. The check ticks at a quarter of it, gives the first-answer
	// slot back after a pause of it, counts a difference that lasts 3/2
	// of it (settle), and gives up on a type unanswered, or views
	// unconfirmed, for twice it.
	Confirm time.Duration
	// Pace waits for the upstream's stream rate before the check's stream
	// opens (nil: no bound), and fails when ctx ends first.
	Pace func(ctx context.Context) error
	// Slot takes one of the first-answer slots the relay's keys share, if
	// one is free now (nil: no bound): a check's first answers are a sync
	// like a key's, and never wait for a slot. release gives it back; it
	// may be called more than once.
	Slot func() (release func(), ok bool)
	// Streams counts the check streams open (nil: not counted).
	Streams prometheus.Gauge
}

// settle is how long a difference must stay the same, with no change on
// either stream, to count: the upstream pushes to its streams one after
// the other, so during a push the two disagree for a while.
func (p *Prober) settle() time.Duration { return 3 * p.Confirm / 2 }

// Check runs one check of node, a member of k, against the node k's
// stream presents: an upstream stream presenting node asks for what k's
// views hold, until its answers and k's views agree (no types), or
// differ the same way for settle with no change on either side (the
// types that differ, in push order). It returns the node it compared with.
// ctx carries what the stream presents beside the node (a forwarded
// credential); Check ends within CheckFor.
func (p *Prober) Check(ctx context.Context, k Key, node *core.Node) (differ []string, presented *core.Node, err error) {
	presented = k.Presented()
	differ, err = p.probe(ctx, k, node)
	if err == nil && k.Presented() != presented {
		err = errRehomed
	}
	if err != nil {
		return nil, presented, err
	}
	return differ, presented, nil
}

// probe runs one check's stream (see Check).
func (p *Prober) probe(ctx context.Context, k Key, node *core.Node) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, CheckFor)
	defer cancel()
	presented := k.Presented()
	wanted := k.Wanted()
	asked := askedOf(k.Views(), wanted)
	if len(asked) == 0 {
		return nil, ErrNotComparable
	}
	if p.Pace != nil {
		if err := p.Pace(ctx); err != nil {
			return nil, err
		}
	}
	release := func() {}
	if p.Slot != nil {
		var ok bool
		if release, ok = p.Slot(); !ok {
			return nil, ErrNotComparable
		}
	}
	defer release()
	if p.Streams != nil {
		p.Streams.Inc()
		defer p.Streams.Dec()
	}
	ps := &probeStream{store: p.Store, asked: asked, got: make(map[string]map[string]ledger.Hash)}
	s, err := adsclient.Open(ctx, p.Conn, adsclient.Config{
		Delta:       p.Delta,
		Node:        node,
		CallOptions: []grpc.CallOption{grpc.MaxCallRecvMsgSize(p.MaxMsgSize)},
	})
	if err != nil {
		return nil, fmt.Errorf("open check stream: %w", err)
	}
	defer s.Close()
	for _, typeURL := range ps.types() {
		names := ps.asked[typeURL]
		if err := s.Subscribe(typeURL, names == nil, names); err != nil {
			return nil, fmt.Errorf("check stream: %w", err)
		}
	}

	confirm, settle := p.Confirm, p.settle()
	tick := time.NewTicker(confirm / 4)
	defer tick.Stop()
	// Each difference, from when it was first seen: one that lasts
	// settle counts. A push makes passing differences, each gone once
	// both streams have it; a divergence stays the same.
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
			err := ps.handle(m)
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
		v := k.Views()
		if !v.Stale && !v.Restored {
			unconfirmed = time.Time{}
		}
		diffs, ok := ps.compare(v)
		if ok || now.Sub(lastAnswer) >= confirm {
			release() // every type answered, or the answers paused
		}
		if ok && compared.IsZero() {
			compared = now
		}
		switch {
		case k.Presented() != presented:
			return nil, errRehomed
		case (v.Stale || v.Restored) && !unconfirmed.IsZero() && now.Sub(unconfirmed) >= 2*confirm:
			return nil, errors.New("divergence: the key's views stayed unconfirmed by its upstream")
		case v.Stale || v.Restored:
			// The key's views are not its upstream's now: nothing to
			// compare until they are again.
			clear(seen)
			compared = time.Time{}
			if unconfirmed.IsZero() {
				unconfirmed = now
			}
		case !ok && now.Sub(lastAnswer) >= 2*confirm:
			// The upstream says nothing of a type (a SotW server may not
			// answer names it lacks): nothing to compare it with.
			return nil, errors.New("divergence: the upstream did not answer every type the check asked")
		case !ok: // not every type answered yet
		case len(diffs) > 0 && now.Sub(compared) >= 2*settle:
			// Any difference there from the first comparison on would
			// have lasted settle by now: the ones left are a push's
			// passing differences, under churn that never pauses.
			if differ := settled(seen, diffs, now, settle); len(differ) > 0 {
				return differ, nil
			}
			fallthrough
		case len(diffs) == 0:
			if wantGrew(k.Wanted(), wanted) {
				// The same in what it asked, but the members now want
				// types it did not (an Envoy asks for listeners once it
				// has clusters): not an answer for the whole.
				return nil, ErrWantGrew
			}
			return nil, nil
		default:
			if differ := settled(seen, diffs, time.Now(), settle); len(differ) > 0 {
				return differ, nil
			}
		}
	}
}
