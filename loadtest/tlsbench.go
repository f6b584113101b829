package loadtest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spf13/pflag"

	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

// TLSMode says whether the relayed runs of a benchmark reach the relay on
// its TLS port (istiod's 15012: TLS, and a service-account JWT per stream)
// rather than its plaintext one.
type TLSMode string

const (
	// TLSOff: the plaintext port only (the default).
	TLSOff TLSMode = "off"
	// TLSOn: the TLS port only.
	TLSOn TLSMode = "on"
	// TLSCompare: each relayed run twice, plaintext then TLS, so that both
	// sit side by side in one report.
	TLSCompare TLSMode = "compare"
)

// ParseTLSMode parses "off", "on" or "compare" (and "false", "true").
func ParseTLSMode(s string) (TLSMode, error) {
	switch s {
	case "off", "false":
		return TLSOff, nil
	case "on", "true":
		return TLSOn, nil
	case "compare":
		return TLSCompare, nil
	}
	return "", fmt.Errorf("loadtest: unknown TLS mode %q (want off, on or compare)", s)
}

// TLSModeFlag is a pflag.Value for --tls; register it with TLSModeVar so
// that a bare "--tls" means on.
type TLSModeFlag struct{ Mode *TLSMode }

// TLSModeVar defines the flag name on fs, stored in m: bare "--name"
// means on, "--name=compare" compare.
func TLSModeVar(fs *pflag.FlagSet, m *TLSMode, name, usage string) {
	fs.Var(TLSModeFlag{Mode: m}, name, usage)
	fs.Lookup(name).NoOptDefVal = string(TLSOn)
}

var _ pflag.Value = TLSModeFlag{}

func (f TLSModeFlag) String() string {
	if f.Mode == nil || *f.Mode == "" {
		return string(TLSOff)
	}
	return string(*f.Mode)
}

// Set implements pflag.Value.
func (f TLSModeFlag) Set(s string) error {
	m, err := ParseTLSMode(s)
	if err == nil {
		*f.Mode = m
	}
	return err
}

// Type implements pflag.Value.
func (TLSModeFlag) Type() string { return "mode" }

// Verifier names how a relay verifies the service-account tokens on its
// TLS port.
type Verifier string

const (
	// VerifierLocal checks each token's RS256 signature against the
	// issuer's keys (auth.Local): one signature check a stream.
	VerifierLocal Verifier = "local"
	// VerifierTokenReview asks a Kubernetes API (auth.TokenReview, with its
	// verdict cache) — here an in-process fake that answers after a set
	// latency: one review per distinct token, then cache hits.
	VerifierTokenReview Verifier = "tokenreview"
)

// ParseVerifier parses "local" or "tokenreview".
func ParseVerifier(s string) (Verifier, error) {
	switch v := Verifier(s); v {
	case VerifierLocal, VerifierTokenReview:
		return v, nil
	}
	return "", fmt.Errorf("loadtest: unknown token verifier %q (want local or tokenreview)", s)
}

// transportName names how a run's Envoys reach the relay: "plaintext",
// "tls-local" or "tls-tokenreview".
func transportName(tls bool, v Verifier) string {
	if !tls {
		return "plaintext"
	}
	return "tls-" + string(v)
}

// The names of the benchmark's mesh.
const (
	// relayServerName is the name the relay's serving certificate holds
	// and the Envoys verify (istio-agent's ISTIOD_SAN).
	relayServerName = "meshrelay.istio-system.svc"
	tokenAudience   = "istio-ca"
	// tokenTTL outlives every bounded run.
	tokenTTL = 12 * time.Hour
)

// MeshCredentials are a throwaway mesh for the TLS benchmarks, made
// without a testing.TB from relay/auth/authtest's CA and Issuer: a root
// CA, the relay's serving certificate for relayServerName, 127.0.0.1 and
// localhost, a service-account token issuer (RS256, as the Kubernetes API
// server signs projected tokens), and the files a relay reads them from.
// Tokens are signed once per (namespace, service account). Safe for
// concurrent use.
type MeshCredentials struct {
	dir      string
	pool     *x509.CertPool
	rootPEM  []byte
	certFile string
	keyFile  string
	jwksFile string
	issuer   *authtest.Issuer

	mu     sync.Mutex
	tokens map[[2]string]string // (namespace, service account) → token
	owners map[string][2]string // token → (namespace, service account)
}

