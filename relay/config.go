package relay

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/meshrelay/meshrelay/ledger"
)

// Config configures a Relay. Start from DefaultConfig. It holds one
// config per part of the relay: XDS (the downstream server Envoys connect
// to), Upstream (each key's stream to istiod), Keys (aggregation and each
// key's cache), Tier (the relays of a sharded tier) and Admin (the admin
// listener), each with its Default…Config.
type Config struct {
	// ID names the relay in control_plane.identifier on every response and
	// in logs. Default: "meshrelay-<hostname>".
	ID string

	XDS      XDSConfig
	Upstream UpstreamConfig
	Keys     KeysConfig
	Tier     TierConfig
	Admin    AdminConfig

	// MaxMsgSize bounds a gRPC message in both directions, downstream and
	// upstream, in bytes, but for the requests of the xDS ports
	// (XDS.MaxRequestBytes). Default 256 MiB: a real istiod sent 34 MB of
	// CDS in one SotW response at 30,000 services. Must be at least 4 MiB.
	MaxMsgSize int

	// Registerer and Gatherer hold the relay's Prometheus metrics. Default:
	// a registry of the relay's own, so several relays can live in one
	// process.
	Registerer prometheus.Registerer
	Gatherer   prometheus.Gatherer
	// Logger receives structured logs. Default: discard.
	Logger *slog.Logger

	// History bounds each key's ledger history of each type (versions
	// kept for delivery queries). Default ledger.DefaultHistoryConfig().
	History ledger.HistoryConfig
	// ForgetEnvoysAfter is how long an Envoy whose stream ended is listed
	// by the ledger as not connected. Default 30 s.
	ForgetEnvoysAfter time.Duration

	// Rand, if set, is the source of the relay's random choices: the
	// jitter of its reconnect backoff and balancing rounds, which streams
	// it sheds, when a key's first divergence check runs. A simulation
	// passes a seeded source so that a seed replays. The relay serialises
	// its calls. Default nil: math/rand/v2's global source.
	Rand rand.Source

	// wall is the wall clock the relay's version stamps read (time.Now if
	// nil); tests move it.
	wall func() time.Time
}

// TierConfig makes the relay one of a sharded tier: who owns each key,
// the other relays, the port and proofs they talk to each other with, and
// balancing. Its zero value (but for the defaults) is a relay alone.
type TierConfig struct {
	// Owners, if set, makes the relay one of a sharded tier: a key's
	// upstream stream is held by its owner, and the other relays subscribe
	// to the owner (see Owners). Default nil: this relay owns every key.
	Owners Owners
	// Peers, if set, lists the tier's other relays: tier-wide ledger
	// answers (TierLedger, TierDelivery, TierWait) are gathered from them.
	// Default nil: the answers are this relay's alone.
	Peers Peers
	// GatherTimeout bounds a tier-wide ledger gather: the answer is at
	// most this old, and a relay that does not answer within it is named
	// as missing. Default 1 s.
	GatherTimeout time.Duration
	// PollInterval is how often TierWait gathers. Default 100 ms.
	PollInterval time.Duration
	// Balancer, if set, balances Envoy streams across the tier: above its
	// fair share, the relay moves streams away (see BalanceInterval).
	// Default nil: no balancing.
	Balancer Balancer
	// BalanceInterval is the mean time between two balancing rounds
	// (jittered ±50 %). Default 5s. Only with Balancer.
	BalanceInterval time.Duration
	// ShedRate bounds the Envoy streams moved away per second when
	// balancing. Default 20.
	ShedRate float64
	// Secret authenticates relay-to-relay calls without mTLS: each
	// carries a proof good for that call once, for two minutes (an HMAC
	// of the calling relay's ID, the method, the key, the time and a
	// nonce: relay/peers.Prover). Every relay of a tier needs the same one. Empty: a
	// stream that names itself a peer is believed (a trusted network).
	// Never logged.
	Secret []byte
	// Listen, if set, opens a port for the tier's relays alone: their
	// streams to keys' owners and the ledger and inspect exchanges go
	// there (and nowhere else: the xDS ports then refuse them), and no
	// Envoy is served on it. Empty (the default): relays use the
	// plaintext xDS port. Ignored if Listener is set.
	Listen string
	// Listener, if set, is used instead of listening on Listen.
	Listener net.Listener
	// TLS, if set, makes the peer port mTLS: it must require and verify
	// client certificates and check their identity (auth.PeerTLS builds
	// one that wants the tier's SPIFFE ID). A relay proven by its
	// certificate needs no Secret proof. Default nil: plaintext, relays
	// proven by Secret alone.
	TLS *tls.Config
	// DialOptions are added to relay-to-relay connections' options
	// (credentials, a test dialer). Default: plaintext.
	DialOptions []grpc.DialOption
	// InsecureForDevelopment lets a relay whose xDS port authenticates
	// (XDS.Authenticator) join a tier without mTLS between relays (TLS)
	// or, in shard.Node, without a gossip key: a client that reaches the
	// port relays dial and claims to be one, or a member that joins the
	// gossip, would be served every key's config, secrets included. New
	// refuses such a relay without it; with it, the relay says so every
	// minute in its log and on /healthz. Development only. Default false.
	InsecureForDevelopment bool
}

