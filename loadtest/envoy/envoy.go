// Package envoy is a simulated Envoy: an ADS client (State of the World or
// Delta) that subscribes, ACKs, NACKs and reconnects the way Envoy does, holds
// the resources it receives, and checks the xDS protocol rules as it goes.
//
// It owns one ADS stream per Envoy over a caller-supplied
// grpc.ClientConnInterface (many Envoys may share one connection). Start-up
// follows Envoy: CDS wildcard, EDS for every EDS cluster, LDS wildcard once the
// first CDS response arrived, RDS for every route_config_name the listeners
// name. Subscriptions follow CDS and LDS changes.
//
// Every rule it checks (nonces, type URLs, duplicates, unsubscribed
// resources, generation regressions, make-before-break ordering) is recorded
// as a *Violation, readable with Violations, counted in Stats and logged;
// nothing is dropped silently. Config callbacks (Reject, Generation, OnEvent)
// are called one at a time from the stream goroutine, without locks held.
//
// An Envoy runs two goroutines while connected (the stream owner, which
// applies responses and sends every request, and the receiver, which only
// calls Recv) and one while it waits to reconnect; gRPC adds its own per
// stream. Held resources are interned (package unique) as (version, body,
// hash, references) tuples, so many simulated Envoys holding the same
// configuration share its bytes and each pays a map slot per resource:
// BenchmarkEnvoyMemory measures about 130 KB per idle Envoy holding 1,000
// clusters and their 1,000 load assignments. Versions differ between
// aggregation keys behind a relay (they carry each key's Order), so Envoys
// of different keys share nothing; Config.Light drops the bodies for
// fleets at Istio scale. It is meant for tests, demos and load tests with
// thousands of instances in one process.
package envoy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sort"
	"sync"
	"time"
	"unique"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// Type URLs of the resource types the simulated Envoy follows on its own.
const (
	ClusterType  = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	EndpointType = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
	ListenerType = "type.googleapis.com/envoy.config.listener.v3.Listener"
	RouteType    = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
)

// Protocol selects the ADS variant.
type Protocol int

const (
	// SotW is State of the World ADS (StreamAggregatedResources).
	SotW Protocol = iota
	// Delta is incremental ADS (DeltaAggregatedResources).
	Delta
)

// String returns "sotw" or "delta".
func (p Protocol) String() string {
	switch p {
	case SotW:
		return "sotw"
	case Delta:
		return "delta"
	default:
		return fmt.Sprintf("Protocol(%d)", int(p))
	}
}

// Backoff is the jittered exponential backoff between stream attempts. After
// n consecutive failed attempts (streams that ended without a response) the
// Envoy waits a random duration in [d/2, d), d = min(Max, Base·2^(n-1)); after
// a stream that had delivered responses ends, it waits as for n = 1.
type Backoff struct {
	// Base is the first delay. Default 500ms (Envoy's). Zero is invalid.
	Base time.Duration
	// Max caps the delay. Default 30s (Envoy's). Zero is invalid.
	Max time.Duration
}