// NewMeshCredentials makes a mesh and writes its files into dir (which
// must exist; the caller removes it).
func NewMeshCredentials(dir string) (*MeshCredentials, error) {
	ca, err := authtest.MakeCA("loadtest mesh root")
	if err != nil {
		return nil, err
	}
	serving, err := ca.Make(authtest.Leaf{DNSNames: []string{relayServerName, "localhost"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}})
	if err != nil {
		return nil, err
	}
	issuer, err := authtest.MakeIssuer()
	if err != nil {
		return nil, err
	}
	m := &MeshCredentials{
		dir: dir, pool: ca.Pool(), rootPEM: ca.RootPEM(), issuer: issuer,
		tokens: map[[2]string]string{}, owners: map[string][2]string{},
		certFile: filepath.Join(dir, "relay-cert.pem"), keyFile: filepath.Join(dir, "relay-key.pem"),
		jwksFile: filepath.Join(dir, "jwks.json"),
	}
	// The chain, as istiod's serving certificate files hold it.
	if err := os.WriteFile(m.certFile, append(slices.Clone(serving.CertPEM), ca.RootPEM()...), 0o600); err != nil {
		return nil, err
	}
	if err := os.WriteFile(m.keyFile, serving.KeyPEM, 0o600); err != nil {
		return nil, err
	}
	if err := issuer.WriteJWKSFile(m.jwksFile); err != nil {
		return nil, err
	}
	return m, nil
}

// Token returns the projected service-account token of (ns, sa), bound to
// the audience istio-ca, as the kubelet mounts it for istio-agent.
func (m *MeshCredentials) Token(ns, sa string) (string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if tok, ok := m.tokens[[2]string{ns, sa}]; ok {
		return tok, nil
	}
	tok, err := m.issuer.Make(authtest.Token{Namespace: ns, ServiceAccount: sa, Audiences: []string{tokenAudience}, TTL: tokenTTL})
	if err != nil {
		return "", fmt.Errorf("loadtest: sign the token of %s/%s: %w", ns, sa, err)
	}
	m.tokens[[2]string{ns, sa}] = tok
	m.owners[tok] = [2]string{ns, sa}
	return tok, nil
}

// nodeToken is the token of node's namespace and service account (its
// NAMESPACE and SERVICE_ACCOUNT metadata), the one istiod's rule accepts.
func (m *MeshCredentials) nodeToken(node *core.Node) (string, error) {
	return m.Token(nodeAccount(node))
}

// Tokens returns how many distinct tokens were signed.
func (m *MeshCredentials) Tokens() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.tokens)
}

// ClientTLS is what a simulated Envoy dials the relay's TLS port with: the
// mesh root, the relay's name, no session cache (every connection is a
// full handshake, as a new pod's is).
func (m *MeshCredentials) ClientTLS() *tls.Config { return meshClientTLS(m.pool) }

// RelayTLS returns the TLS settings of a relay child checking tokens with
// v (reviewURL: the Kubernetes API for VerifierTokenReview).
func (m *MeshCredentials) RelayTLS(v Verifier, reviewURL string) *RelayChildTLS {
	return &RelayChildTLS{CertFile: m.certFile, KeyFile: m.keyFile, Verifier: v, Issuer: m.issuer.URL, JWKSFile: m.jwksFile, TokenReviewURL: reviewURL}
}

// StartTokenReview starts a fake Kubernetes API (authtest.KubeAPI) that
// answers TokenReviews after latency: authenticated as the service account
// a token was signed for by Token, refused otherwise. What a client must
// not send fails the run: Failures counts it. The caller must Stop it.
func (m *MeshCredentials) StartTokenReview(latency time.Duration) (*FakeKubeAPI, error) {
	f := &FakeKubeAPI{}
	k, err := authtest.StartKubeAPI(func(token string, audiences []string) authenticationv1.TokenReviewStatus {
		m.mu.Lock()
		who, ok := m.owners[token]
		m.mu.Unlock()
		if !ok || !slices.Contains(audiences, tokenAudience) {
			return authtest.Unauthenticated("invalid bearer token")
		}
		return authtest.ServiceAccount(who[0], who[1], tokenAudience)
	}, func(err error) {
		f.failures.Add(1)
		f.mu.Lock()
		if f.first == nil {
			f.first = err
		}
		f.mu.Unlock()
	})
	if err != nil {
		return nil, err
	}
	k.SetDelay(latency)
	f.KubeAPI = k
	return f, nil
}

