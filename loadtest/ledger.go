package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/shard"
)

// LedgerConfig configures RunLedger.
type LedgerConfig struct {
	// Relays share the Envoys for the tier-wide queries. Default 3.
	Relays int
	// Envoys and Keys: the fleet the ledger tracks. Defaults 10,000 and 100.
	Envoys, Keys int
	// Resources in every key's view, half clusters and half endpoints
	// (every key sees every service, as without Sidecar scoping). Default
	// 60,000.
	Resources int
	// Versions of history kept per key: endpoint changes recorded before
	// the measures. Default 1,000.
	Versions int
	// Queries is how many times each query is timed. Default 200.
	Queries int
	// StartPeer, if set, runs relays 1… of the tier each in a process of
	// its own, as in production (cmd/loadtest passes ExecLedgerPeer with
	// --peers-apart); relay 0, which is asked, stays in this one. Nil:
	// every relay runs in this process (one collector marks all their
	// heaps, but on two cores three processes contend more than that).
	StartPeer func(ctx context.Context, cfg LedgerPeerConfig) (*Child, error) `json:"-"`
}

// LedgerPeerConfig is one relay of RunLedger's tier in a process of its
// own: relay Index of Relays, holding its share of the Envoys.
type LedgerPeerConfig struct {
	Index                                     int
	Relays, Envoys, Keys, Resources, Versions int
}

// Args renders c as ledger-child flags.
func (c LedgerPeerConfig) Args() []string {
	return []string{"--index", fmt.Sprint(c.Index), "--relays", fmt.Sprint(c.Relays), "--envoys", fmt.Sprint(c.Envoys),
		"--keys", fmt.Sprint(c.Keys), "--resources", fmt.Sprint(c.Resources), "--versions", fmt.Sprint(c.Versions)}
}

// ExecLedgerPeer returns a StartPeer that runs path with args followed by
// the peer's flags; cmd/loadtest passes its own executable and
// "ledger-child".
func ExecLedgerPeer(path string, stderr io.Writer, args ...string) func(context.Context, LedgerPeerConfig) (*Child, error) {
	return func(ctx context.Context, cfg LedgerPeerConfig) (*Child, error) {
		return StartChild(ctx, ChildConfig{Path: path, Args: append(slices.Clone(args), cfg.Args()...), Stderr: stderr, ReadyTimeout: 2 * time.Minute})
	}
}

// RunLedgerChild runs one relay of RunLedger's tier: it builds the same
// views, tracks its share of the Envoys, prints "xds <addr>" on out and
// serves its ledger until ctx ends or in reaches EOF (the parent is gone).
func RunLedgerChild(ctx context.Context, cfg LedgerPeerConfig, in io.Reader, out io.Writer) error {
	lcfg := LedgerConfig{Relays: cfg.Relays, Envoys: cfg.Envoys, Keys: cfg.Keys, Resources: cfg.Resources, Versions: cfg.Versions}
	views := buildLedgerViews(lcfg)
	node, err := startLedgerRelay(ctx, cfg.Index, nil)
	if err != nil {
		return err
	}
	defer node.Stop(context.Background())
	r := node.Relay()
	if err := views.populate(r, lcfg, ledgerKeys(cfg.Keys), cfg.Index); err != nil {
		return err
	}
	return serveChild(ctx, r.Addr().String(), in, out, nil)
}

func ledgerKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("sidecar/ns-%d/wl-%d#%04x", i%10, i/10, i)
	}
	return keys
}

// populate gives relay i of the tier the histories of every key (it is
// the origin of one key in Relays) and its share of the Envoys.
func (v *ledgerViews) populate(r *relay.Relay, cfg LedgerConfig, keys []string, i int) error {
	origin := func(key string) bool { return slices.Index(keys, key)%cfg.Relays == i }
	if err := v.record(r.Ledger(), keys, origin); err != nil {
		return err
	}
	from, to := i*cfg.Envoys/cfg.Relays, (i+1)*cfg.Envoys/cfg.Relays
	v.connect(r.Ledger(), keys, from, to-from)
	return nil
}

// DefaultLedgerConfig is what `loadtest ledger` runs with no flags.
func DefaultLedgerConfig() LedgerConfig {
	return LedgerConfig{Relays: 3, Envoys: 10_000, Keys: 100, Resources: 60_000, Versions: 1000, Queries: 200}
}

