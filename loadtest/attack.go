package loadtest

// The benchmark of issue 31: a real `meshrelay serve` under one abuse at a
// time, while a good client keeps opening streams and times its admission.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// The rows of an attack run, in the order they run.
const (
	AttackBaseline     = "baseline"
	AttackValidFlood   = "valid-token-flood"
	AttackNoTokenFlood = "no-token-flood"
	AttackSNAT         = "snat-bad-tokens"
	AttackLarge        = "large-requests"
	AttackMillionNames = "million-names"
	AttackHandshakes   = "handshakes"
)

// AttackNames are every row of an attack run, in order.
var AttackNames = []string{AttackBaseline, AttackValidFlood, AttackNoTokenFlood, AttackSNAT, AttackLarge, AttackMillionNames, AttackHandshakes}

// The loopback addresses the clients dial from. The good client shares
// goodSource with the SNAT attack's flood.
var (
	goodSource  = net.IPv4(127, 0, 0, 2)
	floodSource = net.IPv4(127, 0, 0, 10)
	largeSource = net.IPv4(127, 0, 0, 11)
	// relaySource is where the relay listens.
	relaySource = net.IPv4(127, 0, 0, 3)
)

// The identities (keys of the scenario: namespace key%Namespaces) of the
// good client, the valid-token flood and the large requests.
const (
	floodKey = 0
	goodKey  = 1
	largeKey = 2
)

// AttackBinary is a meshrelay binary to attack, named in the report.
type AttackBinary struct {
	Label string `json:"label"`
	Path  string `json:"path"`
}

// AttackConfig is `loadtest attack`: for each binary, a fresh relay per
// row (so that each row's peak RSS is its own), the row's attack for
// Duration, and a good client opening a stream every GoodInterval.
type AttackConfig struct {
	// Binaries are run one after another, each through every row.
	Binaries []AttackBinary
	// Attacks are the rows to run (AttackNames; nil: all).
	Attacks []string
	// Scenario is the synthetic upstream's; Namespaces must be at least 3
	// (the good client, the flood and the large requests are apart).
	Scenario upstream.Scenario
	// Duration is how long each row's attack and good client run.
	// Default 15s.
	Duration time.Duration
	// GoodInterval is how often the good client opens a stream (default
	// 50ms); GoodTimeout bounds one of its attempts (default 10s).
	GoodInterval, GoodTimeout time.Duration
	// Flooders are the goroutines of each flood. Default 32.
	Flooders int
	// LargeStreams are the parallel streams of the large requests and of
	// the million names. Default 4.
	LargeStreams int
	// LargeBytes is the size of a large request; 0: just under the
	// binary's receive limit (--max-request-bytes, or --max-msg-size where
	// it has none), at most LargeCap (default 200,000,000).
	LargeBytes, LargeCap int
	// LargeEntries is how many initial_resource_versions a large request
	// declares (its versions are padded to reach its size). Default 100,000.
	LargeEntries int
	// MillionNames is how many names the million-names request
	// subscribes to. Default 1,000,000.
	MillionNames int
	// Handshakes and HandshakeConcurrency are the handshakes row's streams
	// (each a new TLS connection and token) and how many at once.
	// Defaults 1,000 and 8.
	Handshakes, HandshakeConcurrency int
	// RSSLimit stops an attack (SIGKILL to the relay) whose relay's RSS
	// passes it. Default 8 GiB.
	RSSLimit uint64
	// RelayArgs are added to every relay's `meshrelay serve` flags.
	RelayArgs []string
	// RelayLog receives the relays' stderr (nil: discarded).
	RelayLog io.Writer
	// Dir holds the credentials' files. Required.
	Dir string
}