// FakeKubeAPI is the fake API server of a tokenreview run, counting the
// protocol errors it saw. Stop it when done.
type FakeKubeAPI struct {
	*authtest.KubeAPI
	failures atomic.Int64
	mu       sync.Mutex
	first    error
}

// Err returns the first bad request the server saw, with the count.
func (f *FakeKubeAPI) Err() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.first == nil {
		return nil
	}
	return fmt.Errorf("loadtest: fake Kubernetes API: %d bad requests, the first: %w", f.failures.Load(), f.first)
}

// RelayChildTLS is a relay's TLS xDS port: its serving pair, and how it
// verifies the service-account token every stream must present (JWT mode:
// the node's namespace and service account must be the token's).
type RelayChildTLS struct {
	CertFile string `json:"cert"`
	KeyFile  string `json:"key"`
	// Verifier is local or tokenreview.
	Verifier Verifier `json:"verifier"`
	// Issuer and JWKSFile are the local verifier's.
	Issuer   string `json:"issuer,omitempty"`
	JWKSFile string `json:"jwks,omitempty"`
	// TokenReviewURL is the tokenreview verifier's Kubernetes API.
	TokenReviewURL string `json:"tokenreview_url,omitempty"`
}

// args returns c as flags of `loadtest relay-child`.
func (c *RelayChildTLS) args() []string {
	a := []string{"--tls-cert", c.CertFile, "--tls-key", c.KeyFile, "--tls-verifier", string(c.Verifier)}
	if c.Issuer != "" {
		a = append(a, "--jwt-issuer", c.Issuer)
	}
	if c.JWKSFile != "" {
		a = append(a, "--jwks", c.JWKSFile)
	}
	if c.TokenReviewURL != "" {
		a = append(a, "--tokenreview-url", c.TokenReviewURL)
	}
	return a
}

// Apply sets rc up to serve a TLS port with c's pair and an authenticator
// of c's verifier, as `meshrelay serve --xds-tls-cert … --xds-auth jwt`
// does (client certificates are not asked for).
func (c *RelayChildTLS) Apply(ctx context.Context, rc *relay.Config) error {
	pair, err := tlsfiles.LoadKeyPair(c.CertFile, c.KeyFile)
	if err != nil {
		return err
	}
	rc.XDS.TLS = tlsfiles.ServerConfig(pair, nil, tls.RequestClientCert)
	var tokens auth.TokenVerifier
	switch c.Verifier {
	case VerifierLocal:
		lc := auth.DefaultLocalConfig()
		lc.Issuer, lc.Keys = c.Issuer, auth.KeysFromFile(c.JWKSFile)
		if tokens, err = auth.NewLocal(ctx, lc); err != nil {
			return err
		}
	case VerifierTokenReview:
		// As meshrelay serve: client-go's default of 5 a second would
		// bound a reconnect storm's reviews.
		client, err := kubernetes.NewForConfig(&rest.Config{Host: c.TokenReviewURL, QPS: 100, Burst: 200})
		if err != nil {
			return fmt.Errorf("loadtest: tokenreview client: %w", err)
		}
		tc := auth.DefaultTokenReviewConfig()
		tc.Client = client
		if tokens, err = auth.NewTokenReview(tc); err != nil {
			return err
		}
	default:
		return fmt.Errorf("loadtest: unknown token verifier %q", c.Verifier)
	}
	rc.XDS.Authenticator, err = auth.NewAuthenticator(auth.ModeJWT, nil, tokens)
	return err
}

// tlsTransport dials a fleet's Envoys to a relay's TLS port, each
// presenting its node's token: it replaces the connection StartFleet made
// (FleetConfig.Configure), one TLS connection per EnvoysPerConn Envoys.
// Close its connections after the fleet stopped.
type tlsTransport struct {
	client  *tls.Config
	target  string
	perConn int
	maxMsg  int
	// token picks an Envoy's token (nil: its node's own).
	token func(node *core.Node) (string, error)

	mu     sync.Mutex
	conns  []*grpc.ClientConn
	tokens map[string]bool // the distinct tokens this fleet presents
	err    error
}

func newTLSTransport(creds *MeshCredentials, target string, perConn, maxMsg int) *tlsTransport {
	return newTLSTransportWith(creds.ClientTLS(), creds.nodeToken, target, perConn, maxMsg)
}

