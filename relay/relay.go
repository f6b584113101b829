// Package relay is meshrelay's xDS data path: the downstream ADS server
// (SotW and Delta) that Envoys connect to, the upstream ADS client that
// subscribes to istiod once per aggregation key, and the content-addressed
// resource cache between them.
//
// A Relay serves every Envoy from its cache. For each aggregation key (a
// class of proxies that get identical config) it holds one upstream stream,
// presenting one live member's node, and keeps the key's views: per type, a
// Merkle tree (ledger.Tree) of name → resource. Resources are stored once
// and shared by every key and stream. Each downstream stream keeps the tree
// its client holds and, when the key's view changes, sends what differs, in
// make-before-break order. Versions are Merkle roots, so any relay recognises
// a client that already holds the current content.
//
// The downstream server is the relay's own rather than go-control-plane's:
// that server leaves ordering, ACK tracking, NACK parking and
// initial_resource_versions to a cache behind a watch interface and has no
// place to pass unknown types through per stream, which is most of what a
// relay must get right. go-control-plane provides the protos, the resource
// type URLs, and (in loadtest) the upstream.
//
// # Layout
//
// The parts that stand alone are packages below this one; each imports
// only those listed after it, and none imports relay:
//
//	relay/divergence whether a key's members get the same config: the check's
//	                 schedule per key, its second stream compared by content
//	relay/snapshot   views persisted in etcd for a warm start (implements Snapshots)
//	relay/warm       persisted views rebuilt, checked and shared, for a warm start
//	relay/views      a key's published views, immutable, one per type: the
//	                 seam where the key's feed writes and its streams read
//	relay/admission  whether a new stream may start and what it may cost, fairly
//	                 by identity: the admission rate, the streams served, failing
//	                 credentials, the bytes of large requests decoded at once
//	relay/admin      the admin listener: who a call is from (token, JWT, certificate),
//	                 its HTTP/gRPC handler, its health service
//	relay/passthrough  a client's own upstream stream for the types the relay
//	                   does not cache: its nonces mapped, its subscriptions replayed
//	relay/adsclient  the ADS client: one SotW or Delta stream to a control plane,
//	                 its nonces, ACKs and NACKs, and its bounded request queue
//	relay/wire       the bytes on the wire: the gRPC codec, responses encoded once
//	                 per content, SotW requests read lazily, the version form
//	relay/aggkey     aggregation keys: profiles, a stream's identity mixed in, a
//	                 key's namespace
//	relay/peers      talking to the other relays: the metadata and proof of
//	                 relay-to-relay streams, the connection pool, Gather
//	relay/auth       who a stream is: SPIFFE certificates, Kubernetes JWTs,
//	                 istiod's identity rule (relay/auth/authtest for tests)
//	relay/xds        the xDS vocabulary: type URLs and the type graph, resources
//	                 and their store, name sets, the persisted form of views
//	relay/metrics    the relay's Prometheus metrics, and the totals Stats reads
//	relay/configdump views laid out as Envoy's /config_dump, redacted
//	relay/redact     what a config dump must not show
//	relay/tlsfiles   certificates and keys read again when rotated
//	relay/inspectpb  what one relay tells another of a key, a node, a version
//	relay/xdstypes   every Envoy and Istio type, linked into the binary alone
//
// This package holds what is still one piece. Its files, by the layer
// each is to become (arrows_test.go's layerOfFile; TestCoreArrows counts
// the ties that still run up from one layer to a higher one):
//
//   - a key's cache and its feed: keycache.go (the keys, and what they
//     share; what they ask of the relay, they ask through its keyHost),
//     keyconfig.go (what configures them: Upstream, Keys, the tier's
//     Owners), aggregation.go (which key a stream joins, the keys held),
//     keystate.go (its views, subscriptions and members: the streams joined
//     to it, which it knows only as its member interface; its divergence
//     check's schedule), versions.go (whether a view covers what a client
//     holds; the lookups, one per key and question, of the versions SotW
//     clients claim), feed.go (the one stream to the key's source, istiod or
//     the owner relay, over relay/adsclient), session.go (one such stream,
//     once open: what it waits for and does with each), feedsource.go (the
//     kinds of source), backoff.go (its backoff, and the random draws a
//     simulation replays), firstanswers.go (when its first answers give the
//     sync slot back and confirm the views), feedrequests.go (what it asks),
//     feedanswers.go (what it does with the answers), forward.go
//     (credentials presented upstream), persist.go (saving views, and the
//     restore a warm start installs keys with) and splits.go (the splits the
//     tier knows, and the key a node belongs to under them);
//   - the downstream server: server.go (the streams, and what they share;
//     what it asks of the tier, it asks through its serverHost), stream.go
//     (one ADS stream: its subscriptions, ACKs and NACKs), push.go (what a
//     sync sends, in xDS order), holds.go (what a push keeps back:
//     make-before-break), sotw.go, delta.go, mailbox.go (a client's
//     requests, read while its responses are written), passthrough.go
//     (starting a stream's relay/passthrough), identity.go and admission.go
//     (who a stream is, whether it may start), rekey.go (the streams a split
//     moves), xdsconfig.go (what configures it: XDS, its Authorizer and
//     Authenticator, its ports);
//   - the tier and inspection: tier.go (owners, who a calling relay is,
//     balancing, moving streams away), checks.go (divergence checks run:
//     asking owners, the splits found), claims.go (versions a SotW Envoy
//     claims: one lookup per key and question, run by relay/claims; the
//     answer to other relays; the hand-over of a drained Envoy's),
//     ledger.go (this relay's ledger served to the tier; the tier's is
//     gathered by relay/tierledger), inspect.go (stats, clients, key
//     details, config dumps), debugxds.go (istiod's debug types asked
//     on a stream, answered by relay/istiodebug);
//   - the Relay that assembles them: relay.go, config.go (one config per
//     part), metrics.go (its keys and cache as metrics), ports.go,
//     insecure.go (what leaves it open, said every minute).
package relay

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/pprof"
	"sync"
	"sync/atomic"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/admin"
	"github.com/meshrelay/meshrelay/relay/admission"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/claims"
	"github.com/meshrelay/meshrelay/relay/metrics"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/tierledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Relay is one meshrelay process's xDS relay. Create it with New, then Start;