// DefaultAttackConfig returns the run issue 31 asks for (about 2 minutes
// a binary).
func DefaultAttackConfig() AttackConfig {
	return AttackConfig{
		Scenario:     upstream.Scenario{Services: 100, Endpoints: 100, Namespaces: 4, LocalFraction: 0.25},
		Duration:     15 * time.Second,
		GoodInterval: 50 * time.Millisecond, GoodTimeout: 10 * time.Second,
		Flooders: 32, LargeStreams: 4, LargeCap: 200_000_000, LargeEntries: 100_000, MillionNames: 1_000_000,
		Handshakes: 1000, HandshakeConcurrency: 8, RSSLimit: 8 << 30,
	}
}

// AttackReport is what `loadtest attack` measured, per binary.
type AttackReport struct {
	Machine  report.Machine `json:"machine"`
	MemTotal uint64         `json:"mem_total_bytes"`
	Duration string         `json:"attack_duration"`
	RSSLimit uint64         `json:"rss_limit_bytes"`
	Runs     []AttackRun    `json:"runs"`
}

// AttackRun is one binary's rows.
type AttackRun struct {
	AttackBinary
	// LargeBytes is the size of its large requests.
	LargeBytes int         `json:"large_bytes"`
	Rows       []AttackRow `json:"rows"`
}

// AttackRow is one attack against a fresh relay.
type AttackRow struct {
	Name string `json:"name"`
	// Good is the good client's stream open → first response, of the
	// attempts answered; GoodFailed the others by gRPC code.
	Good         report.LatencyMs `json:"good"`
	GoodAttempts int              `json:"good_attempts"`
	GoodFailed   map[string]int   `json:"good_failed,omitempty"`
	// RelayPeakRSS is the relay's VmHWM (or the largest VmRSS polled) at
	// the row's end; RelayCPUS its CPU time over the attack.
	RelayPeakRSS uint64  `json:"relay_peak_rss_bytes"`
	RelayCPUS    float64 `json:"relay_cpu_s"`
	// Attack counts the attack's streams: opened, answered, and refused
	// (or failed) by gRPC code.
	Attempts int64          `json:"attack_attempts"`
	Answered int64          `json:"attack_answered"`
	Refused  map[string]int `json:"attack_refused,omitempty"`
	// Stopped: the relay passed RSSLimit and was killed. Died: it exited
	// on its own during the row (how).
	Stopped bool   `json:"rss_limit_stopped,omitempty"`
	Died    string `json:"died,omitempty"`
	// Handshakes is the handshakes row's storm.
	Handshakes *AdmissionFigures `json:"handshakes,omitempty"`
	Err        string            `json:"error,omitempty"`
}

// codes counts outcomes by name. Safe for concurrent use.
type codeCounter struct {
	mu       sync.Mutex
	attempts int64
	answered int64
	by       map[string]int
}

func (c *codeCounter) add(code string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.attempts++
	if code == "" {
		c.answered++
		return
	}
	if c.by == nil {
		c.by = map[string]int{}
	}
	c.by[code]++
}

// attackEnv is what every row shares: the upstream, the credentials, the
// tokens.
type attackEnv struct {
	cfg      AttackConfig
	creds    *MeshCredentials
	upAddr   string
	names    map[string]string
	expired  []string // the SNAT flood's tokens, each expired
	pod      atomic.Int64
	bigBody  []byte // a large request's initial_resource_versions (built for bigSize)
	bigSize  int
	manyBody []byte // the million-names request's subscriptions
}

