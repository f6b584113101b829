package envoy

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"math/rand/v2"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// stream is the open ADS stream, one of the two kinds.
type stream struct {
	sotw  discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient
	delta discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
}

// inbound is one Recv result handed from the receiver to the stream owner.
type inbound struct {
	sotw  *discovery.DiscoveryResponse
	delta *discovery.DeltaDiscoveryResponse
	at    time.Time
	err   error
}

// outbound is one request to send, with the event to report once sent.
type outbound struct {
	sotw  *discovery.DiscoveryRequest
	delta *discovery.DeltaDiscoveryRequest
	ev    *Event
}

var nonceSeed = maphash.MakeSeed()

// run owns the stream: it connects, reconnects with backoff, and processes
// responses and subscription changes until ctx ends.
func (e *Envoy) run(ctx context.Context) {
	defer func() {
		e.mu.Lock()
		e.stats.Connected = false
		e.notifyLocked()
		e.mu.Unlock()
		close(e.done)
	}()
	client := discovery.NewAggregatedDiscoveryServiceClient(e.cfg.Conn)
	failures := 0
	for attempt := 0; ; attempt++ {
		if attempt > 0 && !sleep(ctx, backoffDelay(e.cfg.Backoff, max(failures-1, 0), e.cfg.Rand)) {
			return
		}
		if ctx.Err() != nil {
			return
		}
		answered, err := e.session(ctx, client)
		if answered {
			failures = 0
		} else {
			failures++
		}
		if ctx.Err() != nil {
			return
		}
		e.mu.Lock()
		e.stats.LastErr = err
		e.mu.Unlock()
		e.log.Info("ads stream ended", "err", err, "failures", failures)
	}
}

// backoffDelay returns a random delay in [d/2, d), d = min(Max, Base·2^n),
// drawn from rng (the global source if nil).
func backoffDelay(b Backoff, n int, rng *rand.Rand) time.Duration {
	d := b.Base
	for i := 0; i < n && d < b.Max; i++ {
		d *= 2
	}
	d = min(d, b.Max)
	half := d / 2
	if half <= 0 {
		return d
	}
	if rng != nil {
		return half + time.Duration(rng.Int64N(int64(d-half)))
	}
	return half + rand.N(d-half)
}

// sleep waits d or until ctx ends; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// session runs one stream until it fails or ctx ends. It reports whether a
// response arrived.
func (e *Envoy) session(ctx context.Context, client discovery.AggregatedDiscoveryServiceClient) (answered bool, err error) {
	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	if len(e.cfg.Metadata) > 0 {
		md, _ := metadata.FromOutgoingContext(sctx)
		sctx = metadata.NewOutgoingContext(sctx, metadata.Join(md, e.cfg.Metadata))
	}
	var st stream
	opt := grpc.MaxCallRecvMsgSize(e.cfg.MaxRecvMsgSize)
	if e.cfg.Protocol == Delta {
		st.delta, err = client.DeltaAggregatedResources(sctx, opt)
	} else {
		st.sotw, err = client.StreamAggregatedResources(sctx, opt)
	}
	if err != nil {
		return false, fmt.Errorf("open stream: %w", err)
	}

	e.mu.Lock()
	if e.streams > 0 {
		e.stats.Reconnects++
	}
	e.streams++
	e.stats.Connected = true
	e.firstSent = false
	e.nonces = make(map[uint64]struct{})
	for _, ts := range e.order {
		ts.resetStream()
	}
	e.notifyLocked()
	e.mu.Unlock()
	e.log.Info("ads stream open", "protocol", e.cfg.Protocol.String())
	if e.cfg.OnEvent != nil {
		e.cfg.OnEvent(Event{Kind: Opened, At: time.Now()})
	}
	defer func() {
		e.mu.Lock()
		e.stats.Connected = false
		e.notifyLocked()
		e.mu.Unlock()
	}()

	in := make(chan inbound)
	recvDone := make(chan struct{})
	go e.receive(sctx, st, in, recvDone)
	defer func() {
		scancel()
		<-recvDone
	}()

	// A Send fails with io.EOF once the server ended the stream; only Recv
	// says why (a refused stream's status).
	sendFailed := func(err error) error {
		if !errors.Is(err, io.EOF) {
			return err
		}
		for {
			select {
			case r := <-in:
				if r.err != nil {
					return fmt.Errorf("recv: %w", r.err)
				}
			case <-recvDone:
				return err
			case <-ctx.Done():
				return err
			}
		}
	}
	if err := e.flush(st); err != nil {
		return false, sendFailed(err)
	}
	for {
		select {
		case <-ctx.Done():
			return answered, ctx.Err()
		case <-e.kick:
			if err := e.flush(st); err != nil {
				return answered, sendFailed(err)
			}
		case r := <-in:
			if r.err != nil {
				return answered, fmt.Errorf("recv: %w", r.err)
			}
			answered = true
			var out []outbound
			if r.delta != nil {
				out = e.handleDelta(r.delta, r.at)
			} else {
				out = e.handleSotw(r.sotw, r.at)
			}
			if err := e.send(st, out); err != nil {
				return answered, sendFailed(err)
			}
		}
	}
}