// Stop it when done. Its methods are safe for concurrent use.
type Relay struct {
	cfg Config
	// insecure lists what leaves the relay open (insecure.go). Under mu.
	insecure []string
	log      *slog.Logger
	rand     *rand.Rand // Config.Rand, serialised; nil: the global source
	store    *xds.Store
	// cache is the relay's keys, and what they share (keycache.go); srv
	// its downstream server (server.go), whose streams join the keys.
	cache   *keyCache
	srv     *server
	metrics *metrics.Metrics
	ledger  *ledger.Tracker

	upConn     *grpc.ClientConn
	servers    []*grpc.Server // xDS servers: plaintext, TLS
	lis        net.Listener   // plaintext xDS; nil if none
	tlsLis     net.Listener   // TLS xDS; nil if none
	peerLis    net.Listener   // the tier's relays; nil if none
	tracker    *connTracker
	adminHTTP  *http.Server
	adminGRPC  *grpc.Server
	adminGuard *admin.Guard // who admin calls, and debug requests over xDS, are from
	adminLis   net.Listener

	ctx      context.Context // feeds' context
	cancel   context.CancelFunc
	stopping chan struct{} // closed by Stop: streams end (server.stopping)
	wg       sync.WaitGroup

	handed         sync.Map      // heldID → time.Time: versions handed over (handOver)
	handedN        atomic.Uint64 // counts handing's notes, to prune handed now and then
	handOverFailed atomic.Int64  // UnixNano of handOver's last failure (0: none)

	pool     *peers.Pool          // relay-to-relay connections
	claims   *claims.Lookup       // asks the tier and the store what a SotW client's version held
	gatherer *tierledger.Gatherer // the tier's ledger, and other answers gathered from every relay

	checkSlots syncSlots // one token per divergence check running

	// runMu guards refuseWork: set as Stop begins, goRun starts nothing
	// after it.
	runMu      sync.Mutex
	refuseWork bool

	mu      sync.Mutex
	state   lifecycle
	serveWG sync.WaitGroup
}