// Config configures an Envoy. Build it with DefaultConfig and change fields.
type Config struct {
	// Node is sent on the first request of every stream. Required. It must
	// not be modified after New.
	Node *core.Node
	// Protocol selects SotW or Delta. Default SotW (the zero value).
	Protocol Protocol
	// Conn carries the ADS stream. Required. Several Envoys may share it;
	// the caller owns and closes it.
	Conn grpc.ClientConnInterface
	// Metadata is sent with every stream the Envoy opens, added to what
	// the context carries: "authorization: Bearer <token>" is how
	// istio-agent presents the pod's service-account token on istiod's TLS
	// port. Default nil: none. It must not be modified after New.
	Metadata metadata.MD
	// Reject, if set, is asked about every response's resources before they
	// are applied; a non-nil error NACKs the response and keeps the previous
	// state. Called from the stream goroutine, without locks held. Nil
	// accepts everything (resources that fail to decode are always NACKed).
	Reject func(typeURL string, resources []*anypb.Any) error
	// NoACK makes the Envoy never ACK nor NACK (it still applies responses
	// and still sends subscription changes). Default false.
	NoACK bool
	// ReadDelay is waited before every Recv, to simulate a slow reader.
	// Default 0: read at once. See also Pause.
	ReadDelay time.Duration
	// Generation, if set, extracts a monotonic generation from a decoded
	// resource (ok false: none). A resource arriving with a lower generation
	// than one already seen for its name is a violation. Called from the
	// stream goroutine, without locks held. Nil disables the check.
	Generation func(proto.Message) (uint64, bool)
	// OnEvent, if set, is called for every response received, ACK or NACK
	// sent and resource removed, in order, from the stream goroutine, without
	// locks held. It must be cheap and must not block. Nil: no events.
	OnEvent func(Event)
	// Backoff paces reconnection. Default {500ms, 30s}.
	Backoff Backoff
	// Rand, if set, is where the backoff's jitter is drawn from, so that a
	// simulation replays a seed; only the Envoy's stream goroutine uses
	// it, so each Envoy needs its own. Default nil: math/rand/v2's global
	// source.
	Rand *rand.Rand
	// UnsubscribeGrace is how many responses of a type may still carry a
	// name after the request that unsubscribed it was sent (responses that
	// crossed it on the wire). Default 1, right for servers that answer one
	// request at a time, like go-control-plane; raise it for servers that
	// push several responses without waiting for ACKs. Zero: none.
	UnsubscribeGrace int
	// MaxRecvMsgSize is the largest response accepted, in bytes. Default
	// 128 MiB (Envoy accepts large responses; gRPC's own default is 4 MiB).
	// Zero is invalid.
	MaxRecvMsgSize int
	// Light, if set, keeps of each held resource only what the Envoy's own
	// checks read: its name, version, content hash (Held.Hash), generation,
	// and the names it refers to (a cluster's EDS service name, a
	// listener's route configurations and clusters, a route
	// configuration's clusters). Its body is dropped once the response is
	// applied, so Held.Resource is nil. Every protocol check works as
	// without it; what it saves is memory: a fleet of thousands at Istio
	// scale (30,000 clusters and their load assignments each) fits on one
	// machine. Default false: bodies are kept.
	Light bool
	// DecodeCache, if set, is shared by the Envoys of a fleet: each
	// resource content is decoded once (see DecodeCache). They must have
	// the same Generation. Default nil: every resource is decoded.
	DecodeCache *DecodeCache
	// Logger receives connection and violation logs. Default: discard.
	Logger *slog.Logger
}

// DefaultConfig returns a Config with every default filled in; Node and Conn
// must still be set.
func DefaultConfig() Config {
	return Config{
		Protocol:         SotW,
		Backoff:          Backoff{Base: 500 * time.Millisecond, Max: 30 * time.Second},
		UnsubscribeGrace: 1,
		MaxRecvMsgSize:   128 << 20,
		Logger:           slog.New(slog.DiscardHandler),
	}
}

// Held is one resource held by an Envoy.
type Held struct {
	// Version is the resource's version: the response's version_info in
	// SotW, the resource's own version in Delta.
	Version string
	// Resource is a copy of the resource as received; nil with
	// Config.Light.
	Resource *anypb.Any
	// Hash is the xxhash64 of the resource's bytes (its anypb.Any value),
	// in both modes: equal hashes, equal content.
	Hash uint64
	// Generation is what Config.Generation returned for it (0 if unset).
	Generation uint64
}

// Stats are counters of one Envoy since New.
type Stats struct {
	// Responses is the number of responses received.
	Responses uint64
	// ACKs and NACKs are the number of ACKs and NACKs sent.
	ACKs, NACKs uint64
	// BytesReceived is the sum of proto.Size of the responses received.
	BytesReceived uint64
	// Reconnects is the number of streams opened after the first one.
	Reconnects uint64
	// Violations is the number of protocol violations recorded (including
	// those beyond the ones Violations keeps).
	Violations uint64
	// Connected is true while a stream is open.
	Connected bool
	// LastErr is why the last stream ended, or could not open (a refused
	// stream's gRPC status: status.Code reads it); nil before any ended.
	LastErr error
}

// ErrStopped is returned by WaitFor when the Envoy stops before the condition
// holds, and by Start after Stop.
var ErrStopped = errors.New("envoy: stopped")

// maxViolations bounds how many violations an Envoy keeps.
const maxViolations = 256

// Envoy is a simulated Envoy. Its methods are safe for concurrent use. Whoever
// calls Start must call Stop.
type Envoy struct {
	cfg Config
	log *slog.Logger

	stopOnce sync.Once
	cancel   context.CancelFunc
	done     chan struct{}
	kick     chan struct{} // cap 1: state changed, flush requests

	mu         sync.Mutex
	started    bool
	stopped    bool
	types      map[string]*typeState
	order      []*typeState // types in request order
	ldsArmed   bool         // the first CDS response arrived: LDS is subscribed
	stats      Stats
	violations []error
	cp         string        // last control_plane.identifier
	resume     chan struct{} // non-nil while paused; closed by Resume
	waitCh     chan struct{} // non-nil while someone waits; closed on change
	streams    int           // streams opened
	firstSent  bool          // the node went out on this stream
	nonces     map[uint64]struct{}
	vlog       []*Violation // violations not yet logged
}