// receive reads responses and hands them over, until the stream fails or ctx
// ends. It stops reading while paused and waits ReadDelay before each read.
func (e *Envoy) receive(ctx context.Context, st stream, out chan<- inbound, done chan<- struct{}) {
	defer close(done)
	for {
		if d := e.cfg.ReadDelay; d > 0 && !sleep(ctx, d) {
			return
		}
		e.mu.Lock()
		resume := e.resume
		e.mu.Unlock()
		if resume != nil {
			select {
			case <-resume:
			case <-ctx.Done():
				return
			}
		}
		var r inbound
		if st.delta != nil {
			r.delta, r.err = st.delta.Recv()
		} else {
			r.sotw, r.err = st.sotw.Recv()
		}
		r.at = time.Now()
		select {
		case out <- r:
		case <-ctx.Done():
			return
		}
		if r.err != nil {
			return
		}
	}
}

// flush sends the pending subscription requests.
func (e *Envoy) flush(st stream) error {
	e.mu.Lock()
	out := e.pendingLocked(nil)
	e.mu.Unlock()
	return e.send(st, out)
}

// send sends requests in order, then reports their events and logs the
// violations recorded meanwhile.
func (e *Envoy) send(st stream, out []outbound) error {
	var err error
	for i, o := range out {
		if o.delta != nil {
			err = st.delta.Send(o.delta)
		} else {
			err = st.sotw.Send(o.sotw)
		}
		if err != nil {
			err = fmt.Errorf("send: %w", err)
			out = out[:i]
			break
		}
		if o.ev != nil {
			o.ev.At = time.Now()
		}
	}
	if e.cfg.OnEvent != nil {
		for _, o := range out {
			if o.ev != nil && o.ev.Kind != Received {
				e.cfg.OnEvent(*o.ev)
			}
		}
	}
	e.mu.Lock()
	logs := e.vlog
	e.vlog = nil
	e.mu.Unlock()
	for _, v := range logs {
		e.log.Warn("xds violation", "type", v.TypeURL, "nonce", v.Nonce, "rule", string(v.Rule), "detail", v.Detail)
	}
	return err
}

// pendingLocked appends the requests of every dirty type, in request order.
func (e *Envoy) pendingLocked(out []outbound) []outbound {
	for _, ts := range e.order {
		if !ts.dirty {
			continue
		}
		if !ts.opened && !ts.wanted() {
			ts.dirty = false
			continue
		}
		declared := e.declaredLocked(ts)
		if e.cfg.Protocol == Delta {
			if req := e.deltaSubscriptionLocked(ts); req != nil {
				out = append(out, outbound{delta: req, ev: declared})
			}
		} else {
			out = append(out, outbound{sotw: e.sotwRequestLocked(ts, ts.acked, nil), ev: declared})
		}
	}
	return out
}

// declaredLocked returns the Declared event of the first request of a type
// on a new stream, if the Envoy holds something of it and someone listens.
func (e *Envoy) declaredLocked(ts *typeState) *Event {
	if ts.opened || len(ts.held) == 0 || e.cfg.OnEvent == nil {
		return nil
	}
	ev := &Event{Kind: Declared, TypeURL: ts.url, Version: ts.acked}
	for n, en := range ts.held {
		ev.Names = append(ev.Names, n.Value())
		ev.Generations = append(ev.Generations, en.Value().gen)
	}
	return ev
}

// nodeLocked returns the node for the next request: only the first of a
// stream carries it.
func (e *Envoy) nodeLocked() bool {
	first := !e.firstSent
	e.firstSent = true
	return first
}

// checkNonceLocked records a missing or reused nonce.
func (e *Envoy) checkNonceLocked(typeURL, nonce string) {
	if nonce == "" {
		e.violateLocked(RuleNonce, typeURL, nonce, "response has no nonce")
		return
	}
	h := maphash.String(nonceSeed, nonce)
	if _, dup := e.nonces[h]; dup {
		e.violateLocked(RuleNonce, typeURL, nonce, fmt.Sprintf("nonce %q was already used on this stream", nonce))
		return
	}
	e.nonces[h] = struct{}{}
}

// violateLocked records a violation.
func (e *Envoy) violateLocked(rule Rule, typeURL, nonce, detail string) {
	v := &Violation{Rule: rule, TypeURL: typeURL, Nonce: nonce, Detail: detail, At: time.Now()}
	e.stats.Violations++
	if len(e.violations) < maxViolations {
		e.violations = append(e.violations, v)
	}
	if len(e.vlog) < maxViolations {
		e.vlog = append(e.vlog, v)
	}
}