// newRand serialises src; nil stays nil (the global source).
func newRand(src rand.Source) *rand.Rand {
	if src == nil {
		return nil
	}
	return rand.New(&lockedSource{src: src})
}

// New validates cfg and builds a Relay. Nothing runs until Start.
func New(cfg Config) (*Relay, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger.With("relay", cfg.ID)
	store, clock, rnd := xds.NewStore(), ledger.NewClock(cfg.wall), newRand(cfg.Rand)
	pool := peers.NewPool(cfg.MaxMsgSize, cfg.Tier.DialOptions...)
	r := &Relay{
		cfg:        cfg,
		log:        log,
		store:      store,
		stopping:   make(chan struct{}),
		pool:       pool,
		rand:       rnd,
		checkSlots: newSyncSlots(maxDivergenceChecks),
	}
	r.cache = &keyCache{
		cfg: keyConfig{
			Upstream:            cfg.Upstream,
			Keys:                cfg.Keys,
			History:             cfg.History,
			Owners:              cfg.Tier.Owners,
			ResourceWaitTimeout: cfg.XDS.ResourceWaitTimeout,
		},
		host:           keyHost{goRun: r.goRun, peerContext: r.peerContext}, // and markWarm, the server's, below
		log:            log,
		store:          store,
		dropped:        xds.NewDropped(cfg.Keys.KeepDroppedBytes),
		views:          new(ledger.Interner[*xds.Resource]),
		versionTrees:   new(ledger.Interner[string]),
		nameSets:       new(xds.NameSets),
		clock:          clock,
		rand:           rnd,
		pool:           pool,
		syncs:          newSyncSlots(cfg.Upstream.Syncs),
		peerSyncs:      newSyncSlots(cfg.Upstream.Syncs),
		divergenceWake: make(chan struct{}, 1),
		loaded:         make(chan struct{}),
		keys:           make(map[aggkey.Key]*keyState),
	}
	controlPlane := &core.ControlPlane{Identifier: cfg.ID}
	r.srv = &server{
		cfg:              serverConfig{XDS: cfg.XDS, ForwardCredentials: cfg.Upstream.ForwardCredentials},
		host:             serverHost{goRun: r.goRun, identifyPeer: r.identifyPeer, checkPort: r.checkPort, askTier: r.askTier, answerDebugSotW: r.answerDebugSotW, answerDebugDelta: r.answerDebugDelta},
		cache:            r.cache,
		log:              log,
		store:            store,
		clock:            clock,
		controlPlane:     controlPlane,
		controlPlaneWire: mustMarshal(controlPlane),
		authLogs:         newAuthLogLimiter(),
		failures:         admission.NewFailureGate(),
		budget:           admission.NewBudget(cfg.XDS.RequestBudgetBytes),
		shares:           admission.NewShares[*stream](cfg.XDS.MaxStreams),
		warm:             make(chan struct{}),
		stopping:         r.stopping,
		attached:         make(map[*stream]joinedKey),
	}
	r.cache.host.markWarm = r.srv.markWarm
	r.adminGuard = &admin.Guard{Token: cfg.Admin.Token, Identities: cfg.Admin.Identities, XDSAuthenticated: cfg.XDS.Authenticator != nil, Refuse: r.srv.refuseAuth}
	if cfg.Admin.Authenticator != nil {
		r.adminGuard.Authenticator = cfg.Admin.Authenticator
	}
	if cfg.XDS.AdmitRate > 0 {
		r.srv.admission = admission.NewFair(cfg.XDS.AdmitRate, cfg.XDS.AdmitBurst, cfg.XDS.AdmitWait)
	}
	if cfg.Upstream.StreamRate > 0 {
		r.cache.upstreamRate = rate.NewLimiter(rate.Limit(cfg.Upstream.StreamRate), max(1, int(cfg.Upstream.StreamRate)))
		r.srv.passRate = rate.NewLimiter(rate.Limit(cfg.Upstream.StreamRate/5), max(1, int(cfg.Upstream.StreamRate/5)))
	}
	m, err := newMetrics(cfg.Registerer, r)
	if err != nil {
		return nil, fmt.Errorf("relay: register metrics: %w", err)
	}
	r.metrics = m
	tcfg := ledger.DefaultTrackerConfig()
	tcfg.Relay, tcfg.ForgetAfter = cfg.ID, cfg.ForgetEnvoysAfter
	tcfg.Converged = func(typeURL string, d time.Duration) {
		m.ForType(typeURL).Converged.Observe(d.Seconds())
	}
	if r.ledger, err = ledger.NewTracker(tcfg); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	r.cache.metrics, r.cache.ledger = m, r.ledger
	r.srv.metrics, r.srv.ledger = m, r.ledger
	if r.gatherer, err = r.newGatherer(); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	if r.claims, err = r.newClaimLookup(); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	return r, nil
}

