package relay

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/adsclient"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// passthrough carries one downstream stream's requests for types the relay
// does not cache (Istio's PCDS and workload health, ambient types, …)
// to the upstream on an upstream stream of its own, presenting the client's
// node (and, in forward mode, its token), and carries the answers back.
// Such answers may depend on the very proxy that asks, so they are never
// shared. Each stream is opened at the upstream's pace
// (Config.Upstream.StreamRate), at most a fifth of it for passthrough
// streams together, so that clients asking for such types cannot hold back
// the keys' own streams; an upstream that refuses the client's
// credentials ends the client's stream with its refusal, as istiod would.
//
// The stream's handler goroutine owns the nonce mapping and calls enqueue and
// forward; the passthrough's own goroutine owns the upstream stream and
// reconnects it with backoff, replaying the subscriptions.
type passthrough struct {
	s      *stream
	cancel context.CancelFunc
	done   chan struct{}
	kick   chan struct{}
	out    chan proto.Message
	// refused carries the upstream's refusal of the client's credentials
	// (Unauthenticated, PermissionDenied): the client's stream ends with
	// it, and the passthrough stops.
	refused chan error

	mu    sync.Mutex
	queue []proto.Message
	// replay state, per type: SotW keeps the latest request, Delta the
	// subscription and the versions the client was given.
	lastSotW   map[string]*discovery.DiscoveryRequest
	deltaSubs  map[string]map[string]bool // name → subscribed; "*" for wildcard
	deltaHeld  map[string]map[string]string
	upstreamOK bool

	// nonces maps relay nonces to the upstream's, per type (handler only).
	nonces map[string][]noncePair
}

type noncePair struct{ relay, upstream string }

const (
	maxPassQueue  = 256
	maxNoncePairs = 8
)

// passOut returns the channel of upstream answers to forward, nil if the
// stream has no passthrough.
func (s *stream) passOut() <-chan proto.Message {
	if s.pass == nil {
		return nil
	}
	return s.pass.out
}

// passRefused returns the channel of the upstream's refusal of the
// client's credentials, nil if the stream has no passthrough.
func (s *stream) passRefused() <-chan error {
	if s.pass == nil {
		return nil
	}
	return s.pass.refused
}

func (s *stream) passthroughSotW(req *discovery.DiscoveryRequest) error {
	p := s.passthroughFor()
	req = proto.Clone(req).(*discovery.DiscoveryRequest)
	req.Node = nil
	req.ResponseNonce = p.upstreamNonce(req.GetTypeUrl(), req.GetResponseNonce())
	p.mu.Lock()
	// Replayed on a new upstream stream as a plain request: no nonce, and
	// not a NACK (an upstream does not answer a NACK, and the client, which
	// waits for an answer, would never ask again).
	replay := proto.Clone(req).(*discovery.DiscoveryRequest)
	replay.ResponseNonce, replay.ErrorDetail = "", nil
	p.lastSotW[req.GetTypeUrl()] = replay
	p.mu.Unlock()
	return p.enqueue(req)
}

func (s *stream) passthroughDelta(req *discovery.DeltaDiscoveryRequest) error {
	p := s.passthroughFor()
	req = proto.Clone(req).(*discovery.DeltaDiscoveryRequest)
	req.Node = nil
	req.ResponseNonce = p.upstreamNonce(req.GetTypeUrl(), req.GetResponseNonce())
	p.mu.Lock()
	subs := p.deltaSubs[req.GetTypeUrl()]
	if subs == nil {
		subs = make(map[string]bool)
		p.deltaSubs[req.GetTypeUrl()] = subs
		if len(req.GetResourceNamesSubscribe()) == 0 {
			subs[xds.WildcardName] = true // legacy wildcard
		}
	}
	for _, n := range req.GetResourceNamesSubscribe() {
		subs[n] = true
	}
	for _, n := range req.GetResourceNamesUnsubscribe() {
		delete(subs, n)
	}
	p.mu.Unlock()
	return p.enqueue(req)
}