// LedgerReport is what RunLedger measured.
type LedgerReport struct {
	Date    string         `json:"date"`
	Machine report.Machine `json:"machine"`
	Config  LedgerConfig   `json:"config"`

	// ACK bookkeeping on one relay's ledger, per call: Answered alone, and
	// a whole response (Sent, Synced, Answered).
	ACKNanos      float64 `json:"ack_ns"`
	ResponseNanos float64 `json:"response_ns"`
	// Convergence on one relay holding every Envoy (in-process), and the
	// same from a full Summary (what a relay sends its peers).
	Convergence Quantiles `json:"convergence"`
	Summary     Quantiles `json:"summary"`
	// Tier-wide, asked of one relay, gathered from all over loopback gRPC:
	// convergence and stragglers in brief (ledger.Brief: what relayctl
	// wait, convergence and shards ask), the same in full (every time of
	// every Envoy's types: proxy-status's full view), and delivery of one
	// resource. The CPU is every relay's, per query (this process's and,
	// with PeersApart, the others').
	Tier            Quantiles     `json:"tier"`
	TierCPU         time.Duration `json:"tier_cpu"`
	TierFull        Quantiles     `json:"tier_full"`
	TierFullCPU     time.Duration `json:"tier_full_cpu"`
	TierDelivery    Quantiles     `json:"tier_delivery"`
	TierDeliveryCPU time.Duration `json:"tier_delivery_cpu"`
	// LedgerBytes is the heap the ledger holds: histories (undo records and
	// versions) and per-Envoy state, not the views it shares with the
	// cache.
	LedgerBytes     int64 `json:"ledger_bytes"`
	HistoryVersions int   `json:"history_versions"`
	HistoryChanges  int   `json:"history_changes"`

	Stragglers int `json:"stragglers"`
	// PeersApart is set when the relays other than the one asked ran each
	// in a process of its own.
	PeersApart bool `json:"peers_apart"`
	// TierEnvoys and TierStragglers are what the tier-wide query counted.
	TierEnvoys     int `json:"tier_envoys"`
	TierStragglers int `json:"tier_stragglers"`

	Targets LedgerTargets `json:"targets"`
}

// Quantiles of a timed query.
type Quantiles struct {
	P50 time.Duration `json:"p50"`
	P99 time.Duration `json:"p99"`
}

// LedgerTargets are issue 5's goals, each with whether it was met.
type LedgerTargets struct {
	ACK         bool `json:"ack_le_2us"`
	Convergence bool `json:"convergence_p99_le_1ms"`
	TierP50     bool `json:"tier_p50_le_20ms"`
	TierP99     bool `json:"tier_p99_le_20ms"`
	Memory      bool `json:"memory_le_64MiB"`
}

const (
	ledgerCDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	ledgerEDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
)

// ledgerViews is the synthetic config: one tree per type, then Versions
// endpoint changes, every tree kept (the relay's cache would hold them;
// they are not the ledger's memory).
type ledgerViews struct {
	cds   ledger.Tree[struct{}]
	eds   []ledger.Tree[struct{}] // eds[0] before any change
	moved string                  // the name the last change moved
	at    []time.Time
}

func buildLedgerViews(cfg LedgerConfig) *ledgerViews {
	half := cfg.Resources / 2
	name := func(i int) string { return fmt.Sprintf("outbound|80||svc-%d.ns-%d.svc.cluster.local", i, i%50) }
	cb, eb := ledger.Tree[struct{}]{}.Edit(), ledger.Tree[struct{}]{}.Edit()
	for i := range half {
		cb.Set(name(i), ledger.HashBytes([]byte("cluster "+name(i))), struct{}{})
		eb.Set(name(i), ledger.HashBytes([]byte("endpoints 0 "+name(i))), struct{}{})
	}
	v := &ledgerViews{cds: cb.Tree(), eds: []ledger.Tree[struct{}]{eb.Tree()}}
	t0 := time.Now().Add(-time.Duration(cfg.Versions) * time.Second)
	v.at = append(v.at, t0)
	for i := 1; i <= cfg.Versions; i++ {
		b := v.eds[i-1].Edit()
		v.moved = name((i * 7919) % half)
		b.Set(v.moved, ledger.HashBytes(fmt.Appendf(nil, "endpoints %d %s", i, v.moved)), struct{}{})
		v.eds = append(v.eds, b.Tree())
		v.at = append(v.at, t0.Add(time.Duration(i)*time.Second))
	}
	return v
}