// RunAttack runs cfg and prints each row to out as it ends. It stops every
// process it started before it returns, also on failure.
func RunAttack(ctx context.Context, cfg AttackConfig, out io.Writer) (*AttackReport, error) {
	def := DefaultAttackConfig()
	if cfg.Scenario.Namespaces < 3 || cfg.Scenario.Services < cfg.Scenario.Namespaces {
		return nil, fmt.Errorf("loadtest: attack: want at least 3 namespaces and a service in each, got %d and %d", cfg.Scenario.Namespaces, cfg.Scenario.Services)
	}
	if len(cfg.Binaries) == 0 || cfg.Dir == "" {
		return nil, errors.New("loadtest: attack: field Binaries or Dir is empty")
	}
	setDefault(&cfg.Duration, def.Duration)
	setDefault(&cfg.GoodInterval, def.GoodInterval)
	setDefault(&cfg.GoodTimeout, def.GoodTimeout)
	setDefault(&cfg.Flooders, def.Flooders)
	setDefault(&cfg.LargeStreams, def.LargeStreams)
	setDefault(&cfg.LargeCap, def.LargeCap)
	setDefault(&cfg.LargeEntries, def.LargeEntries)
	setDefault(&cfg.MillionNames, def.MillionNames)
	setDefault(&cfg.Handshakes, def.Handshakes)
	setDefault(&cfg.HandshakeConcurrency, def.HandshakeConcurrency)
	setDefault(&cfg.RSSLimit, def.RSSLimit)
	if len(cfg.Attacks) == 0 {
		cfg.Attacks = AttackNames
	}
	for _, a := range cfg.Attacks {
		if !slices.Contains(AttackNames, a) {
			return nil, fmt.Errorf("loadtest: attack: unknown attack %q (want %s)", a, strings.Join(AttackNames, ", "))
		}
	}

	creds, err := NewMeshCredentials(cfg.Dir)
	if err != nil {
		return nil, err
	}
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario, ucfg.Listen = cfg.Scenario, "127.0.0.1:0"
	up, err := upstream.Start(ctx, ucfg)
	if err != nil {
		return nil, err
	}
	defer up.Stop(context.WithoutCancel(ctx))

	env := &attackEnv{cfg: cfg, creds: creds, upAddr: up.Addr(), names: firstClusters(up)}
	goodNode := traffic.KeyNode(cfg.Scenario, goodKey, 0)
	ns, sa := nodeAccount(goodNode)
	for i := range 64 {
		tok, err := creds.issuer.Make(authtest.Token{Namespace: ns, ServiceAccount: sa, Audiences: []string{tokenAudience},
			IssuedAt: time.Now().Add(-2*time.Hour - time.Duration(i)*time.Second), TTL: time.Hour})
		if err != nil {
			return nil, fmt.Errorf("loadtest: attack: sign an expired token: %w", err)
		}
		env.expired = append(env.expired, tok)
	}
	if slices.Contains(cfg.Attacks, AttackMillionNames) {
		env.manyBody = manyNamesBody(cfg.MillionNames)
	}

	rep := &AttackReport{Machine: report.ThisMachine(), MemTotal: memTotal(), Duration: cfg.Duration.String(), RSSLimit: cfg.RSSLimit}
	for _, bin := range cfg.Binaries {
		run := AttackRun{AttackBinary: bin}
		if slices.Contains(cfg.Attacks, AttackLarge) {
			if run.LargeBytes = cfg.LargeBytes; run.LargeBytes <= 0 {
				limit, err := receiveLimit(ctx, bin.Path)
				if err != nil {
					return rep, err
				}
				run.LargeBytes = min(limit-4096, cfg.LargeCap)
			}
		}
		fmt.Fprintf(out, "%s (%s): large requests of %d bytes\n", bin.Label, bin.Path, run.LargeBytes)
		for _, name := range cfg.Attacks {
			row := env.runRow(ctx, bin, name, run.LargeBytes)
			fmt.Fprintf(out, "  %-18s %s\n", name, row.line())
			run.Rows = append(run.Rows, row)
			if ctx.Err() != nil {
				rep.Runs = append(rep.Runs, run)
				return rep, ctx.Err()
			}
		}
		rep.Runs = append(rep.Runs, run)
	}
	return rep, nil
}

func setDefault[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}

// line is a row in one line, for the progress output.
func (r AttackRow) line() string {
	s := fmt.Sprintf("good P50 %.1f P99 %.1f max %.1f ms, failed %d/%d; relay peak RSS %d MiB, CPU %.1f s; attack %d answered of %d %v",
		r.Good.P50, r.Good.P99, r.Good.Max, failedCount(r.GoodFailed), r.GoodAttempts, r.RelayPeakRSS>>20, r.RelayCPUS, r.Answered, r.Attempts, r.Refused)
	if r.Stopped {
		s += "; STOPPED past the RSS limit"
	}
	if r.Died != "" {
		s += "; relay DIED: " + r.Died
	}
	if r.Err != "" {
		s += "; error: " + r.Err
	}
	return s
}