// newTLSTransportWith dials with client and presents the token token picks
// for each Envoy's node.
func newTLSTransportWith(client *tls.Config, token func(*core.Node) (string, error), target string, perConn, maxMsg int) *tlsTransport {
	if perConn <= 0 {
		perConn = 1
	}
	if maxMsg <= 0 {
		maxMsg = 256 << 20
	}
	return &tlsTransport{client: client, target: target, perConn: perConn, maxMsg: maxMsg, token: token, tokens: map[string]bool{}}
}

// configure is FleetConfig.Configure; StartFleet calls it in order of i.
func (t *tlsTransport) configure(i int, c *envoy.Config) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.err != nil {
		return
	}
	if i%t.perConn == 0 || len(t.conns) == 0 {
		conn, err := grpc.NewClient(t.target,
			grpc.WithTransportCredentials(credentials.NewTLS(t.client.Clone())),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(t.maxMsg)))
		if err != nil {
			t.err = fmt.Errorf("loadtest: dial %s: %w", t.target, err)
			return
		}
		t.conns = append(t.conns, conn)
	}
	tok, err := t.token(c.Node)
	if err != nil {
		t.err = err
		return
	}
	t.tokens[tok] = true
	c.Conn = t.conns[len(t.conns)-1]
	c.Metadata = metadata.Pairs("authorization", "Bearer "+tok)
}

// Tokens is how many distinct tokens the fleet's Envoys present.
func (t *tlsTransport) Tokens() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.tokens)
}

// Err is the first error configure met (the fleet must then be stopped:
// some of its Envoys have no TLS connection).
func (t *tlsTransport) Err() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.err
}