// New validates cfg and returns an Envoy that is not yet running.
func New(cfg Config) (*Envoy, error) {
	switch {
	case cfg.Node == nil:
		return nil, errors.New("envoy: field Node is required")
	case cfg.Node.GetId() == "":
		return nil, errors.New("envoy: field Node has an empty id")
	case cfg.Conn == nil:
		return nil, errors.New("envoy: field Conn is required")
	case cfg.Protocol != SotW && cfg.Protocol != Delta:
		return nil, fmt.Errorf("envoy: field Protocol %d is unknown", int(cfg.Protocol))
	case cfg.Backoff.Base <= 0 || cfg.Backoff.Max < cfg.Backoff.Base:
		return nil, fmt.Errorf("envoy: field Backoff %+v needs 0 < Base <= Max", cfg.Backoff)
	case cfg.ReadDelay < 0:
		return nil, fmt.Errorf("envoy: field ReadDelay %v is negative", cfg.ReadDelay)
	case cfg.UnsubscribeGrace < 0 || cfg.UnsubscribeGrace > 100:
		return nil, fmt.Errorf("envoy: field UnsubscribeGrace %d is outside [0, 100]", cfg.UnsubscribeGrace)
	case cfg.MaxRecvMsgSize <= 0:
		return nil, fmt.Errorf("envoy: field MaxRecvMsgSize %d must be positive", cfg.MaxRecvMsgSize)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	e := &Envoy{
		cfg:   cfg,
		log:   cfg.Logger.With("node", cfg.Node.GetId()),
		done:  make(chan struct{}),
		kick:  make(chan struct{}, 1),
		types: make(map[string]*typeState),
	}
	cds := e.typeLocked(ClusterType)
	cds.wildcard = true
	return e, nil
}

// Start opens the ADS stream in the background and returns at once. The
// Envoy runs until Stop is called or ctx is cancelled; either way the caller
// must call Stop to wait for its goroutines.
func (e *Envoy) Start(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stopped {
		return ErrStopped
	}
	if e.started {
		return errors.New("envoy: already started")
	}
	e.started = true
	ctx, e.cancel = context.WithCancel(ctx)
	go e.run(ctx)
	return nil
}

// Stop stops the Envoy and returns once its goroutines have exited, or
// ctx's error if ctx ends first. It is idempotent. Held state stays readable.
func (e *Envoy) Stop(ctx context.Context) error {
	e.mu.Lock()
	started := e.started
	e.stopped = true
	cancel := e.cancel
	e.mu.Unlock()
	if !started {
		e.stopOnce.Do(func() {
			close(e.done)
			e.mu.Lock()
			e.notifyLocked()
			e.mu.Unlock()
		})
		return nil
	}
	cancel()
	select {
	case <-e.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("envoy: stop: %w", ctx.Err())
	}
}

// Subscribe adds names to the subscription of typeURL (any type, including
// ones the Envoy does not understand) and sends the change. The name "*"
// subscribes to the wildcard. A name already subscribed is named again in
// Delta's resource_names_subscribe (a client that forgot a resource asks for
// it again this way).
func (e *Envoy) Subscribe(typeURL string, names []string) {
	e.mu.Lock()
	ts := e.typeLocked(typeURL)
	for _, n := range names {
		h := unique.Make(n)
		if n == wildcardName {
			ts.wildcard = true
			ts.starSent = true // say "*" explicitly from now on
		} else {
			if ts.user == nil {
				ts.user = make(map[name]struct{})
			}
			ts.user[h] = struct{}{}
			ts.subscribeLocked(h)
		}
		e.queueLocked(ts, h, true)
	}
	ts.dirty = true
	e.notifyLocked()
	e.mu.Unlock()
	e.poke()
}

// Unsubscribe removes names from the subscription of typeURL, drops the
// resources held under them (without Removed events: the caller knows) and
// sends the change. The name "*" leaves the wildcard. A name derived from CDS
// or LDS comes back with the next change of those.
func (e *Envoy) Unsubscribe(typeURL string, names []string) {
	e.mu.Lock()
	ts := e.typeLocked(typeURL)
	for _, n := range names {
		h := unique.Make(n)
		if n == wildcardName {
			ts.wildcard = false
		} else {
			delete(ts.user, h)
			ts.unsubscribeLocked(h, e.cfg.UnsubscribeGrace)
		}
		e.queueLocked(ts, h, false)
	}
	ts.dirty = true
	e.notifyLocked()
	e.mu.Unlock()
	e.poke()
}

// Forget drops a held resource locally without telling the server, as an
// Envoy that lost a resource would (Envoy #22418). The subscription is kept;
// a Delta reconnect no longer lists the name in initial_resource_versions.
func (e *Envoy) Forget(typeURL, resourceName string) {
	e.mu.Lock()
	if ts := e.types[typeURL]; ts != nil {
		n := unique.Make(resourceName)
		delete(ts.held, n)
		e.notifyLocked()
	}
	e.mu.Unlock()
}

// Pause stops reading from the stream (the receiver stops calling Recv), so
// flow control pushes back on the server. Resume undoes it.
func (e *Envoy) Pause() {
	e.mu.Lock()
	if e.resume == nil {
		e.resume = make(chan struct{})
	}
	e.mu.Unlock()
}

// Resume resumes reading after Pause.
func (e *Envoy) Resume() {
	e.mu.Lock()
	if e.resume != nil {
		close(e.resume)
		e.resume = nil
	}
	e.mu.Unlock()
}

// ID returns the node id.
func (e *Envoy) ID() string { return e.cfg.Node.GetId() }

// Resources returns a copy of the resources of typeURL held now, by name.
func (e *Envoy) Resources(typeURL string) map[string]Held {
	e.mu.Lock()
	defer e.mu.Unlock()
	ts := e.types[typeURL]
	if ts == nil {
		return map[string]Held{}
	}
	out := make(map[string]Held, len(ts.held))
	for n, en := range ts.held {
		out[n.Value()] = ts.export(en)
	}
	return out
}

// Version returns the version of the last ACKed response of typeURL: its
// version_info in SotW, its system_version_info in Delta ("" if none).
func (e *Envoy) Version(typeURL string) string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if ts := e.types[typeURL]; ts != nil {
		return ts.acked
	}
	return ""
}