// Start listens, connects to the upstream, and serves. It does not block.
func (r *Relay) Start(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state != lifeNew {
		return fmt.Errorf("relay: Start called on a relay that is %s", r.state)
	}
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(r.cfg.MaxMsgSize), grpc.MaxCallSendMsgSize(r.cfg.MaxMsgSize)),
		// One connection carries every key's stream: a missed ping answer
		// from a busy upstream must not make them all reconnect at once.
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: time.Minute, Timeout: 20 * time.Second, PermitWithoutStream: true}),
	}, r.cfg.Upstream.DialOptions...)
	conn, err := grpc.NewClient(r.cfg.Upstream.Addr, opts...)
	if err != nil {
		return fmt.Errorf("relay: upstream %s: %w", r.cfg.Upstream.Addr, err)
	}
	lis, tlsLis, peerLis, err := r.listen()
	if err != nil {
		conn.Close()
		return err
	}
	if r.cfg.Admin.Listener != nil {
		r.adminLis = r.cfg.Admin.Listener
	} else if r.cfg.Admin.Listen != "" {
		r.adminLis, err = net.Listen("tcp", r.cfg.Admin.Listen)
		if err != nil {
			conn.Close()
			closeAll(lis, tlsLis, peerLis)
			return fmt.Errorf("relay: admin listen %s: %w", r.cfg.Admin.Listen, err)
		}
	}
	r.tracker = newConnTracker()
	r.upConn, r.lis, r.tlsLis, r.peerLis = conn, lis, tlsLis, peerLis
	r.ctx, r.cancel = context.WithCancel(context.WithoutCancel(ctx))
	r.cache.start(conn)
	r.srv.start(r.ctx, conn)
	if r.cfg.Keys.Snapshots != nil {
		r.goRun(r.cache.loadSnapshots)
	} else {
		close(r.cache.loaded)
	}
	r.goRun(r.cache.watchWarm)
	if r.srv.admission != nil {
		r.goRun(r.srv.admission.Run)
	}
	r.goRun(r.pruneConns)
	if r.cfg.Tier.Owners != nil {
		r.goRun(r.watchOwners)
	}
	if r.cfg.Tier.Balancer != nil {
		r.goRun(r.balance)
	}
	if r.cfg.Upstream.ForwardCredentials {
		r.goRun(r.refreshCredentials)
	}
	if r.cfg.Keys.AggregationWarnInterval > 0 {
		r.goRun(r.cache.warnUnaggregated)
	}
	if r.cfg.Keys.DivergenceInterval > 0 {
		r.goRun(r.checkDivergence)
	}
	if lis != nil {
		r.serveXDS(lis, portPlain)
	}
	if tlsLis != nil {
		// gRPC's TLS credentials insist on ALPN h2 and add it.
		r.serveXDS(tlsLis, portTLS, grpc.Creds(credentials.NewTLS(r.cfg.XDS.TLS.Clone())), grpc.ConnectionTimeout(r.cfg.XDS.HandshakeTimeout))
	}
	if peerLis != nil {
		var opts []grpc.ServerOption
		if r.cfg.Tier.TLS != nil {
			opts = append(opts, grpc.Creds(credentials.NewTLS(r.cfg.Tier.TLS.Clone())), grpc.ConnectionTimeout(r.cfg.XDS.HandshakeTimeout))
		}
		r.serveXDS(peerLis, portPeer, opts...)
	}
	if r.adminLis != nil {
		r.adminGRPC = r.newAdminGRPC()
		r.adminHTTP = &http.Server{Handler: admin.Handler(r.adminGRPC, r.adminMux()), ReadHeaderTimeout: 10 * time.Second, Protocols: admin.Protocols()}
		adminLis := r.adminLis
		if r.cfg.Admin.TLS != nil {
			tc := r.cfg.Admin.TLS.Clone()
			if len(tc.NextProtos) == 0 {
				tc.NextProtos = []string{"h2", "http/1.1"}
			}
			adminLis = tls.NewListener(adminLis, tc)
		}
		r.serveWG.Add(1)
		go func() {
			defer r.serveWG.Done()
			if err := r.adminHTTP.Serve(adminLis); err != nil && !errors.Is(err, http.ErrServerClosed) {
				r.log.Error("admin server stopped", "err", err)
			}
		}()
	}
	r.state = lifeRunning
	attrs := []any{"upstream", r.cfg.Upstream.Addr, "upstream_protocol", r.cfg.Upstream.Protocol, "key_profile", r.cfg.Keys.Profile.Name()}
	if rules, ok := r.cfg.Keys.Profile.(fmt.Stringer); ok {
		attrs = append(attrs, "key_rules", rules.String())
	}
	if tlsLis != nil {
		attrs = append(attrs, "xds_tls", tlsLis.Addr().String(), "xds_auth", r.srv.authMode())
	}
	if lis != nil {
		attrs = append(attrs, "xds_plaintext", lis.Addr().String())
	}
	if peerLis != nil {
		attrs = append(attrs, "peer", peerLis.Addr().String())
	}
	r.log.Info("relay started", attrs...)
	switch {
	case r.cfg.Tier.Owners == nil:
	case peerLis != nil && r.cfg.Tier.TLS != nil:
		r.log.Info("relay-to-relay traffic on the peer port, authenticated by mTLS")
	case len(r.cfg.Tier.Secret) > 0:
		r.log.Warn("relay-to-relay traffic authenticated only by proofs of the peer secret (no peer certificate): each good for one call, but the calls are in clear and whoever is on the path can take them over")
	default:
		r.log.Warn("relay-to-relay traffic not authenticated (no peer certificate, no peer secret): any stream may claim to be a relay")
	}
	r.noteInsecureLocked(lis, tlsLis != nil)
	r.goRun(r.warnInsecure)
	r.logAdminGuard(r.adminLis)
	return nil
}