func failedCount(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// receiveLimit is the largest request bin's serve takes from an Envoy, from
// its --help: --max-request-bytes, or --max-msg-size where it has none.
func receiveLimit(ctx context.Context, bin string) (int, error) {
	b, _ := exec.CommandContext(ctx, bin, "serve", "--help").CombinedOutput() // --help exits 0 or 2
	for _, flag := range []string{"max-request-bytes", "max-msg-size"} {
		m := regexp.MustCompile(`--` + flag + ` int .*\(default (\d+)\)`).FindSubmatch(b)
		if m != nil {
			return strconv.Atoi(string(m[1]))
		}
	}
	return 0, fmt.Errorf("loadtest: attack: %s serve --help names neither --max-request-bytes nor --max-msg-size", bin)
}

// memTotal is the machine's memory (MemTotal), 0 if unknown.
func memTotal() uint64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			n, _ := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n << 10
		}
	}
	return 0
}

// relayListenAddr returns a port of relaySource nothing listens on now
// (an address of its own: on 127.0.0.1 another process's outgoing
// connection may take the port as its local one before the relay binds it).
func relayListenAddr() (string, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(relaySource.String(), "0"))
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// startRelay starts bin's `meshrelay serve` on a TLS port of its own,
// checking service-account tokens against the mesh's issuer, relaying
// the upstream.
func (e *attackEnv) startRelay(ctx context.Context, bin AttackBinary) (*Child, error) {
	addr, err := relayListenAddr()
	if err != nil {
		return nil, err
	}
	args := []string{"serve", "--id", "attack-relay", "--xds-listen=", "--xds-tls-listen", addr,
		"--xds-tls-cert", e.creds.certFile, "--xds-tls-key", e.creds.keyFile, "--xds-auth", "jwt",
		"--jwt-verifier", "local", "--jwt-issuer", e.creds.issuer.URL, "--jwt-jwks-file", e.creds.jwksFile,
		"--upstream", e.upAddr, "--upstream-auth", "plaintext", "--gossip-listen=", "--admin-listen=",
		"--drain-period", "0s", "--log-level", "error"}
	return StartChild(ctx, ChildConfig{Path: bin.Path, Args: append(args, e.cfg.RelayArgs...), Stderr: e.cfg.RelayLog, Addr: addr})
}

