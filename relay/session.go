package relay

import (
	"context"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/meshrelay/meshrelay/relay/adsclient"
)

// session is one stream to a key's source, once open (feed.session): what
// its loop waits for, and what it does with each. Its loop runs on the
// key's feed goroutine; nothing else touches it.
//
// The views are confirmed (the key is fresh, for the admin API, the
// metrics and persistence) once the stream answered every type it was
// asked, or by silence (firstAnswers). Confirmation orders nothing: every
// view carries its Order, and clients are served by it (stream.sync).
type session struct {
	u    *feed
	src  source
	up   *adsclient.Stream
	node *core.Node // the node the stream presents

	first   *firstAnswers
	release func() // gives the first-answer slot back (idempotent)
	// answered holds the types the stream answered.
	answered map[string]bool
	got      bool // a response came

	// retry ticks while the key is in fallback (is the owner back?) or a
	// switch of source waits for the new source to be reachable (nil:
	// not ticking); switchSince is when a switch was first wanted but put
	// off.
	retryTicker *time.Ticker
	retry       <-chan time.Time
	switchSince time.Time
	// renewAt fires for a renewal put off (renewAfter); refresh when the
	// presented member's token is about to expire (forward mode).
	renewAt <-chan time.Time
	refresh *time.Timer
}

// loop reacts to the stream and the key until the session must end, and
// says why.
func (s *session) loop(ctx context.Context) error {
	u := s.u
	for {
		var err error
		select {
		case m := <-s.up.Responses():
			err = s.response(m)
		case <-s.first.C():
			s.firstTimer()
		case err := <-s.up.Err():
			if s.src.kind == sourcePeer {
				return ownerEnded(err)
			}
			return err
		case <-s.retry:
			if s.switchNow() {
				return errSourceChanged
			}
		case <-s.renewAt:
			s.renewAt = nil
			if s.renew() {
				return errRenew
			}
		case <-u.k.upWake:
			err = s.keyChanged()
		case <-u.idleC():
			if u.idleFired() {
				return errIdle
			}
		case <-u.expiryC():
			u.expirePending()
		case <-timerC(s.refresh):
			s.refresh = nil
			if first, n := u.k.presenter(); n > 0 && first != u.presented && u.tokenExpiring(first) {
				u.log("re-homing upstream stream: its token expires", "from", s.node.GetId(), "to", memberNode(first).GetId())
				return errRehome
			}
		case <-ctx.Done():
			return ctx.Err()
		}
		if err != nil {
			return err
		}
	}
}

// response applies one of the source's responses to the key's views.
func (s *session) response(m adsclient.Response) error {
	u := s.u
	if !s.got && s.src.kind == sourcePeer {
		if md, err := s.up.Header(); err == nil { // sent before the first response
			u.readSplits(md)
		}
	}
	s.got = true
	u.demandSent = max(u.demandSent, u.demandCarried)
	if err := u.handle(m); err != nil {
		return err
	}
	s.answered[m.GetTypeUrl()] = true
	if back, _ := s.first.answered(time.Now(), u.allAnswered(s.answered)); back {
		s.release()
	}
	if s.first.confirmed {
		u.setStale(u.ownerStale) // an owner's views may go stale and back
	}
	return nil
}

// firstTimer gives the first-answer slot back, or confirms the views by
// silence, when their time came (firstAnswers).
func (s *session) firstTimer() {
	back, bySilence := s.first.fired(time.Now(), s.u.mayBeSilent(s.src))
	if back {
		s.release()
	}
	if bySilence {
		s.u.confirmedBySilence()
	}
}

// keyChanged follows the key's members and subscriptions: a new source, a
// demand to renew for, a presented member gone (or its token expiring),
// idleness, and the requests the subscriptions now need.
func (s *session) keyChanged() error {
	u := s.u
	if s.switchNow() {
		return errSourceChanged
	}
	if s.renew() {
		return errRenew
	}
	first, n := u.k.presenter()
	if n > 0 && first != u.presented && (!u.k.isMember(u.presented) || u.tokenExpiring(first)) {
		if u.presentsSame(first, s.node) {
			u.presented = first // the upstream has nothing to learn from a new stream
		} else {
			u.log("re-homing upstream stream", "from", s.node.GetId(), "to", memberNode(first).GetId())
			return errRehome
		}
	}
	u.checkIdle()
	if err := u.resubscribe(); err != nil {
		return err
	}
	u.armExpiry() // streams may have added pending names
	return nil
}

// switchNow reports whether to end this session for the key's new
// source: make before break, the session goes on until the new source can
// be reached (or for switchPatience, after which the new source is tried
// anyway and falls back if it fails).
func (s *session) switchNow() bool {
	u := s.u
	next := u.choose()
	if next == s.src {
		s.switchSince = time.Time{}
		return false
	}
	if next.kind == sourcePeer && !u.ownerReady(next.addr) {
		if s.switchSince.IsZero() {
			s.switchSince = time.Now()
		}
		if time.Since(s.switchSince) < switchPatience {
			s.retryTicker.Reset(switchRetryInterval)
			s.retry = s.retryTicker.C
			return false
		}
	}
	u.log("switching source", "from", s.src.kind, "to", next.kind, "owner", next.addr)
	return true
}

// renew reports whether to end the session now for one that covers what
// clients demanded; a renewal put off arms renewAt.
func (s *session) renew() bool {
	wait, now := s.u.renewal(s.src)
	if !now && wait > 0 && s.renewAt == nil {
		s.renewAt = time.After(wait)
	}
	return now
}