// record gives tr the histories of every key, each with every version.
func (v *ledgerViews) record(tr *ledger.Tracker, keys []string, origin func(key string) bool) error {
	for _, key := range keys {
		cds, err := ledger.NewHistory[struct{}](ledger.DefaultHistoryConfig())
		if err != nil {
			return err
		}
		eds, _ := ledger.NewHistory[struct{}](ledger.DefaultHistoryConfig())
		cv, _ := cds.Record(v.cds, v.at[0], ledger.Order{})
		tr.Recorded(key, ledgerCDS, cds, cv)
		for i, t := range v.eds {
			ev, _ := eds.Record(t, v.at[i], ledger.Order{})
			tr.Recorded(key, ledgerEDS, eds, ev)
		}
		src := ledger.SourcePeer
		if origin(key) {
			src = ledger.SourceUpstream
		}
		tr.SetSource(key, src, false)
	}
	return nil
}

// connect tracks envoys Envoys of keys on tr (Envoy i of keys[i%len]), each
// synced and ACKed on both types, but for 1% that NACK and 1% that never
// answer the latest endpoints.
func (v *ledgerViews) connect(tr *ledger.Tracker, keys []string, first, envoys int) []*ledger.Envoy {
	now := time.Now()
	cdsRoot, edsRoot := v.cds.Root(), v.eds[len(v.eds)-1].Root()
	out := make([]*ledger.Envoy, 0, envoys)
	for i := first; i < first+envoys; i++ {
		e := tr.Connect(fmt.Sprintf("sidecar~10.%d.%d.%d~pod-%d.ns~ns.svc.cluster.local", i>>16&255, i>>8&255, i&255, i), keys[i%len(keys)], now)
		for _, t := range []struct {
			typeURL string
			root    ledger.Hash
		}{{ledgerCDS, cdsRoot}, {ledgerEDS, edsRoot}} {
			e.Subscribe(t.typeURL)
			e.Sent(t.typeURL, now)
			e.Synced(t.typeURL, t.root, now)
			switch {
			case t.typeURL == ledgerEDS && i%100 == 1:
				e.Answered(t.typeURL, ledger.Answer{Version: "v", Detail: fmt.Sprintf("endpoint 10.0.%d.%d:80 rejected", i>>8&255, i&255), Latest: true, At: now})
			case t.typeURL == ledgerEDS && i%100 == 2:
				// never answers
			default:
				e.Answered(t.typeURL, ledger.Answer{Version: "v", Latest: true, At: now})
			}
		}
		out = append(out, e)
	}
	return out
}

// staticPeers is a fixed tier for relay.Config.Tier.Peers.
type staticPeers struct {
	mu    sync.Mutex
	addrs []string
}

func (p *staticPeers) PeerAddrs() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.addrs)
}