// runRow runs one row against a fresh relay of bin, and stops it.
func (e *attackEnv) runRow(ctx context.Context, bin AttackBinary, name string, largeBytes int) (row AttackRow) {
	row.Name = name
	relay, err := e.startRelay(ctx, bin)
	if err != nil {
		row.Err = err.Error()
		return row
	}
	defer func() {
		stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := relay.Stop(stopCtx); err != nil && row.Died == "" && !row.Stopped {
			row.Err = strings.TrimPrefix(row.Err+"; stop: "+err.Error(), "; ")
		}
	}()
	// The relay takes streams once it has reached the upstream.
	warm := false
	for i := 0; i < 60 && !warm && ctx.Err() == nil; i++ {
		warm = e.goodAttempt(ctx, relay.Addr()) == ""
		if !warm {
			traffic.SleepCtx(ctx, 250*time.Millisecond)
		}
	}
	if !warm {
		row.Err = "the relay answered no good stream in 15 s"
		return row
	}
	before, err := relay.Stat()
	if err != nil {
		row.Err = err.Error()
		return row
	}

	actx, stopAttack := context.WithCancel(ctx)
	defer stopAttack()
	var last ProcStat
	var mu sync.Mutex // guards row.Stopped, row.Died, last
	watched := make(chan struct{})
	go func() { // the relay's memory, every 100 ms, and its fate
		defer close(watched)
		for {
			select {
			case <-relay.Exited():
				mu.Lock()
				if !row.Stopped {
					row.Died = fmt.Sprintf("exited during the attack: %v", relay.exitErr())
				}
				mu.Unlock()
				stopAttack()
				return
			case <-actx.Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
			ps, err := relay.Stat()
			if err != nil {
				continue
			}
			mu.Lock()
			last = ps
			over := ps.RSS > e.cfg.RSSLimit
			if over {
				row.Stopped = true
				last.PeakRSS = max(last.PeakRSS, ps.RSS)
			}
			mu.Unlock()
			if over {
				stopAttack()
				relay.Kill()
				return
			}
		}
	}()

	var counter codeCounter
	var attackers sync.WaitGroup
	var good goodResults
	if name == AttackHandshakes {
		fig := RunAdmission(actx, AdmissionConfig{Target: relay.Addr(), Creds: e.creds, Scenario: e.cfg.Scenario,
			Keys: e.cfg.Scenario.Namespaces, FirstPod: int(e.pod.Add(int64(e.cfg.Handshakes))), Names: e.names,
			Streams: e.cfg.Handshakes, Concurrency: e.cfg.HandshakeConcurrency, Timeout: 4 * e.cfg.Duration, Stat: relay.Stat})
		row.Handshakes = &fig
		row.Attempts, row.Answered = int64(fig.Streams), int64(fig.Admitted)
		row.Refused = fig.Refused
	} else {
		e.startAttack(actx, &attackers, &counter, name, relay.Addr(), largeBytes)
		good = e.runGood(actx, relay.Addr())
	}
	stopAttack()
	attackers.Wait()
	<-watched

	mu.Lock()
	defer mu.Unlock()
	if row.Died == "" && !row.Stopped {
		if ps, err := relay.Stat(); err == nil {
			last = ps
		}
	}
	row.RelayPeakRSS = last.PeakRSS
	if last.CPU > 0 {
		row.RelayCPUS = (last.CPU - before.CPU).Seconds()
	}
	if name != AttackHandshakes {
		row.Good = report.Summarize(good.took).Ms()
		row.GoodAttempts, row.GoodFailed = good.attempts, good.failed
		row.Attempts, row.Answered, row.Refused = counter.attempts, counter.answered, counter.by
	}
	return row
}

// goodResults are the good client's attempts.
type goodResults struct {
	attempts int
	took     []time.Duration
	failed   map[string]int
}

// runGood opens a good stream every GoodInterval for Duration (or until
// ctx ends), each on a new connection from goodSource, and waits for the
// last.
func (e *attackEnv) runGood(ctx context.Context, target string) goodResults {
	n := int(e.cfg.Duration / e.cfg.GoodInterval)
	type result struct {
		took time.Duration
		code string
	}
	results := make([]result, n)
	var wg sync.WaitGroup
	tick := time.NewTicker(e.cfg.GoodInterval)
	defer tick.Stop()
	started := 0
	for ; started < n; started++ {
		if started > 0 {
			select {
			case <-ctx.Done():
			case <-tick.C:
			}
		}
		if ctx.Err() != nil {
			break
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			var r result
			r.code = e.goodAttemptTimed(ctx, target, &r.took)
			results[i] = r
		}(started)
	}
	wg.Wait()
	g := goodResults{attempts: started}
	for _, r := range results[:started] {
		if r.code == "" {
			g.took = append(g.took, r.took)
			continue
		}
		if g.failed == nil {
			g.failed = map[string]int{}
		}
		g.failed[r.code]++
	}
	return g
}

func (e *attackEnv) goodAttempt(ctx context.Context, target string) string {
	var took time.Duration
	return e.goodAttemptTimed(ctx, target, &took)
}

// goodAttemptTimed is one good stream: a new Envoy of goodKey on a new
// TLS connection from goodSource, with its token; took is stream open →
// first response.
func (e *attackEnv) goodAttemptTimed(ctx context.Context, target string, took *time.Duration) string {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.GoodTimeout)
	defer cancel()
	conn, err := e.dial(target, goodSource, 0)
	if err != nil {
		return "dial"
	}
	defer conn.Close()
	node := traffic.KeyNode(e.cfg.Scenario, goodKey, int(e.pod.Add(1)))
	tok, err := e.creds.nodeToken(node)
	if err != nil {
		return "token"
	}
	start := time.Now()
	code := e.stream(ctx, conn, tok, node)
	*took = time.Since(start)
	return code
}