// DefaultTierConfig returns a relay alone, with the tier's timings.
func DefaultTierConfig() TierConfig {
	return TierConfig{
		GatherTimeout:   time.Second,
		PollInterval:    100 * time.Millisecond,
		BalanceInterval: 5 * time.Second,
		ShedRate:        20,
	}
}

// AdminConfig configures the admin listener (relay/admin): health,
// readiness, metrics, pprof and the admin API, and who may call them.
type AdminConfig struct {
	// Listen is the address of the admin HTTP server (health, readiness,
	// /metrics, /debug/pprof). Empty: none. Default "" (the serve command
	// sets ":15014").
	Listen string
	// Listener, if set, is used instead of listening on Listen. The relay
	// closes it on Stop.
	Listener net.Listener
	// TLS, if set, makes the admin listener serve TLS (HTTP/1 and HTTP/2
	// by ALPN); with ClientAuth RequireAndVerifyClientCert, mTLS. Default
	// nil: cleartext (HTTP/1 and h2c).
	TLS *tls.Config
	// Token, if set, is the bearer token every admin gRPC call but
	// grpc.health.v1 (kubelet probes carry none) and /debug/pprof must
	// carry ("authorization: Bearer <token>"). A secret: never logged.
	// Default "": none.
	Token string
	// Authenticator, if set, proves the identity of admin API callers (a
	// service-account JWT, or a SPIFFE client certificate when TLS asks
	// for one), and of debug requests (istio.io/debug/…) on the TLS xDS
	// port, which are proven by the stream's XDS.Authenticator. A proven
	// caller whose SPIFFE ID is in Identities is an admin; another sees
	// only its own namespace's Envoys, keys and config, and may not
	// mutate. Token, if also set, still makes an admin. Default nil: the
	// admin API is guarded by Token and TLS alone.
	Authenticator Authenticator
	// Identities are the SPIFFE IDs of admins
	// (spiffe://cluster.local/ns/istio-system/sa/istioctl, say). Default
	// none.
	Identities []string
	// DebugNamespaces are the namespaces whose proven identities read the
	// whole tier's istio.io/debug types on the TLS xDS port, as istiod
	// answers its root namespace and ENABLE_DEBUG_ENDPOINT_AUTH's allowed
	// namespaces (istioctl presents istio-system's default account). Read
	// only: they give no admin API rights. An identity of another
	// namespace reads its own namespace's. Default none.
	DebugNamespaces []string
	// Services, if set, registers gRPC services on the admin listener
	// (beside grpc.health.v1 and reflection, which the relay serves):
	// shard.Node registers the tier's admin API. Nil: none.
	Services func(*grpc.Server)
}

// DefaultAdminConfig returns the admin listener's defaults: none (the
// serve command listens on :15014), open to whoever reaches it unless the
// xDS port authenticates (relay/admin).
func DefaultAdminConfig() AdminConfig { return AdminConfig{} }