// Close closes the TLS connections.
func (t *tlsTransport) Close() {
	t.mu.Lock()
	conns := t.conns
	t.conns = nil
	t.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

// AdmissionConfig is a connect storm against one relay: Streams new
// Envoys, Concurrency of them connecting at once, each on a connection of
// its own, each stream opened and asked for one cluster of its key (a
// small answer, so that what is timed is admission, not a push).
type AdmissionConfig struct {
	// Target is the relay's address (its TLS port with Creds).
	Target string
	// Creds, if set, makes each stream dial TLS and present its node's
	// token; nil: plaintext.
	Creds *MeshCredentials
	// Scenario and Keys name the nodes (as the fleet's: key j%Keys); pods
	// are numbered from FirstPod so that node ids are new to the relay.
	Scenario upstream.Scenario
	Keys     int
	FirstPod int
	// Names gives, per upstream group, the one cluster a stream asks for.
	Names map[string]string
	// Streams and Concurrency. Defaults 1,000 and 32.
	Streams, Concurrency int
	// Timeout bounds the storm. Default 2m.
	Timeout time.Duration
	// Stat reads the relay process's CPU (nil: not measured).
	Stat func() (ProcStat, error)
}

// AdmissionFigures are what a connect storm measured. Every stream stays
// open until the last one is admitted, so the relay admits into a growing
// set as in a real storm; the figures stop there, before the streams are
// closed.
type AdmissionFigures struct {
	Streams     int `json:"streams"`
	Concurrency int `json:"concurrency"`
	// Admitted streams got their answer; Refused lists the others by gRPC
	// code (or "timeout").
	Admitted int            `json:"admitted"`
	Refused  map[string]int `json:"refused,omitempty"`
	// WallS is from the first dial to the last answer; RatePerS is
	// Admitted / WallS.
	WallS    float64 `json:"wall_s"`
	RatePerS float64 `json:"rate_per_s"`
	// Latency is dial → first response, per stream.
	Latency report.LatencyMs `json:"latency"`
	// RelayCPUS is the relay process's CPU time over the storm (10 ms
	// ticks); RelayCPUPer1000S per 1,000 admitted streams. LoadtestCPUS
	// is this process's (the client side: TLS handshakes, token, stream).
	RelayCPUS        float64 `json:"relay_cpu_s"`
	RelayCPUPer1000S float64 `json:"relay_cpu_per_1000_s"`
	LoadtestCPUS     float64 `json:"loadtest_cpu_s"`
	Err              string  `json:"error,omitempty"`
}

// RunAdmission runs a connect storm and closes every stream it opened
// before it returns.
func RunAdmission(ctx context.Context, cfg AdmissionConfig) AdmissionFigures {
	if cfg.Streams <= 0 {
		cfg.Streams = 1000
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = 32
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 2 * time.Minute
	}
	if cfg.Keys <= 0 {
		cfg.Keys = 1
	}
	fig := AdmissionFigures{Streams: cfg.Streams, Concurrency: cfg.Concurrency}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()

	creds := grpc.WithTransportCredentials(insecure.NewCredentials())
	if cfg.Creds != nil {
		creds = grpc.WithTransportCredentials(credentials.NewTLS(cfg.Creds.ClientTLS()))
	}
	type result struct {
		took time.Duration
		code string // "" admitted
	}
	results := make([]result, cfg.Streams)
	conns := make([]*grpc.ClientConn, cfg.Streams)
	streamCtx, closeStreams := context.WithCancel(ctx)
	defer func() {
		closeStreams()
		for _, c := range conns {
			if c != nil {
				_ = c.Close()
			}
		}
	}()
	one := func(j int) result {
		node := traffic.KeyNode(cfg.Scenario, j%cfg.Keys, cfg.FirstPod+j/cfg.Keys)
		start := time.Now()
		conn, err := grpc.NewClient(cfg.Target, creds)
		if err != nil {
			return result{code: "dial"}
		}
		conns[j] = conn
		sctx := streamCtx
		if cfg.Creds != nil {
			tok, err := cfg.Creds.nodeToken(node)
			if err != nil {
				return result{code: "token"}
			}
			sctx = metadata.AppendToOutgoingContext(sctx, "authorization", "Bearer "+tok)
		}
		st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(sctx)
		if err != nil {
			return result{code: codeName(err)}
		}
		// A refusal ends the stream: Send may then fail with EOF, and Recv
		// says why.
		_ = st.Send(&discovery.DeltaDiscoveryRequest{
			Node: node, TypeUrl: envoy.ClusterType,
			ResourceNamesSubscribe: []string{cfg.Names[cfg.Scenario.Group(node)]},
		})
		if _, err := st.Recv(); err != nil {
			return result{code: codeName(err)}
		}
		return result{took: time.Since(start)}
	}

	var relay0, self0 ProcStat
	var statErr error
	if cfg.Stat != nil {
		relay0, statErr = cfg.Stat()
	}
	self0, selfErr := ReadProcStat(os.Getpid())
	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(cfg.Concurrency, cfg.Streams) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				j := int(next.Add(1) - 1)
				if j >= cfg.Streams {
					return
				}
				results[j] = one(j)
			}
		}()
	}
	wg.Wait()
	fig.WallS = time.Since(start).Seconds()
	if cfg.Stat != nil && statErr == nil {
		var relay1 ProcStat
		if relay1, statErr = cfg.Stat(); statErr == nil {
			fig.RelayCPUS = (relay1.CPU - relay0.CPU).Seconds()
		}
	}
	if self1, err := ReadProcStat(os.Getpid()); selfErr == nil && err == nil {
		fig.LoadtestCPUS = (self1.CPU - self0.CPU).Seconds()
	}

	var took []time.Duration
	for _, r := range results {
		if r.code == "" {
			fig.Admitted++
			took = append(took, r.took)
			continue
		}
		if fig.Refused == nil {
			fig.Refused = map[string]int{}
		}
		fig.Refused[r.code]++
	}
	fig.Latency = report.Summarize(took).Ms()
	if fig.WallS > 0 {
		fig.RatePerS = float64(fig.Admitted) / fig.WallS
	}
	if fig.Admitted > 0 {
		fig.RelayCPUPer1000S = fig.RelayCPUS / float64(fig.Admitted) * 1000
	}
	var errs []string
	if statErr != nil {
		errs = append(errs, "relay CPU: "+statErr.Error())
	}
	if ctx.Err() != nil {
		errs = append(errs, fmt.Sprintf("storm not over in %v", cfg.Timeout))
	}
	fig.Err = strings.Join(errs, "; ")
	return fig
}

// codeName names a stream's failure by its gRPC code, or "timeout".
func codeName(err error) string {
	if errors.Is(err, context.DeadlineExceeded) || status.Code(err) == codes.DeadlineExceeded {
		return "timeout"
	}
	return status.Code(err).String()
}

// firstClusters returns, per group of up, the first cluster name it serves
// (what an admission stream asks for).
func firstClusters(up *upstream.Upstream) map[string]string {
	out := map[string]string{}
	for _, g := range up.Groups() {
		names := make([]string, 0)
		for n := range up.Snapshot(g)[envoy.ClusterType] {
			names = append(names, n)
		}
		slices.Sort(names)
		if len(names) > 0 {
			out[g] = names[0]
		}
	}
	return out
}
