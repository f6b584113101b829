// Package passthrough carries one downstream stream's requests for types
// the relay does not cache (Istio's PCDS and workload health, ambient
// types, …) to the upstream on an upstream stream of its own, presenting
// the client's node (and, in forward mode, its token), and carries the
// answers back. Such answers may depend on the very proxy that asks, so
// they are never shared.
//
// The client's stream handler owns the nonce mapping: it hands requests
// to SotW or Delta and relabels each answer it forwards (Relabel). The
// passthrough's own goroutine (Run) owns the upstream stream, over
// relay/adsclient, and reconnects it with backoff, replaying the
// subscriptions. An upstream that refuses the client's credentials ends
// the passthrough with its refusal (Refused), as istiod would end the
// client's stream.
package passthrough

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/adsclient"
	"github.com/meshrelay/meshrelay/relay/xds"
)

const (
	// maxQueue bounds the requests waiting for the upstream: a client
	// that floods requests faster than the upstream takes them loses its
	// own stream, nobody else's.
	maxQueue = 256
	// maxNoncePairs is how many of its latest nonces a type remembers.
	maxNoncePairs = 8
)

// Config is what one passthrough needs.
type Config struct {
	// Conn is the connection to the upstream. Required.
	Conn *grpc.ClientConn
	// Node is the client's node, presented on each upstream stream.
	Node *core.Node
	// Delta is the client's protocol, and so the upstream stream's.
	Delta bool
	// Paces are waited on, in order, before each upstream stream opens:
	// the upstream's pace, and the passthroughs' share of it (nil ones
	// are skipped).
	Paces []*rate.Limiter
	// StreamContext, if set, makes each upstream stream's context (forward
	// mode puts the client's own credential on it).
	StreamContext func(context.Context) context.Context
	// Backoff returns the wait before the next upstream stream after one
	// failed. Required.
	Backoff func() time.Duration
	// Log is the client stream's logger. Required.
	Log *slog.Logger
}

// Passthrough is one client's passthrough (see the package comment). The
// client's handler calls SotW, Delta and Relabel from one goroutine; Run
// runs on a goroutine of its own.
type Passthrough struct {
	cfg     Config
	ctx     context.Context
	cancel  context.CancelFunc
	done    chan struct{}
	kick    chan struct{}
	out     chan proto.Message
	refused chan error

	mu    sync.Mutex
	ran   bool // Run was called: Stop waits for done
	queue []proto.Message
	// replay state, per type: SotW keeps the latest request, Delta the
	// subscription and the versions the client was given.
	lastSotW  map[string]*discovery.DiscoveryRequest
	deltaSubs map[string]map[string]bool // name → subscribed; "*" for wildcard
	deltaHeld map[string]map[string]string

	// nonces maps relay nonces to the upstream's, per type (handler only).
	nonces map[string][]noncePair
}

type noncePair struct{ relay, upstream string }

// New makes a client's passthrough; its upstream streams live within ctx.
// Start it with Run.
func New(ctx context.Context, cfg Config) *Passthrough {
	ctx, cancel := context.WithCancel(ctx)
	return &Passthrough{
		cfg:       cfg,
		ctx:       ctx,
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
}

// Out carries the upstream's answers, for the client's handler to
// Relabel and send.
func (p *Passthrough) Out() <-chan proto.Message { return p.out }

// Refused carries the upstream's refusal of the client's credentials
// (Unauthenticated, PermissionDenied), worded for the client: its stream
// ends with it. The passthrough has stopped trying.
func (p *Passthrough) Refused() <-chan error { return p.refused }

// SotW passes a client's SotW request up.
func (p *Passthrough) SotW(req *discovery.DiscoveryRequest) error {
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

// Delta passes a client's Delta request up.
func (p *Passthrough) Delta(req *discovery.DeltaDiscoveryRequest) error {
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

// enqueue hands a request to Run without blocking the client's handler.
func (p *Passthrough) enqueue(m proto.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.queue) >= maxQueue {
		return status.Errorf(codes.ResourceExhausted, "more than %d passthrough requests waiting for the upstream", maxQueue)
	}
	p.queue = append(p.queue, m)
	select {
	case p.kick <- struct{}{}:
	default:
	}
	return nil
}

// upstreamNonce translates the nonce of a downstream request into the
// upstream's. An unknown nonce becomes one the upstream cannot mistake for
// its own, so the upstream treats the request as stale, as the client meant.
func (p *Passthrough) upstreamNonce(typeURL, relayNonce string) string {
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

// Relabel gives an answer from Out the relay's nonce and control plane,
// remembering which upstream nonce the relay's stands for and (Delta)
// what the client now holds, which a new upstream stream is told.
func (p *Passthrough) Relabel(m proto.Message, nonce string, cp *core.ControlPlane) {
	var typeURL, upstream string
	switch resp := m.(type) {
	case *discovery.DiscoveryResponse:
		typeURL, upstream = resp.GetTypeUrl(), resp.GetNonce()
		resp.Nonce, resp.ControlPlane = nonce, cp
	case *discovery.DeltaDiscoveryResponse:
		typeURL, upstream = resp.GetTypeUrl(), resp.GetNonce()
		resp.Nonce, resp.ControlPlane = nonce, cp
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
}

// Stop ends Run, if it was called, and waits until it has returned.
func (p *Passthrough) Stop() {
	p.cancel()
	p.mu.Lock()
	ran := p.ran
	p.mu.Unlock()
	if ran {
		<-p.done
	}
}

// Run owns the upstream stream: it connects, replays the subscriptions,
// sends queued requests and receives answers, and reconnects with
// backoff, until Stop, the context New was given ends, or the upstream
// refuses the client's credentials. Call it once.
func (p *Passthrough) Run() {
	p.mu.Lock()
	p.ran = true
	p.mu.Unlock()
	defer close(p.done)
	for p.ctx.Err() == nil {
		err := p.session(p.ctx)
		if p.ctx.Err() != nil {
			return
		}
		if c := status.Code(err); c == codes.Unauthenticated || c == codes.PermissionDenied {
			// Retrying would be refused again, as often as the backoff
			// allows: the client hears it instead.
			p.cfg.Log.Info("upstream refused a passthrough stream", "code", c, "err", status.Convert(err).Message())
			p.refused <- status.Errorf(c, "the upstream refused this stream's own upstream stream (for types the relay does not aggregate): %s", status.Convert(err).Message())
			return
		}
		d := p.cfg.Backoff()
		p.cfg.Log.Debug("passthrough stream failed", "err", err, "retry_in", d)
		t := time.NewTimer(d)
		select {
		case <-p.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// session runs one upstream stream until it fails or ctx ends.
func (p *Passthrough) session(ctx context.Context) error {
	for _, l := range p.cfg.Paces {
		if l != nil {
			if err := l.Wait(ctx); err != nil {
				return err
			}
		}
	}
	if p.cfg.StreamContext != nil {
		ctx = p.cfg.StreamContext(ctx)
	}
	up, err := adsclient.Open(ctx, p.cfg.Conn, adsclient.Config{
		Delta: p.cfg.Delta, Decoded: true, Node: p.cfg.Node,
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
	// An answer waits in pending until the client's handler takes it;
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
func (p *Passthrough) replayLocked() []proto.Message {
	var out []proto.Message
	if !p.cfg.Delta {
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