func (s *stream) passthroughFor() *passthrough {
	if s.pass != nil {
		return s.pass
	}
	ctx, cancel := context.WithCancel(s.r.ctx)
	p := &passthrough{
		s:         s,
		cancel:    cancel,
		done:      make(chan struct{}),
		kick:      make(chan struct{}, 1),
		out:       make(chan proto.Message, 16),
		refused:   make(chan error, 1),
		lastSotW:  make(map[string]*discovery.DiscoveryRequest),
		deltaSubs: make(map[string]map[string]bool),
		deltaHeld: make(map[string]map[string]string),
		nonces:    make(map[string][]noncePair),
	}
	s.pass = p
	s.r.metrics.passthroughStreams.Inc()
	if !s.r.goRun(func(context.Context) { p.run(ctx) }) {
		close(p.done) // stopping: stop finds it ended
	}
	return p
}

// enqueue hands a request to the passthrough goroutine without blocking the
// stream. A client that floods requests faster than the upstream takes them
// loses its own stream, nobody else's.
func (p *passthrough) enqueue(m proto.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.queue) >= maxPassQueue {
		return status.Errorf(codes.ResourceExhausted, "more than %d passthrough requests waiting for the upstream", maxPassQueue)
	}
	p.queue = append(p.queue, m)
	wake(p.kick)
	return nil
}

// upstreamNonce translates the nonce of a downstream request into the
// upstream's. An unknown nonce becomes one the upstream cannot mistake for
// its own, so the upstream treats the request as stale, as the client meant.
func (p *passthrough) upstreamNonce(typeURL, relayNonce string) string {
	if relayNonce == "" {
		return ""
	}
	for _, np := range p.nonces[typeURL] {
		if np.relay == relayNonce {
			return np.upstream
		}
	}
	return "meshrelay-stale-" + relayNonce
}

// forward sends an upstream answer to the client under a relay nonce.
func (s *stream) forward(m proto.Message) error {
	p := s.pass
	nonce := s.nextNonce()
	var typeURL, upstream string
	switch resp := m.(type) {
	case *discovery.DiscoveryResponse:
		typeURL, upstream = resp.GetTypeUrl(), resp.GetNonce()
		resp.Nonce, resp.ControlPlane = nonce, s.r.controlPlane
	case *discovery.DeltaDiscoveryResponse:
		typeURL, upstream = resp.GetTypeUrl(), resp.GetNonce()
		resp.Nonce, resp.ControlPlane = nonce, s.r.controlPlane
		p.mu.Lock()
		held := p.deltaHeld[typeURL]
		if held == nil {
			held = make(map[string]string)
			p.deltaHeld[typeURL] = held
		}
		for _, r := range resp.GetResources() {
			held[r.GetName()] = r.GetVersion()
		}
		for _, n := range resp.GetRemovedResources() {
			delete(held, n)
		}
		p.mu.Unlock()
	}
	pairs := append(p.nonces[typeURL], noncePair{relay: nonce, upstream: upstream})
	if len(pairs) > maxNoncePairs {
		pairs = pairs[len(pairs)-maxNoncePairs:]
	}
	p.nonces[typeURL] = pairs
	s.r.metrics.passthrough.WithLabelValues(protocolName(s.delta)).Inc()
	return s.sendRaw(m)
}

func (p *passthrough) stop() {
	p.cancel()
	<-p.done
	p.s.r.metrics.passthroughStreams.Dec()
}

