package relay

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/wire"
)

// tellSplits sends a relay subscribing to a key here, in the stream's
// header, the key's splits, after adding the ones it told.
func (s *stream) tellSplits(pi *peerIdentity) {
	if len(pi.splits) > 0 {
		s.srv.cache.learnSplits(pi.key, pi.splits)
	}
	s.splitGen = s.srv.cache.splits.gen.Load()
	splits := s.srv.cache.splits.of(pi.key)
	if len(splits) == 0 {
		return
	}
	s.splitsTold = string(aggkey.EncodeSplits(splits))
	_ = grpc.SetHeader(s.ctx, metadata.Pairs(peers.MDSplits, s.splitsTold))
}

// followSplits moves the stream where a split of its key sends it
// (splits come of the divergence check: package divergence, run by
// checks.go). It runs on the stream's handler goroutine, at every sync.
//
// An Envoy's stream moves make-before-break: it joins its new key, with its
// subscriptions, and goes on being served by its old key until the new
// key's views cover every type it subscribes to; then it leaves the old key
// and its next sync sends the differences only. It never sees its config
// go back, nor a resource removed that the new key has.
//
// Another relay's stream, subscribing to a key this relay is the source of,
// ends with the key's splits in its trailer (MDSplits): that relay moves
// its own Envoys, and subscribes again at once.
func (s *stream) followSplits() error {
	gen := s.srv.cache.splits.gen.Load()
	if s.next == nil && gen == s.splitGen {
		return nil
	}
	s.splitGen = gen
	if s.peerRelay != nil {
		splits := s.srv.cache.splits.of(s.key.name())
		if len(splits) == 0 {
			return nil // another key split
		}
		told := string(aggkey.EncodeSplits(splits))
		if told == s.splitsTold {
			return nil
		}
		_ = grpc.SetTrailer(s.ctx, metadata.Pairs(peers.MDSplits, told))
		return status.Error(codes.Aborted, errKeySplit.Error())
	}
	if s.next == nil {
		want, base := s.srv.cache.keyOf(s.node, s.identity)
		if want == s.key.name() {
			return nil
		}
		s.next = s.srv.cache.join(want, s)
		s.next.leftBySplit(want, base)
		for typeURL, sub := range s.subs {
			s.next.subscribe(typeURL, false, sub.wildcard, nil, sub.names)
		}
		if want == base {
			s.log.Info("the split that moved the stream merged back: it returns to its key once that key has its config", "to", want)
		} else {
			s.log.Info("the stream's key split: it moves to a key of its own once that key has its config", "to", want)
		}
	}
	if !covers(s.next.published(), s.subs, time.Now(), s.srv.cfg.XDS.ResourceWaitTimeout) {
		return nil
	}
	old := s.key
	s.srv.attach(s, s.next)
	if base := old.splitBase(); base != "" && s.next.name() == base {
		old.abandon() // merged back (before leave wakes its feed)
	}
	old.leave(s, s.subscriptions())
	s.key, s.next = s.next, nil
	s.declareHeld()
	now := time.Now()
	s.led.Disconnect(now)
	s.led = s.srv.ledgerConnect(s.node, s.key.name(), now)
	for typeURL := range s.subs {
		s.led.Subscribe(typeURL)
	}
	s.log.Info("the stream moved", "from", old.name(), "to", s.key.name())
	return nil
}

// declareHeld makes what the client holds of each type a declaration, as if
// it had reconnected (stream.reconnected): a key the stream moves to has
// views of its own, from a source of its own, which may be older than what
// the old key sent it (a key restored from a snapshot; the base key's
// stream, older than the split key's). The client keeps what it holds
// until the new key's views cover it.
func (s *stream) declareHeld() {
	for _, sub := range s.subs {
		if sub.known.Len() == 0 || sub.sent.version == "" {
			continue
		}
		_, o, err := wire.ParseVersion(sub.sent.version)
		if err != nil || !s.srv.cache.placed(o, true) {
			o = s.srv.cache.declaredBound()
		}
		sub.orders, sub.declared = sub.orders.add(o), true
	}
}

// covers reports whether views v hold an answer for every subscription
// in subs: each type answered, whole for a wildcard subscription, and no
// name still awaited.
func covers(v *views.Set, subs map[string]*typeSub, now time.Time, wait time.Duration) bool {
	for typeURL, sub := range subs {
		tv := v.Types[typeURL]
		if tv == nil || !tv.Ready || sub.wildcard && !tv.Full {
			return false
		}
		for _, name := range sub.names {
			if tv.IsPending(name, now, wait) {
				return false
			}
		}
	}
	return true
}