// logAdminGuard says at start who the admin API answers, when that is
// not what an operator would assume: everyone (a warning, unless the
// listener is on loopback), or no one but health checks.
func (r *Relay) logAdminGuard(lis net.Listener) {
	if lis == nil || r.cfg.Admin.Token != "" || r.cfg.Admin.Authenticator != nil {
		return
	}
	verifiesClients := r.cfg.Admin.TLS != nil && r.cfg.Admin.TLS.GetConfigForClient != nil
	if verifiesClients {
		if c, err := r.cfg.Admin.TLS.GetConfigForClient(&tls.ClientHelloInfo{}); err == nil && c != nil {
			verifiesClients = c.ClientAuth == tls.RequireAndVerifyClientCert
		}
	}
	switch {
	case verifiesClients:
	case r.cfg.XDS.Authenticator != nil:
		r.log.Info("admin API closed but for health checks and /metrics: no --admin-identities, --admin-token-file or --admin-client-ca to prove its callers with", "admin", lis.Addr().String())
	case !isLoopback(lis.Addr()):
		r.log.Warn("admin API open to anyone who reaches its port: config dumps of every namespace and pprof; set --admin-tls-cert with --admin-identities, --admin-token-file or --admin-client-ca", "admin", lis.Addr().String())
	}
}