// dial makes a TLS client connection to target from the loopback address
// from (nil: any), taking responses up to maxRecv bytes (0: gRPC's 4 MB).
func (e *attackEnv) dial(target string, from net.IP, maxRecv int) (*grpc.ClientConn, error) {
	opts := []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(e.creds.ClientTLS())),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: from}, Control: bindNoPort}
			return d.DialContext(ctx, "tcp", addr)
		})}
	if maxRecv > 0 {
		opts = append(opts, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxRecv)))
	}
	return grpc.NewClient("passthrough:///"+target, opts...)
}

// stream opens a Delta stream on conn presenting tok ("": none) for node,
// asks for one cluster of its group and waits for the first response. It
// returns "" if answered, else the gRPC code (or "timeout").
func (e *attackEnv) stream(ctx context.Context, conn *grpc.ClientConn, tok string, node *core.Node) string {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if tok != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		return codeName(err)
	}
	_ = st.Send(&discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: envoy.ClusterType,
		ResourceNamesSubscribe: []string{e.names[e.cfg.Scenario.Group(node)]}})
	if _, err := st.Recv(); err != nil {
		return codeName(err)
	}
	return ""
}

// startAttack starts name's goroutines on wg; they run until ctx ends.
func (e *attackEnv) startAttack(ctx context.Context, wg *sync.WaitGroup, c *codeCounter, name, target string, largeBytes int) {
	loop := func(one func() string) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				code := one()
				if ctx.Err() == nil { // an attempt the row's end cut is not counted
					c.add(code)
				}
			}
		}()
	}
	switch name {
	case AttackBaseline:
	case AttackValidFlood:
		// One identity, as fast as it can: streams on shared connections
		// (16 goroutines a connection), each closed once answered.
		node0 := traffic.KeyNode(e.cfg.Scenario, floodKey, 0)
		tok, _ := e.creds.nodeToken(node0)
		var shared *grpc.ClientConn
		for i := range e.cfg.Flooders {
			if i%16 == 0 {
				var err error
				if shared, err = e.dial(target, floodSource, 0); err != nil {
					c.add("dial")
					return
				}
				wg.Add(1)
				go func(conn *grpc.ClientConn) { defer wg.Done(); <-ctx.Done(); conn.Close() }(shared)
			}
			conn := shared
			loop(func() string {
				return e.stream(ctx, conn, tok, traffic.KeyNode(e.cfg.Scenario, floodKey, int(e.pod.Add(1))))
			})
		}
	case AttackNoTokenFlood, AttackSNAT:
		// A new connection per stream: from a new address and without a
		// token, or from the good client's address with an expired token.
		var next atomic.Int64
		for range e.cfg.Flooders {
			loop(func() string {
				i := next.Add(1)
				from, tok := goodSource, e.expired[int(i)%len(e.expired)]
				if name == AttackNoTokenFlood {
					from, tok = net.IPv4(127, byte(1+i>>16&0x7f), byte(i>>8), byte(i)), ""
				}
				conn, err := e.dial(target, from, 0)
				if err != nil {
					return "dial"
				}
				defer conn.Close()
				return e.stream(ctx, conn, tok, traffic.KeyNode(e.cfg.Scenario, goodKey, int(e.pod.Add(1))))
			})
		}
	case AttackLarge, AttackMillionNames:
		body := e.manyBody
		if name == AttackLarge {
			body = e.largeBody(largeBytes)
		}
		node0 := traffic.KeyNode(e.cfg.Scenario, largeKey, 0)
		tok, _ := e.creds.nodeToken(node0)
		for range e.cfg.LargeStreams {
			conn, err := e.dial(target, largeSource, 1<<30)
			if err != nil {
				c.add("dial")
				return
			}
			wg.Add(1)
			go func() { defer wg.Done(); <-ctx.Done(); conn.Close() }()
			loop(func() string {
				node := traffic.KeyNode(e.cfg.Scenario, largeKey, int(e.pod.Add(1)))
				return e.rawStream(ctx, conn, tok, node, body)
			})
		}
	}
}