// Subscribed returns the sorted names of typeURL the Envoy is subscribed to
// (not including the wildcard).
func (e *Envoy) Subscribed(typeURL string) []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if ts := e.types[typeURL]; ts != nil {
		return sortedNames(ts.subs)
	}
	return nil
}

// ControlPlane returns the control_plane.identifier of the last response that
// carried one.
func (e *Envoy) ControlPlane() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cp
}

// Stats returns the counters.
func (e *Envoy) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stats
}

// Violations returns the protocol violations recorded so far (the first 256),
// each a *Violation.
func (e *Envoy) Violations() []error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]error(nil), e.violations...)
}

// View is a read-only view of an Envoy, given to WaitFor conditions. Each
// method reads the current state on its own.
type View struct{ e *Envoy }

// Has reports whether a resource is held.
func (v View) Has(typeURL, resourceName string) bool {
	_, ok := v.Get(typeURL, resourceName)
	return ok
}

// Get returns a held resource.
func (v View) Get(typeURL, resourceName string) (Held, bool) {
	v.e.mu.Lock()
	defer v.e.mu.Unlock()
	ts := v.e.types[typeURL]
	if ts == nil {
		return Held{}, false
	}
	en, ok := ts.held[unique.Make(resourceName)]
	if !ok {
		return Held{}, false
	}
	return ts.export(en), true
}

// Len returns how many resources of typeURL are held.
func (v View) Len(typeURL string) int {
	v.e.mu.Lock()
	defer v.e.mu.Unlock()
	if ts := v.e.types[typeURL]; ts != nil {
		return len(ts.held)
	}
	return 0
}

// Version is Envoy.Version.
func (v View) Version(typeURL string) string { return v.e.Version(typeURL) }

// Stats is Envoy.Stats.
func (v View) Stats() Stats { return v.e.Stats() }

// Resources is Envoy.Resources.
func (v View) Resources(typeURL string) map[string]Held { return v.e.Resources(typeURL) }

// WaitFor blocks until cond holds, ctx ends (its error is returned, wrapped)
// or the Envoy stops (ErrStopped). cond is evaluated now and after every
// change of state or counters, without locks held.
func (e *Envoy) WaitFor(ctx context.Context, cond func(View) bool) error {
	for {
		e.mu.Lock()
		if e.waitCh == nil {
			e.waitCh = make(chan struct{})
		}
		ch := e.waitCh
		e.mu.Unlock()
		if cond(View{e}) {
			return nil
		}
		select {
		case <-ch:
		case <-e.done:
			if cond(View{e}) {
				return nil
			}
			return ErrStopped
		case <-ctx.Done():
			return fmt.Errorf("envoy %s: wait: %w", e.ID(), ctx.Err())
		}
	}
}

// notifyLocked wakes WaitFor callers.
func (e *Envoy) notifyLocked() {
	if e.waitCh != nil {
		close(e.waitCh)
		e.waitCh = nil
	}
}

// poke asks the stream goroutine to flush pending requests.
func (e *Envoy) poke() {
	select {
	case e.kick <- struct{}{}:
	default:
	}
}

func sortedNames(set map[name]struct{}) []string {
	if len(set) == 0 {
		return nil
	}
	out := make([]string, 0, len(set))
	for n := range set {
		out = append(out, n.Value())
	}
	sort.Strings(out)
	return out
}