// isLoopback reports whether a listener's address is on loopback only.
func isLoopback(a net.Addr) bool {
	ta, ok := a.(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
}

// Addr returns the address the plaintext xDS server listens on (after
// Start), or nil.
func (r *Relay) Addr() net.Addr {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.lis == nil {
		return nil
	}
	return r.lis.Addr()
}

// TLSAddr returns the address the TLS xDS server listens on (after Start),
// or nil.
func (r *Relay) TLSAddr() net.Addr {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.tlsLis == nil {
		return nil
	}
	return r.tlsLis.Addr()
}

// AdminAddr returns the admin server's address, or nil.
func (r *Relay) AdminAddr() net.Addr {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.adminLis == nil {
		return nil
	}
	return r.adminLis.Addr()
}

// Stop ends every stream (clients see Unavailable and reconnect elsewhere),
// closes the upstream streams, and returns once every goroutine the relay
// started has exited. It is idempotent. If ctx ends first, in-flight sends
// are cut.
func (r *Relay) Stop(ctx context.Context) error {
	r.mu.Lock()
	if r.state != lifeRunning {
		if r.state == lifeNew {
			r.state = lifeStopped
		}
		r.mu.Unlock()
		return nil
	}
	r.state = lifeStopping
	r.mu.Unlock()
	r.cache.stop()
	// No goroutine starts from now on (goRun refuses), so the wait below
	// waits for a fixed set.
	r.runMu.Lock()
	r.refuseWork = true
	r.runMu.Unlock()

	close(r.stopping)
	done := make(chan struct{})
	go func() {
		var wg sync.WaitGroup
		for _, srv := range r.servers {
			wg.Go(srv.GracefulStop)
		}
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		for _, srv := range r.servers {
			srv.Stop()
		}
		<-done
	}
	r.cancel()
	r.wg.Wait()
	var err error
	if r.adminHTTP != nil {
		r.adminGRPC.Stop() // ends the admin API's streams (waits)
		err = r.adminHTTP.Shutdown(ctx)
	}
	r.serveWG.Wait()
	errs := []error{err, r.upConn.Close()}
	errs = append(errs, r.pool.Close())
	r.mu.Lock()
	r.state = lifeStopped
	r.mu.Unlock()
	return errors.Join(errs...)
}

// lifecycle is a Relay's state: new, running (Start), stopping (Stop has
// begun), stopped (Stop returned, or Stop before Start).
type lifecycle int

const (
	lifeNew lifecycle = iota
	lifeRunning
	lifeStopping
	lifeStopped
)

func (l lifecycle) String() string {
	switch l {
	case lifeRunning:
		return "running"
	case lifeStopping:
		return "stopping"
	case lifeStopped:
		return "stopped"
	}
	return "new"
}

// goRun runs fn on a goroutine that Stop waits for, with the relay's
// context, and reports whether it did: once Stop has begun it refuses, so
// that Stop's wait cannot be joined by a goroutine started behind it.
// Every goroutine of the relay but the servers' is started here.
func (r *Relay) goRun(fn func(context.Context)) bool {
	r.runMu.Lock()
	defer r.runMu.Unlock()
	if r.refuseWork {
		return false
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		fn(r.ctx)
	}()
	return true
}

// Ready reports whether the relay takes new streams: warm and not
// draining.
func (r *Relay) Ready() bool { return r.srv.ready() }

// ID returns the relay's ID (Config.ID).
func (r *Relay) ID() string { return r.cfg.ID }

// Gatherer returns the registry of the relay's metrics.
func (r *Relay) Gatherer() prometheus.Gatherer { return r.cfg.Gatherer }

// Ledger returns the relay's ledger: what each of its Envoys was sent and
// ACKed against its key's versions, and the queries built on it.
func (r *Relay) Ledger() *ledger.Tracker { return r.ledger }

// newAdminGRPC builds the admin listener's gRPC server (admin.Guard: who
// each call is from): the relay's health, reflection, and what
// Config.Admin.Services registers.
func (r *Relay) newAdminGRPC() *grpc.Server {
	s := r.adminGuard.NewServer(grpc.MaxSendMsgSize(r.cfg.MaxMsgSize))
	healthpb.RegisterHealthServer(s, admin.Health{Ready: r.Ready, Stopping: r.stopping})
	reflection.Register(s)
	if r.cfg.Admin.Services != nil {
		r.cfg.Admin.Services(s)
	}
	return s
}

// adminMux serves the admin listener's HTTP/1 endpoints.
func (r *Relay) adminMux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		// Live, whatever the details say: restarting a relay because its
		// upstream or etcd is away would only lose its cache.
		fmt.Fprintln(w, "ok")
		st := r.Stats()
		fmt.Fprintf(w, "stale keys: %d of %d\n", st.StaleKeys, st.Keys)
		r.mu.Lock()
		lis, tlsLis := r.lis, r.tlsLis
		r.mu.Unlock()
		if tlsLis != nil {
			fmt.Fprintf(w, "xds tls: %s, auth %s\n", tlsLis.Addr(), r.srv.authMode())
		}
		if lis != nil {
			fmt.Fprintf(w, "xds plaintext: %s: WARNING: PLAINTEXT, serves anyone who reaches it\n", lis.Addr())
		}
		for _, what := range r.insecurities() {
			fmt.Fprintf(w, "WARNING: INSECURE: %s\n", what)
		}
		if lag, ok := r.cfg.Keys.Snapshots.(persistenceLag); ok {
			if n, d := lag.Behind(); n > 0 {
				fmt.Fprintf(w, "snapshots: behind: %d keys not persisted, oldest change %s ago\n", n, d.Round(time.Millisecond))
			} else {
				fmt.Fprintln(w, "snapshots: up to date")
			}
		}
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		select {
		case <-r.stopping:
			http.Error(w, "stopping", http.StatusServiceUnavailable)
			return
		default:
		}
		switch {
		case r.srv.draining.Load():
			http.Error(w, "draining", http.StatusServiceUnavailable)
		case !r.Ready():
			http.Error(w, "not warm: upstream not reached yet", http.StatusServiceUnavailable)
		default:
			fmt.Fprintln(w, "ready")
		}
	})
	mux.Handle("/metrics", promhttp.HandlerFor(r.cfg.Gatherer, promhttp.HandlerOpts{}))
	// Profiles can hold anything in memory (Secrets): behind the token.
	mux.Handle("/debug/pprof/", r.adminGuard.AdminsOnly(http.HandlerFunc(pprof.Index)))
	mux.Handle("/debug/pprof/cmdline", r.adminGuard.AdminsOnly(http.HandlerFunc(pprof.Cmdline)))
	mux.Handle("/debug/pprof/profile", r.adminGuard.AdminsOnly(http.HandlerFunc(pprof.Profile)))
	mux.Handle("/debug/pprof/symbol", r.adminGuard.AdminsOnly(http.HandlerFunc(pprof.Symbol)))
	mux.Handle("/debug/pprof/trace", r.adminGuard.AdminsOnly(http.HandlerFunc(pprof.Trace)))
	return mux
}

// persistenceLag is implemented by Snapshots that can say how far behind
// they are (snapshot.Store): a health detail.
type persistenceLag interface {
	Behind() (keys int, oldest time.Duration)
}

func mustMarshal(m proto.Message) []byte {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		panic(err) // only called on messages built by the relay itself
	}
	return b
}