// rawStream is stream with a request whose encoding ends in body (fields
// of a DeltaDiscoveryRequest, encoded once for every stream).
func (e *attackEnv) rawStream(ctx context.Context, conn *grpc.ClientConn, tok string, node *core.Node, body []byte) string {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	st, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true},
		"/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources", grpc.ForceCodecV2(partsCodec{}))
	if err != nil {
		return codeName(err)
	}
	head, err := proto.Marshal(&discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: envoy.ClusterType,
		ResourceNamesSubscribe: []string{e.names[e.cfg.Scenario.Group(node)]}})
	if err != nil {
		return "marshal"
	}
	_ = st.SendMsg(encodedParts{head, body})
	if err := st.RecvMsg(new(discovery.DeltaDiscoveryResponse)); err != nil {
		return codeName(err)
	}
	return ""
}

// largeBody is the initial_resource_versions of a Delta request of about
// size bytes: LargeEntries Istio-shaped cluster names, each version padded
// so that the entries fill size. Built once per size.
func (e *attackEnv) largeBody(size int) []byte {
	if e.bigSize == size && e.bigBody != nil {
		return e.bigBody
	}
	e.bigBody, e.bigSize = nil, size // free the last one first
	n := max(1, e.cfg.LargeEntries)
	name := func(i int) string { return fmt.Sprintf("outbound|8080||svc-%07d.ns-%03d.svc.cluster.local", i, i%1000) }
	// An entry: tag, length, key field (tag, length, name), value field
	// (tag, length, version); lengths of up to 3 bytes below 2 MiB.
	per := size/n - len(name(0)) - 2 - 2 - 3 - 3 - 2
	version := strings.Repeat("v", max(1, per))
	b := make([]byte, 0, size+n*8)
	for i := range n {
		var entry []byte
		entry = protowire.AppendTag(entry, 1, protowire.BytesType)
		entry = protowire.AppendString(entry, name(i))
		entry = protowire.AppendTag(entry, 2, protowire.BytesType)
		entry = protowire.AppendString(entry, version)
		b = protowire.AppendTag(b, 5, protowire.BytesType)
		b = protowire.AppendBytes(b, entry)
	}
	e.bigBody = b
	return b
}

// manyNamesBody is resource_names_subscribe of n distinct short names.
func manyNamesBody(n int) []byte {
	var b []byte
	for i := range n {
		b = protowire.AppendTag(b, 3, protowire.BytesType)
		b = protowire.AppendString(b, "c"+strconv.Itoa(i))
	}
	return b
}

// encodedParts is a request already encoded, in parts sent back to back.
type encodedParts [][]byte

// partsCodec sends encodedPartss as they are and decodes responses as
// protobuf: a large request is encoded once, not once per stream.
type partsCodec struct{}

var _ encoding.CodecV2 = partsCodec{}

func (partsCodec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(encodedParts)
	if !ok {
		return nil, fmt.Errorf("loadtest: raw codec: cannot send %T", v)
	}
	out := make(mem.BufferSlice, 0, len(m))
	for _, p := range m {
		out = append(out, mem.SliceBuffer(p))
	}
	return out, nil
}

func (partsCodec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("loadtest: raw codec: cannot decode into %T", v)
	}
	return proto.Unmarshal(data.Materialize(), m)
}

// Name is "proto": the server decodes the request as any other.
func (partsCodec) Name() string { return "proto" }