// run owns the upstream stream: it connects, replays the subscriptions,
// sends queued requests and receives answers, and reconnects with backoff.
func (p *passthrough) run(ctx context.Context) {
	defer close(p.done)
	bo := p.s.r.newBackoff()
	for ctx.Err() == nil {
		err := p.session(ctx)
		if ctx.Err() != nil {
			return
		}
		if c := status.Code(err); c == codes.Unauthenticated || c == codes.PermissionDenied {
			// Retrying would be refused again, as often as the backoff
			// allows: the client hears it instead.
			p.s.log.Info("upstream refused a passthrough stream", "code", c, "err", status.Convert(err).Message())
			p.refused <- status.Errorf(c, "the upstream refused this stream's own upstream stream (for types the relay does not aggregate): %s", status.Convert(err).Message())
			return
		}
		d := bo.next()
		p.s.log.Debug("passthrough stream failed", "err", err, "retry_in", d)
		if !sleepCtx(ctx, d) {
			return
		}
	}
}

// session runs one upstream stream until it fails or ctx ends.
func (p *passthrough) session(ctx context.Context) error {
	r := p.s.r
	for _, l := range []*rate.Limiter{r.passRate, r.upstreamRate} {
		if l != nil {
			if err := l.Wait(ctx); err != nil {
				return err
			}
		}
	}
	if r.cfg.Upstream.ForwardCredentials {
		// The content is this client's: it presents its own token, as it
		// would to istiod. Without one istiod refuses, and so does this.
		ctx = withCredential(ctx, p.s.cred)
	}
	up, err := adsclient.Open(ctx, r.upConn, adsclient.Config{
		Delta: p.s.delta, Decoded: true, Node: p.s.node,
		CallOptions: []grpc.CallOption{grpc.WaitForReady(false)},
	})
	if err != nil {
		return err
	}
	defer up.Close()
	// Replay what the client subscribed to (the stream puts the node on
	// the first request); then the queue holds only what came after.
	p.mu.Lock()
	send := p.replayLocked()
	p.queue = nil
	p.mu.Unlock()
	// An answer waits in pending until the client's stream takes it;
	// meanwhile the client's requests still go up.
	var (
		pending proto.Message
		out     chan<- proto.Message
		in      = up.Responses()
	)
	for {
		for _, m := range send {
			if err := up.Send(m); err != nil {
				return err
			}
		}
		send = nil
		select {
		case m := <-in:
			pending, out, in = whole(m), p.out, nil
		case out <- pending:
			pending, out, in = nil, nil, up.Responses()
		case <-p.kick:
			p.mu.Lock()
			send, p.queue = p.queue, nil
			p.mu.Unlock()
		case err := <-up.Err():
			// An answer read before the end still reaches the client, as
			// every answer the stream read before it did.
			if pending != nil {
				select {
				case p.out <- pending:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return err // the upstream's status: a refusal is heard as one
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// whole is the message a response read whole holds.
func whole(m adsclient.Response) proto.Message {
	switch r := m.(type) {
	case adsclient.SotWResponse:
		return r.DiscoveryResponse
	case adsclient.DeltaResponse:
		return r.DeltaDiscoveryResponse
	}
	panic(fmt.Sprintf("passthrough: a response of type %T, not read whole", m))
}

// replayLocked builds the requests that restore the client's passthrough
// subscriptions on a new upstream stream.
func (p *passthrough) replayLocked() []proto.Message {
	var out []proto.Message
	if !p.s.delta {
		for _, t := range slices.Sorted(maps.Keys(p.lastSotW)) {
			out = append(out, proto.Clone(p.lastSotW[t]))
		}
		return out
	}
	for _, t := range slices.Sorted(maps.Keys(p.deltaSubs)) {
		if len(p.deltaSubs[t]) == 0 {
			// Subscribed to nothing: an empty first subscribe would mean
			// everything (the legacy wildcard).
			continue
		}
		req := &discovery.DeltaDiscoveryRequest{
			TypeUrl:                 t,
			ResourceNamesSubscribe:  slices.Sorted(maps.Keys(p.deltaSubs[t])),
			InitialResourceVersions: maps.Clone(p.deltaHeld[t]),
		}
		out = append(out, req)
	}
	return out
}