// DefaultConfig returns a Config with every default filled in but
// Upstream.Addr.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	if host == "" {
		host = "local"
	}
	return Config{
		ID:                "meshrelay-" + host,
		XDS:               DefaultXDSConfig(),
		Upstream:          DefaultUpstreamConfig(),
		Keys:              DefaultKeysConfig(),
		Tier:              DefaultTierConfig(),
		Admin:             DefaultAdminConfig(),
		MaxMsgSize:        256 << 20,
		History:           ledger.DefaultHistoryConfig(),
		ForgetEnvoysAfter: ledger.DefaultTrackerConfig().ForgetAfter,
		Logger:            slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

// validate checks cfg and fills what a zero value leaves open.
func (cfg *Config) validate() error {
	var errs []error
	bad := func(field, why string) { errs = append(errs, fmt.Errorf("relay: field %s %s", field, why)) }
	if cfg.ID == "" {
		bad("ID", "is empty")
	}
	if cfg.Upstream.Addr == "" {
		bad("Upstream.Addr", "is empty: the relay needs an upstream control plane")
	}
	if cfg.XDS.Listener == nil && cfg.XDS.Listen == "" && cfg.XDS.TLS == nil {
		bad("XDS.Listen", "is empty and neither XDS.Listener nor XDS.TLS is set: the relay would serve no one")
	}
	if cfg.XDS.TLS != nil && cfg.XDS.TLSListener == nil && cfg.XDS.TLSListen == "" {
		bad("XDS.TLSListen", "is empty and no XDS.TLSListener is set")
	}
	if cfg.Tier.TLS != nil && cfg.Tier.Listen == "" && cfg.Tier.Listener == nil {
		bad("Tier.TLS", "is set without a peer port (Tier.Listen)")
	}
	if cfg.XDS.Authenticator != nil && cfg.Tier.Owners != nil && cfg.Tier.TLS == nil && !cfg.Tier.InsecureForDevelopment {
		bad("Tier.TLS", "is nil in a tier while the xDS port authenticates: relays would prove themselves to each other "+
			"by an HMAC proof on a port without TLS, which whoever is on the path can read and forward, and whoever claims to be one would be served every key's config, "+
			"secrets included; set it (--peer-listen with --peer-tls-cert, --peer-tls-key and --peer-tls-ca), or, for "+
			"development only, Tier.InsecureForDevelopment (--insecure-tier-for-development)")
	}
	if cfg.Upstream.ForwardCredentials && cfg.XDS.Authenticator == nil {
		bad("Upstream.ForwardCredentials", "needs an XDS.Authenticator: the tokens it forwards are those the TLS port verified")
	}
	if cfg.Upstream.ForwardCredentials && cfg.Tier.Owners != nil && cfg.Tier.TLS == nil {
		bad("Upstream.ForwardCredentials", "in a tier needs Tier.TLS: Envoys' tokens cross between relays")
	}
	if cfg.Upstream.ForwardCredentials && cfg.Upstream.TokenRefreshBefore <= 0 {
		bad("Upstream.TokenRefreshBefore", "must be positive")
	}
	if cfg.XDS.Authenticator != nil && cfg.XDS.TLS == nil {
		bad("XDS.Authenticator", "is set without XDS.TLS: only the TLS port authenticates")
	}
	if _, err := ParseProtocol(string(cfg.Upstream.Protocol)); err != nil {
		bad("Upstream.Protocol", fmt.Sprintf("is %q, want sotw or delta", cfg.Upstream.Protocol))
	}
	if cfg.Keys.Profile == nil {
		bad("Keys.Profile", "is nil")
	}
	if cfg.XDS.Authorizer == nil {
		bad("XDS.Authorizer", "is nil")
	}
	if cfg.MaxMsgSize < 4<<20 {
		bad("MaxMsgSize", fmt.Sprintf("is %d bytes, want at least 4 MiB", cfg.MaxMsgSize))
	}
	if cfg.Keys.KeepDroppedBytes < 0 {
		bad("Keys.KeepDroppedBytes", "is negative")
	}
	if cfg.XDS.MaxStreams < 0 {
		bad("XDS.MaxStreams", "is negative")
	}
	if cfg.XDS.MaxSubscribedNames <= 0 {
		bad("XDS.MaxSubscribedNames", "must be positive")
	}
	if cfg.XDS.MaxRequestBytes < 64<<10 {
		bad("XDS.MaxRequestBytes", fmt.Sprintf("is %d bytes, want at least 64 KiB", cfg.XDS.MaxRequestBytes))
	}
	if cfg.XDS.RequestBudgetBytes == 0 {
		cfg.XDS.RequestBudgetBytes = int64(min(cfg.XDS.MaxRequestBytes, cfg.MaxMsgSize)) * int64(max(1, runtime.GOMAXPROCS(0)/2))
	}
	if cfg.XDS.RequestBudgetBytes < int64(min(cfg.XDS.MaxRequestBytes, cfg.MaxMsgSize)) {
		bad("XDS.RequestBudgetBytes", fmt.Sprintf("is %d bytes, less than XDS.MaxRequestBytes (%d): the largest request could never be taken", cfg.XDS.RequestBudgetBytes, cfg.XDS.MaxRequestBytes))
	}
	for name, d := range map[string]time.Duration{
		"XDS.ResourceWaitTimeout": cfg.XDS.ResourceWaitTimeout, "Keys.IdleTimeout": cfg.Keys.IdleTimeout,
		"Upstream.BackoffInitial": cfg.Upstream.BackoffInitial, "Upstream.BackoffMax": cfg.Upstream.BackoffMax,
		"ForgetEnvoysAfter": cfg.ForgetEnvoysAfter, "Tier.GatherTimeout": cfg.Tier.GatherTimeout,
		"Tier.PollInterval": cfg.Tier.PollInterval, "XDS.HandshakeTimeout": cfg.XDS.HandshakeTimeout,
		"XDS.AdmitWait": cfg.XDS.AdmitWait,
	} {
		if d <= 0 {
			bad(name, "must be positive")
		}
	}
	if cfg.XDS.MaxStreamsPerConnection < 1 {
		bad("XDS.MaxStreamsPerConnection", "must be at least 1")
	}
	if cfg.XDS.MaxConnectionAge < 0 || cfg.XDS.MaxConnectionAgeGrace < 0 {
		bad("XDS.MaxConnectionAge", "and XDS.MaxConnectionAgeGrace must not be negative")
	}
	if cfg.Keys.AggregationWarnInterval < 0 {
		bad("Keys.AggregationWarnInterval", "must not be negative")
	}
	if cfg.Keys.DivergenceInterval < 0 {
		bad("Keys.DivergenceInterval", "must not be negative")
	}
	if cfg.XDS.AdmitRate < 0 || cfg.XDS.AdmitRate > 0 && cfg.XDS.AdmitBurst < 1 {
		bad("XDS.AdmitRate", "must be 0 (no limit), or positive with XDS.AdmitBurst at least 1")
	}
	if cfg.Upstream.StreamRate < 0 {
		bad("Upstream.StreamRate", "must be 0 (no bound) or positive")
	}
	if cfg.Upstream.Syncs < 0 {
		bad("Upstream.Syncs", "must be 0 (no bound) or positive")
	}
	if cfg.Tier.Balancer != nil && (cfg.Tier.BalanceInterval <= 0 || cfg.Tier.ShedRate <= 0) {
		bad("Tier.BalanceInterval", "and Tier.ShedRate must be positive with a Tier.Balancer")
	}
	if err := cfg.History.Validate(); err != nil {
		bad("History", err.Error())
	}
	if cfg.Upstream.BackoffMax < cfg.Upstream.BackoffInitial {
		bad("Upstream.BackoffMax", "is below Upstream.BackoffInitial")
	}
	if (cfg.Registerer == nil) != (cfg.Gatherer == nil) {
		bad("Registerer", "and Gatherer must be set together")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if cfg.Registerer == nil {
		reg := prometheus.NewRegistry()
		cfg.Registerer, cfg.Gatherer = reg, reg
	}
	return errors.Join(errs...)
}