// RunLedger measures the ledger at the scale of issue 5: ACK bookkeeping,
// the convergence query in-process, the tier-wide query across relays over
// gRPC, and the ledger's memory. The ledger is driven directly (Envoys are
// tracked through its API as a relay's streams would), so the figures are
// the ledger's own, not those of 10,000 simulated Envoys sharing the cores.
// Progress goes to out.
func RunLedger(ctx context.Context, cfg LedgerConfig, out io.Writer) (*LedgerReport, error) {
	if cfg.Relays < 1 || cfg.Envoys < 100 || cfg.Keys < 1 || cfg.Resources < 2 || cfg.Versions < 1 || cfg.Queries < 1 {
		return nil, errors.New("loadtest: ledger wants Relays ≥ 1, Envoys ≥ 100, Keys, Resources ≥ 2, Versions and Queries ≥ 1")
	}
	rep := &LedgerReport{
		Date: time.Now().UTC().Format(time.RFC3339), Config: cfg,
		Machine: report.ThisMachine(),
	}
	keys := ledgerKeys(cfg.Keys)
	fmt.Fprintf(out, "building %d resources and %d versions…\n", cfg.Resources, cfg.Versions)
	views := buildLedgerViews(cfg)

	// One relay's ledger holding every Envoy: memory, ACKs, convergence.
	base := heapInUse()
	tcfg := ledger.DefaultTrackerConfig()
	tcfg.Relay = "relay-0"
	hist := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "x", Buckets: prometheus.DefBuckets})
	tcfg.Converged = func(_ string, d time.Duration) { hist.Observe(d.Seconds()) }
	tr, err := ledger.NewTracker(tcfg)
	if err != nil {
		return nil, err
	}
	if err := views.record(tr, keys, func(string) bool { return true }); err != nil {
		return nil, err
	}
	envoys := views.connect(tr, keys, 0, cfg.Envoys)
	rep.LedgerBytes = heapInUse() - base
	for _, ks := range tr.Summary(ledger.Scope{Key: keys[0]}, time.Now(), ledger.Full).Keys {
		for _, tv := range ks.Types {
			if tv.Type == ledgerEDS {
				rep.HistoryVersions = cfg.Keys * int(tv.Version.Seq)
			}
		}
	}
	rep.HistoryChanges = cfg.Keys * cfg.Versions
	fmt.Fprintf(out, "ledger of %d Envoys over %d keys, %d versions each: %.1f MiB\n", cfg.Envoys, cfg.Keys, cfg.Versions, float64(rep.LedgerBytes)/(1<<20))

	// ACK bookkeeping: every Envoy sent, synced and ACKed again, timed as a
	// whole, then ACKs alone.
	root := views.eds[len(views.eds)-1].Root()
	prev := views.eds[len(views.eds)-2].Root()
	const rounds = 10
	var respTotal, ackTotal time.Duration
	for r := range rounds {
		target := root
		if r%2 == 0 {
			target = prev
		}
		start := time.Now()
		for _, e := range envoys {
			e.Sent(ledgerEDS, start)
			e.Synced(ledgerEDS, target, start)
		}
		mid := time.Now()
		for _, e := range envoys {
			e.Answered(ledgerEDS, ledger.Answer{Version: "v", Latest: true, At: mid})
		}
		end := time.Now()
		respTotal += end.Sub(start)
		ackTotal += end.Sub(mid)
	}
	n := float64(rounds * len(envoys))
	rep.ACKNanos = float64(ackTotal.Nanoseconds()) / n
	rep.ResponseNanos = float64(respTotal.Nanoseconds()) / n
	// Back to the state built above: 1% NACKing, 1% silent.
	views.connect(tr, keys, 0, cfg.Envoys)
	fmt.Fprintf(out, "ACK bookkeeping: %.0f ns per ACK, %.0f ns per response (send, sync, ACK)\n", rep.ACKNanos, rep.ResponseNanos)

	rep.Convergence = timeQuery(cfg.Queries, func() { tr.Convergence(ledger.Scope{}, time.Now()) })
	rep.Summary = timeQuery(cfg.Queries/10+1, func() { tr.Summary(ledger.Scope{}, time.Now(), ledger.Full).Convergence() })
	rep.Stragglers = len(tr.Summary(ledger.Scope{}, time.Now(), ledger.Full).Stragglers(0))
	fmt.Fprintf(out, "convergence in-process: P50 %v P99 %v (from a summary: P50 %v); %d stragglers\n",
		rep.Convergence.P50, rep.Convergence.P99, rep.Summary.P50, rep.Stragglers)
	runtime.KeepAlive(envoys)
	tr = nil

	// The tier: Relays real relays, the Envoys spread over them, each key's
	// origin one of them. Relay 0 is asked.
	peers := &staticPeers{}
	var peerPids []int // the relays in processes of their own
	askedNode, err := startLedgerRelay(ctx, 0, peers)
	if err != nil {
		return nil, err
	}
	defer askedNode.Stop(context.Background())
	asked := askedNode.Relay()
	if err := views.populate(asked, cfg, keys, 0); err != nil {
		return nil, err
	}
	where := "in this process"
	if cfg.StartPeer != nil {
		where = "each in a process of its own"
	}
	for i := 1; i < cfg.Relays; i++ {
		var addr string
		if cfg.StartPeer != nil {
			c, err := cfg.StartPeer(ctx, LedgerPeerConfig{Index: i, Relays: cfg.Relays, Envoys: cfg.Envoys, Keys: cfg.Keys, Resources: cfg.Resources, Versions: cfg.Versions})
			if err != nil {
				return nil, fmt.Errorf("loadtest: start relay-%d: %w", i, err)
			}
			defer func() {
				sctx, cancel := stopContext(ctx)
				defer cancel()
				_ = c.Stop(sctx)
			}()
			addr = c.Addr()
			peerPids = append(peerPids, c.Pid())
		} else {
			node, err := startLedgerRelay(ctx, i, nil)
			if err != nil {
				return nil, err
			}
			defer node.Stop(context.Background())
			r := node.Relay()
			if err := views.populate(r, cfg, keys, i); err != nil {
				return nil, err
			}
			addr = r.Addr().String()
		}
		peers.mu.Lock()
		peers.addrs = append(peers.addrs, addr)
		peers.mu.Unlock()
	}
	rep.PeersApart = cfg.StartPeer != nil
	// cpu is the CPU every relay has used so far.
	cpu := func() time.Duration {
		var total time.Duration
		for _, pid := range append([]int{os.Getpid()}, peerPids...) {
			if st, err := ReadProcStat(pid); err == nil {
				total += st.CPU
			}
		}
		return total
	}
	// Relays keep their connections to each other: the first gathers dial
	// them, and are not timed.
	for range 3 {
		asked.TierLedger(ctx, ledger.Scope{}, ledger.Brief)
		asked.TierLedger(ctx, ledger.Scope{}, ledger.Full)
	}
	var tierErr error
	// answer is what a tier-wide query counted; brief and full must agree.
	type answer struct {
		c          ledger.Convergence
		stragglers int
	}
	timeTier := func(d ledger.Detail) (Quantiles, time.Duration, answer) {
		var last answer
		before := cpu()
		q := timeQuery(cfg.Queries, func() {
			tl := asked.TierLedger(ctx, ledger.Scope{}, d)
			last = answer{tl.Convergence(), len(tl.Stragglers(0))}
			if len(tl.Missing) > 0 && tierErr == nil {
				tierErr = fmt.Errorf("loadtest: relays missing from the tier-wide answer: %v", tl.Missing)
			}
		})
		return q, (cpu() - before) / time.Duration(cfg.Queries), last
	}
	var brief, full answer
	rep.Tier, rep.TierCPU, brief = timeTier(ledger.Brief)
	rep.TierFull, rep.TierFullCPU, full = timeTier(ledger.Full)
	if tierErr != nil {
		return nil, tierErr
	}
	if brief != full {
		return nil, fmt.Errorf("loadtest: the tier in brief counts %+v, in full %+v", brief, full)
	}
	rep.TierEnvoys, rep.TierStragglers = brief.c.Envoys, brief.stragglers
	fmt.Fprintf(out, "tier-wide across %d relays (the others %s), %d Envoys, %d stragglers:\n", cfg.Relays, where, rep.TierEnvoys, rep.TierStragglers)
	fmt.Fprintf(out, "  in brief: P50 %v P99 %v, relays' CPU %v per query\n", rep.Tier.P50, rep.Tier.P99, rep.TierCPU)
	fmt.Fprintf(out, "  in full:  P50 %v P99 %v, relays' CPU %v per query\n", rep.TierFull.P50, rep.TierFull.P99, rep.TierFullCPU)
	movedHash, _ := views.eds[len(views.eds)-1].Get(views.moved)
	before := cpu()
	deliveries := cfg.Queries/4 + 1
	rep.TierDelivery = timeQuery(deliveries, func() {
		if _, _, err := asked.TierDelivery(ctx, ledger.Scope{}, ledgerEDS, views.moved, movedHash.Hash); err != nil && tierErr == nil {
			tierErr = err
		}
	})
	rep.TierDeliveryCPU = (cpu() - before) / time.Duration(deliveries)
	if tierErr != nil {
		return nil, tierErr
	}
	fmt.Fprintf(out, "tier-wide delivery of one endpoint: P50 %v P99 %v, relays' CPU %v per query\n", rep.TierDelivery.P50, rep.TierDelivery.P99, rep.TierDeliveryCPU)

	rep.Targets = LedgerTargets{
		ACK:         rep.ACKNanos <= 2000,
		Convergence: rep.Convergence.P99 <= time.Millisecond,
		TierP50:     rep.Tier.P50 <= 20*time.Millisecond,
		TierP99:     rep.Tier.P99 <= 20*time.Millisecond,
		Memory:      rep.LedgerBytes <= 64<<20,
	}
	fmt.Fprintf(out, "targets: ACK ≤ 2 µs %s, convergence ≤ 1 ms %s, tier ≤ 20 ms P50 %s P99 %s, memory ≤ 64 MiB %s\n",
		report.Judge(rep.Targets.ACK), report.Judge(rep.Targets.Convergence), report.Judge(rep.Targets.TierP50), report.Judge(rep.Targets.TierP99), report.Judge(rep.Targets.Memory))
	return rep, nil
}

func timeQuery(n int, fn func()) Quantiles {
	ds := make([]time.Duration, n)
	for i := range ds {
		start := time.Now()
		fn()
		ds[i] = time.Since(start)
	}
	l := report.Summarize(ds)
	return Quantiles{P50: l.P50, P99: l.P99}
}

func heapInUse() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// startLedgerRelay starts relay-i on loopback, asking peers (nil: none)
// for tier-wide answers. Its upstream is never dialled: the ledger is
// driven directly.
func startLedgerRelay(ctx context.Context, i int, peers relay.Peers) (*shard.Node, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	cfg := shard.DefaultNodeConfig()
	cfg.Relay.ID = fmt.Sprintf("relay-%d", i)
	cfg.Relay.XDS.Listener = lis
	cfg.Relay.Upstream.Addr = "127.0.0.1:1"
	cfg.Relay.Tier.Peers = peers
	cfg.DrainPeriod = 0
	node, err := shard.NewNode(cfg)
	if err != nil {
		return nil, err
	}
	if err := node.Start(ctx); err != nil {
		return nil, err
	}
	return node, nil
}