// WriteTable writes r as a Markdown table: a row per attack and figure, a
// column per binary (before → after when two).
func (r *AttackReport) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "| attack | figure |")
	for _, run := range r.Runs {
		fmt.Fprintf(w, " %s |", run.Label)
	}
	fmt.Fprintf(w, "\n|---|---|%s\n", strings.Repeat("---:|", len(r.Runs)))
	cell := func(name string, f func(AttackRun, AttackRow) string) string {
		var b strings.Builder
		for _, run := range r.Runs {
			s := "-"
			for _, row := range run.Rows {
				if row.Name == name {
					s = f(run, row)
				}
			}
			fmt.Fprintf(&b, " %s |", s)
		}
		return b.String()
	}
	var names []string
	for _, run := range r.Runs {
		for _, row := range run.Rows {
			if !slices.Contains(names, row.Name) {
				names = append(names, row.Name)
			}
		}
	}
	for _, name := range names {
		line := func(figure string, f func(AttackRun, AttackRow) string) {
			fmt.Fprintf(w, "| %s | %s |%s\n", name, figure, cell(name, f))
		}
		if name == AttackHandshakes {
			line("streams admitted / s (bounded by --admit-rate)", func(_ AttackRun, row AttackRow) string {
				if row.Handshakes == nil {
					return "-"
				}
				return fmt.Sprintf("%.0f (%d of %d%s)", row.Handshakes.RatePerS, row.Handshakes.Admitted, row.Handshakes.Streams, codesText(row.Handshakes.Refused))
			})
			line("dial → answer P50 / P99 ms", func(_ AttackRun, row AttackRow) string {
				if row.Handshakes == nil {
					return "-"
				}
				return fmt.Sprintf("%.1f / %.1f", row.Handshakes.Latency.P50, row.Handshakes.Latency.P99)
			})
			line("relay CPU s per 1,000 admitted", func(_ AttackRun, row AttackRow) string {
				if row.Handshakes == nil {
					return "-"
				}
				return fmt.Sprintf("%.2f", row.Handshakes.RelayCPUPer1000S)
			})
			line("relay peak RSS MiB", func(_ AttackRun, row AttackRow) string { return rssText(row, r.RSSLimit) })
			continue
		}
		line("good admission P50 / P99 / max ms", func(_ AttackRun, row AttackRow) string {
			if row.Good.N == 0 {
				return "none answered"
			}
			return fmt.Sprintf("%.1f / %.1f / %.1f", row.Good.P50, row.Good.P99, row.Good.Max)
		})
		line("good failed / attempts", func(_ AttackRun, row AttackRow) string {
			return fmt.Sprintf("%d / %d%s", failedCount(row.GoodFailed), row.GoodAttempts, codesText(row.GoodFailed))
		})
		line("relay peak RSS MiB", func(_ AttackRun, row AttackRow) string { return rssText(row, r.RSSLimit) })
		line("relay CPU s", func(_ AttackRun, row AttackRow) string { return fmt.Sprintf("%.1f", row.RelayCPUS) })
		if name != AttackBaseline {
			line("attack streams answered / opened", func(run AttackRun, row AttackRow) string {
				s := fmt.Sprintf("%d / %d%s", row.Answered, row.Attempts, codesText(row.Refused))
				if name == AttackLarge {
					s += fmt.Sprintf(", %.1f MB each", float64(run.LargeBytes)/1e6)
				}
				return s
			})
		}
	}
}

// rssText is a row's peak RSS, or what became of the relay.
func rssText(row AttackRow, limit uint64) string {
	switch {
	case row.Err != "" && row.RelayPeakRSS == 0:
		return "error: " + row.Err
	case row.Stopped:
		return fmt.Sprintf(">%d MiB, stopped", limit>>20)
	case row.Died != "":
		return fmt.Sprintf("%d (relay died: %s)", row.RelayPeakRSS>>20, row.Died)
	}
	return strconv.FormatUint(row.RelayPeakRSS>>20, 10)
}

// codesText is " (Code n, …)" of a count by code, sorted; "" if none.
func codesText(m map[string]int) string {
	if len(m) == 0 {
		return ""
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return " (" + strings.Join(parts, ", ") + ")"
}
