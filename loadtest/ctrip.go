package loadtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
)

// CtripConfig configures RunCtrip, the Ctrip-scale benchmark of issue 17.
// Start from DefaultCtripConfig (or QuickCtripConfig).
type CtripConfig struct {
	// Scenario is the upstream's. Default 30,000 ServiceEntries, 30,000
	// WorkloadEntries, 10 namespaces, 25 % of services namespace-local.
	Scenario upstream.Scenario
	// Relays is the number of relay processes in the tier. Default 3.
	Relays int
	// Envoys spread over Keys aggregation keys, round-robin, and over the
	// relays, round-robin (Envoy i on relay i mod Relays). Default 1,000
	// over 100.
	Envoys, Keys int
	// Protocol is the Envoys' ADS variant, UpstreamProtocol the relays'.
	// Default Delta both.
	Protocol         envoy.Protocol
	UpstreamProtocol relay.Protocol
	// IncrementalUpstream serves the relays' Delta streams from the
	// synthetic upstream's incremental caches (upstream.Config's
	// IncrementalDelta): go-control-plane's LinearCache costs seconds of
	// CPU per change at this scale, which on two cores would measure the
	// upstream, not the tier. Default true.
	IncrementalUpstream bool
	// ChurnRate is upstream mutations a second during the churn, for
	// Duration. Default 10 for 5 minutes.
	ChurnRate float64
	Duration  time.Duration
	// AddRemoveFraction of the mutations add or remove a ServiceEntry;
	// the rest move a WorkloadEntry. Default 0: WorkloadEntry churn.
	AddRemoveFraction float64
	// Seed seeds the churn. Default 1.
	Seed int64
	// StartRate bounds the Envoys connecting a second, and MaxSyncing the
	// Envoys connected but not yet holding their first clusters and
	// endpoints (FleetConfig's). Default 50 a second, 16 at once.
	StartRate  float64
	MaxSyncing int
	// SyncTimeout bounds the initial sync. Default 30 minutes.
	SyncTimeout time.Duration
	// ChangeTimeout is how long a change may take to reach every Envoy
	// that must get it before it counts as timed out. Default 1 minute.
	ChangeTimeout time.Duration
	// Settle is waited between the initial sync and the churn. Default 5 s.
	Settle time.Duration
	// LedgerInterval is how often each relay's ledger is sampled during
	// the churn (see RunTierRelayChild). Default 20 ms.
	LedgerInterval time.Duration
	// Targets are the issue's: push → ACK P95 and P99 as the ledger
	// measures it. Default 500 ms and 1 s.
	TargetP95, TargetP99 time.Duration
	// RelayCPUs and FleetCPUs pin the relay children and the fleet child.
	// Default: not pinned.
	RelayCPUs, FleetCPUs CPUSet
	// StartRelay starts each relay; FleetCommand the fleet child.
	// Required.
	StartRelay   StartTierRelayFunc
	FleetCommand FleetCommand
	// FleetStderr receives the fleet child's stderr. Nil: discarded.
	FleetStderr io.Writer
	// Plot, if set, is where the PNG of latency over time is written.
	Plot string
	// CPUProfile, if set, is a prefix: the fleet child and every relay
	// write CPU profiles of the initial sync and of the churn to
	// PREFIX-<process>-<phase>.cpu.pprof.
	CPUProfile string
	// Interval is the time between progress lines. Default 10 s.
	Interval time.Duration
	// MinAvailable stops the run (with an error) when the machine's
	// available memory (MemAvailable in /proc/meminfo) falls below it.
	// Default 4 GiB; 0 disables the guard.
	MinAvailable uint64
}

// DefaultCtripConfig is the scenario of issue 17: Ctrip's 30,000
// ServiceEntries and 30,000 WorkloadEntries in 10 namespaces, through a
// tier of 3 relay processes, to 1,000 simulated Envoys over 100 keys, with
// WorkloadEntry churn at 10 changes a second for 5 minutes.
func DefaultCtripConfig() CtripConfig {
	sc := upstream.DefaultScenario()
	sc.Services, sc.Endpoints, sc.Namespaces = 30_000, 30_000, 10
	return CtripConfig{
		Scenario: sc, Relays: 3, Envoys: 1000, Keys: 100,
		Protocol: envoy.Delta, UpstreamProtocol: relay.ProtocolDelta, IncrementalUpstream: true,
		ChurnRate: 10, Duration: 5 * time.Minute, Seed: 1,
		StartRate: 50, MaxSyncing: 16,
		SyncTimeout: 30 * time.Minute, ChangeTimeout: time.Minute, Settle: 5 * time.Second,
		LedgerInterval: 20 * time.Millisecond,
		TargetP95:      500 * time.Millisecond, TargetP99: time.Second,
		Interval: 10 * time.Second, MinAvailable: 4 << 30,
	}
}

// QuickCtripConfig is `loadtest ctrip --quick`: a tenth of the mesh, 200
// Envoys over 20 keys, one minute of churn at the same rate.
func QuickCtripConfig() CtripConfig {
	c := DefaultCtripConfig()
	c.Scenario.Services, c.Scenario.Endpoints = 3000, 3000
	c.Envoys, c.Keys, c.Duration = 200, 20, time.Minute
	return c
}

func (c *CtripConfig) validate() error {
	var errs []error
	bad := func(f string, args ...any) { errs = append(errs, fmt.Errorf("loadtest: ctrip: "+f, args...)) }
	if c.StartRelay == nil || c.FleetCommand == nil {
		bad("StartRelay and FleetCommand are required")
	}
	if c.Relays < 1 || c.Relays > 9 {
		bad("Relays %d: want 1 to 9", c.Relays)
	}
	if c.Envoys < 1 || c.Keys < 1 || c.Keys > c.Envoys {
		bad("Envoys %d, Keys %d: want 1 ≤ Keys ≤ Envoys", c.Envoys, c.Keys)
	}
	if c.ChurnRate <= 0 || c.Duration <= 0 || c.ChangeTimeout <= 0 || c.SyncTimeout <= 0 || c.LedgerInterval <= 0 {
		bad("ChurnRate, Duration, ChangeTimeout, SyncTimeout and LedgerInterval must be positive")
	}
	if c.AddRemoveFraction < 0 || c.AddRemoveFraction > 1 {
		bad("AddRemoveFraction %v: want 0 to 1", c.AddRemoveFraction)
	}
	if c.Interval <= 0 {
		c.Interval = 10 * time.Second
	}
	return errors.Join(errs...)
}

// CtripReport is what RunCtrip measured. Durations are in milliseconds or
// seconds, sizes in bytes, as the JSON names say; times of the timeline
// (Phases, Series) in seconds since the fleet started connecting.
type CtripReport struct {
	Date    string         `json:"date"`
	Commit  string         `json:"commit,omitempty"`
	Machine report.Machine `json:"machine"`
	Config  CtripSummary   `json:"config"`
	Pinning report.Pinning `json:"pinning"`

	// FleetStartS is how long starting every Envoy took (the paced ramp,
	// MaxSyncing at a time); InitialSyncS until every Envoy held its
	// namespace's full config.
	FleetStartS  float64 `json:"fleet_start_s"`
	InitialSyncS float64 `json:"initial_sync_s"`
	Synced       bool    `json:"synced"`
	// ChurnS is how long the churn ran, DrainS from its end until every
	// change reached every Envoy that must get it (or timed out).
	ChurnS float64 `json:"churn_s"`
	DrainS float64 `json:"drain_s"`
	Phases []Phase `json:"phases"`

	// Ledger is push → ACK as the relays' ledgers record it.
	Ledger CtripLedger `json:"ledger"`
	// Delivered is from the upstream publishing each change to each
	// Envoy's ACK of it, timed at the Envoy (the fleet's own clock), over
	// every (change, Envoy that must get it) pair; Complete per change,
	// until its last Envoy.
	Delivered report.LatencyMs `json:"publish_to_envoy_ack"`
	Complete  report.LatencyMs `json:"publish_to_last_ack"`
	// Changes is what the churn published; Deliveries the (change, Envoy)
	// pairs they had to reach; ChangesTimedOut those that did not reach
	// every Envoy within ChangeTimeout.
	Changes         int `json:"changes"`
	Deliveries      int `json:"deliveries"`
	ChangesTimedOut int `json:"changes_timed_out"`
	// FinalSynced: after the churn every Envoy held exactly its
	// namespace's config; Tier is the tier's ledger then, as relay-0
	// gathers it (every Envoy on its key's current version if Current =
	// Envoys).
	FinalSynced bool            `json:"final_synced"`
	Tier        TierConvergence `json:"tier_ledger_end"`

	// UpstreamStreams: after the initial sync and after the churn.
	report.UpstreamStreams
	UpstreamBytesSync   uint64  `json:"upstream_bytes_sync"`
	UpstreamBytesChurn  uint64  `json:"upstream_bytes_churn"`
	EnvoyBytesSync      uint64  `json:"envoy_bytes_sync"`
	EnvoyBytesChurn     uint64  `json:"envoy_bytes_churn"`
	RelayCPUChurnS      float64 `json:"relay_cpu_churn_s"`
	RelayCPUPerDelivery float64 `json:"relay_cpu_per_change_per_envoy_us"`
	// RelayCPUPerDeliveryOwn is the same less what sampling the ledgers
	// cost: the relays' own work.
	RelayCPUPerDeliveryOwn float64        `json:"relay_cpu_per_change_per_envoy_own_us"`
	Relays                 []CtripRelay   `json:"relays"`
	Fleet                  report.Process `json:"fleet_process"`
	FleetHeapAfterSync     uint64         `json:"fleet_heap_after_sync_bytes"`
	FleetHeapPerEnvoy      uint64         `json:"fleet_heap_per_envoy_bytes"`
	Loadtest               report.Process `json:"loadtest_process"`
	// Health: the Envoys' stream reconnects and protocol violations.
	report.Health
	Verdicts []report.Verdict `json:"verdicts"`
	Series   []CtripSecond    `json:"series"`
	Plot     string           `json:"plot,omitempty"`
	Error    string           `json:"error,omitempty"`
}

// CtripSummary is the configuration a report was measured with.
type CtripSummary struct {
	Services          int     `json:"services"`
	Endpoints         int     `json:"endpoints"`
	Namespaces        int     `json:"namespaces"`
	LocalFraction     float64 `json:"local_fraction"`
	Relays            int     `json:"relays"`
	Envoys            int     `json:"envoys"`
	Keys              int     `json:"keys"`
	Protocol          string  `json:"protocol"`
	UpstreamProtocol  string  `json:"upstream_protocol"`
	UpstreamCache     string  `json:"upstream_cache"`
	ChurnRate         float64 `json:"churn_rate"`
	DurationS         float64 `json:"duration_s"`
	AddRemoveFraction float64 `json:"add_remove_fraction"`
	StartRate         float64 `json:"start_rate"`
	MaxSyncing        int     `json:"max_syncing"`
	ChangeTimeoutS    float64 `json:"change_timeout_s"`
	LedgerIntervalMs  float64 `json:"ledger_interval_ms"`
	TargetP95Ms       float64 `json:"target_p95_ms"`
	TargetP99Ms       float64 `json:"target_p99_ms"`
}

// Phase is a moment of the run, marked on the plot.
type Phase struct {
	Name string  `json:"name"`
	AtS  float64 `json:"at_s"`
}

// CtripLedger is push → ACK as the relays' ledgers record it: from the
// upstream receipt of a version at its key's origin (the relay that owns
// the key) to each Envoy's ACK of it, as its relay recorded the ACK, read
// by sampling every relay's ledger (LedgerInterval) during the churn.
type CtripLedger struct {
	// ACK is over every (version, Envoy) ACK sampled and resolved, of
	// versions the origin received during the churn; Owner and Peer split
	// it by whether the Envoy's relay is its key's origin or gets the key
	// from it (one more hop).
	ACK   report.LatencyMs `json:"ack"`
	Owner report.LatencyMs `json:"ack_on_owner"`
	Peer  report.LatencyMs `json:"ack_via_peer"`
	// Unresolved counts ACKs sampled whose version's receipt at its origin
	// was not (a version current for less than one interval).
	Unresolved int `json:"unresolved"`
	// Histogram is the relays' own meshrelay_proxy_convergence_time_seconds
	// over the churn, summed: every (Envoy, type, version) ACK, counted
	// from the receipt at the Envoy's own relay (a peer's receipt is after
	// its owner's), at the resolution of its buckets. Coverage is ACK.N
	// over its count: the share of the ledger's ACKs the samples hold.
	Histogram Histogram `json:"histogram"`
	Coverage  float64   `json:"coverage"`
	// HistogramWithin are the histogram's shares ≤ 300 ms and ≤ 1 s;
	// HistogramP95 and HistogramP99 the buckets that hold those
	// quantiles, (low, high] in seconds.
	HistogramWithin300ms float64    `json:"histogram_within_300ms"`
	HistogramWithin1s    float64    `json:"histogram_within_1s"`
	HistogramP95         [2]float64 `json:"histogram_p95_bucket_s"`
	HistogramP99         [2]float64 `json:"histogram_p99_bucket_s"`
	// SamplerCPUS is what sampling cost the relays, together (their
	// threads' CPU, included in the relays' CPU).
	SamplerCPUS float64 `json:"sampler_cpu_s"`
}

// CtripRelay is one relay process.
type CtripRelay struct {
	ID      string         `json:"id"`
	Process report.Process `json:"process"`
	// Envoys is the Envoy streams it held at the end; UpstreamStreams the
	// keys it owned (one upstream stream each); PeerStreams the keys it
	// got from their owners.
	Envoys          int    `json:"envoys"`
	UpstreamStreams int    `json:"upstream_streams"`
	PeerStreams     int    `json:"peer_streams"`
	PeerClients     int    `json:"peer_clients"`
	BytesSentChurn  uint64 `json:"bytes_sent_churn"`
	// HeapSync and HeapEnd are its live heap after a collection, once
	// every Envoy synced and at the end.
	HeapSync       uint64  `json:"heap_after_sync_bytes"`
	HeapEnd        uint64  `json:"heap_end_bytes"`
	CPUPerDelivery float64 `json:"cpu_per_change_per_envoy_us"`
	SamplerCPUS    float64 `json:"sampler_cpu_s"`
	SamplerPolls   int     `json:"sampler_polls"`
}

// CtripSecond is one second of the churn: the ledger's push → ACK of the
// ACKs recorded in it.
type CtripSecond struct {
	AtS float64 `json:"at_s"`
	N   int     `json:"n"`
	P50 float64 `json:"p50_ms"`
	P99 float64 `json:"p99_ms"`
	Max float64 `json:"max_ms"`
}

// RunCtrip runs the benchmark: the synthetic upstream in this process,
// cfg.Relays relay processes gossiping over loopback (StartRelay), the
// fleet in a process of its own (light Envoys, spread over the relays),
// the initial sync, then the churn, timed by the relays' ledgers and by
// the Envoys; then it stops everything it started. It prints progress to
// out and returns the report, with what was measured even if the run
// failed.
func RunCtrip(ctx context.Context, cfg CtripConfig, out io.Writer) (*CtripReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	sc := cfg.Scenario
	rep := &CtripReport{
		Date: time.Now().UTC().Format(time.RFC3339), Commit: buildCommit(), Machine: report.ThisMachine(),
		Config: CtripSummary{
			Services: sc.Services, Endpoints: sc.Endpoints, Namespaces: sc.Namespaces, LocalFraction: sc.LocalFraction,
			Relays: cfg.Relays, Envoys: cfg.Envoys, Keys: cfg.Keys, Protocol: cfg.Protocol.String(),
			UpstreamProtocol: string(cfg.UpstreamProtocol), UpstreamCache: upstreamCache(cfg), ChurnRate: cfg.ChurnRate, DurationS: cfg.Duration.Seconds(),
			AddRemoveFraction: cfg.AddRemoveFraction, StartRate: cfg.StartRate, MaxSyncing: cfg.MaxSyncing,
			ChangeTimeoutS:   cfg.ChangeTimeout.Seconds(),
			LedgerIntervalMs: ms64(cfg.LedgerInterval), TargetP95Ms: ms64(cfg.TargetP95), TargetP99Ms: ms64(cfg.TargetP99),
		},
		Pinning: report.Pinning{FleetProcess: true, RelayCPUs: cfg.RelayCPUs.String(), FleetCPUs: cfg.FleetCPUs.String()},
	}
	if cpus, err := AllowedCPUs(); err == nil {
		rep.Pinning.LoadtestCPUs = cpus.String()
	}
	// The memory guard ends the run if the machine runs short.
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	guardDone := make(chan struct{})
	go func() {
		defer close(guardDone)
		guardMemory(ctx, cfg.MinAvailable, cancel)
	}()
	defer func() { cancel(nil); <-guardDone }()

	r := &ctripRun{cfg: cfg, rep: rep, out: out, samples: newLedgerSamples()}
	err := r.run(ctx)
	if cause := context.Cause(ctx); err != nil && cause != nil && !errors.Is(cause, context.Canceled) {
		err = fmt.Errorf("%w (%v)", err, cause)
	}
	r.stop()
	if err != nil {
		rep.Error = err.Error()
	}
	return rep, err
}

// ctripRun is one run of RunCtrip.
type ctripRun struct {
	cfg     CtripConfig
	rep     *CtripReport
	out     io.Writer
	samples *ledgerSamples

	up      *upstream.Upstream
	tracker *traffic.Tracker
	relays  []*tierRelayProc
	fleet   *FleetProcess
	procs   procMeter
	t0      time.Time // the fleet started connecting
}

func (r *ctripRun) logf(format string, args ...any) {
	fmt.Fprintf(r.out, "ctrip: "+format+"\n", args...)
}

func (r *ctripRun) phase(name string, at time.Time) {
	r.rep.Phases = append(r.rep.Phases, Phase{Name: name, AtS: at.Sub(r.t0).Seconds()})
}

// profile has the fleet child and the relays profile phase, if asked,
// until the returned func is called.
func (r *ctripRun) profile(ctx context.Context, phase string) (stop func()) {
	if r.cfg.CPUProfile == "" {
		return func() {}
	}
	name := func(proc string) string { return fmt.Sprintf("%s-%s-%s.cpu.pprof", r.cfg.CPUProfile, proc, phase) }
	for _, p := range r.relays {
		_ = p.child.Send(childProfileStart + " " + name(p.cfg.ID))
	}
	fleet := r.fleet != nil && r.fleet.Profile(ctx, name("fleet")) == nil
	return func() {
		for _, p := range r.relays {
			_ = p.child.Send(childProfileStop)
		}
		if fleet {
			_ = r.fleet.StopProfile(ctx)
		}
	}
}

// stop stops what run started, the fleet first; safe on a half-started run.
func (r *ctripRun) stop() {
	sctx, cancel := context.WithTimeout(context.Background(), stopTimeout)
	defer cancel()
	if r.fleet != nil {
		if err := r.fleet.Stop(sctx); err != nil {
			r.logf("stop fleet: %v", err)
		}
	}
	var wg sync.WaitGroup
	for _, p := range r.relays {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := p.child.Stop(sctx); err != nil {
				r.logf("stop %s: %v", p.cfg.ID, err)
			}
		}()
	}
	wg.Wait()
	if r.up != nil {
		_ = r.up.Stop(sctx)
	}
}

func (r *ctripRun) run(ctx context.Context) error {
	cfg, rep := r.cfg, r.rep
	self := os.Getpid()
	resetPeakRSS(self)
	r.procs.add(func() (ProcStat, error) { return ReadProcStat(self) }, &rep.Loadtest)

	// The upstream hands each change to the tracker before any relay can
	// see it.
	r.tracker = traffic.NewTracker()
	r.tracker.KeepSamples(4 << 20)
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario, ucfg.IncrementalDelta = cfg.Scenario, cfg.IncrementalUpstream
	ucfg.OnPublish = func(c upstream.Change) { r.tracker.Track(c) }
	up, err := upstream.Start(ctx, ucfg)
	if err != nil {
		return err
	}
	r.up = up
	r.logf("upstream %s: %d ServiceEntries, %d WorkloadEntries, %d namespaces; %s caches for the relays' %s streams",
		up.Addr(), cfg.Scenario.Services, cfg.Scenario.Endpoints, cfg.Scenario.Namespaces, upstreamCache(cfg), cfg.UpstreamProtocol)

	if err := r.startTier(ctx); err != nil {
		return err
	}
	if err := r.sync(ctx); err != nil {
		return err
	}
	return r.churn(ctx)
}

// startTier starts the relays, each joining the others, and waits until
// each is ready with every relay in its ring.
func (r *ctripRun) startTier(ctx context.Context) error {
	cfg := r.cfg
	gossip := make([]string, cfg.Relays)
	for i := range gossip {
		port, err := freeLoopbackPort()
		if err != nil {
			return err
		}
		gossip[i] = "127.0.0.1:" + strconv.Itoa(port)
	}
	for i := range cfg.Relays {
		rc := TierRelayChildConfig{
			ID: fmt.Sprintf("relay-%d", i), Upstream: r.up.Addr(), UpstreamProtocol: cfg.UpstreamProtocol,
			Gossip: gossip[i], CPUs: cfg.RelayCPUs,
		}
		for j, g := range gossip {
			if j != i {
				rc.Join = append(rc.Join, g)
			}
		}
		p, err := startTierRelay(ctx, cfg.StartRelay, rc, i, r.samples)
		if err != nil {
			return fmt.Errorf("start %s: %w", rc.ID, err)
		}
		r.relays = append(r.relays, p)
		fig := &report.Process{Pid: p.child.Pid(), CPUs: childCPUs(p.child.Pid())}
		r.rep.Relays = append(r.rep.Relays, CtripRelay{ID: rc.ID})
		r.procs.add(p.child.Stat, fig)
		p.fig = fig
		r.logf("%s: pid %d, xDS %s, gossip %s, CPUs %s", rc.ID, p.child.Pid(), p.child.Addr(), rc.Gossip, fig.CPUs)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		ready := 0
		for _, p := range r.relays {
			st, err := p.stats(ctx)
			if err != nil {
				return err
			}
			if st.Ready && st.Members == cfg.Relays {
				ready++
			}
		}
		if ready == cfg.Relays {
			r.logf("tier up: %d relays ready, each with %d members in its ring", cfg.Relays, cfg.Relays)
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("tier: %d of %d relays ready with the whole ring after 2m", ready, cfg.Relays)
		}
		if !traffic.SleepCtx(ctx, 200*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// sync starts the fleet and waits for its initial sync.
func (r *ctripRun) sync(ctx context.Context) error {
	cfg, rep := r.cfg, r.rep
	var targets []string
	for _, p := range r.relays {
		targets = append(targets, p.child.Addr())
	}
	fc := FleetChildConfig{
		Scenario: cfg.Scenario, Envoys: cfg.Envoys, Keys: cfg.Keys, Protocol: cfg.Protocol.String(),
		Targets: targets, StartRate: cfg.StartRate, Light: true, MaxSyncing: cfg.MaxSyncing,
	}
	// The fleet is the harness, not what is measured: it trades CPU for
	// memory (a collection at 50 % heap growth, not 100 %), so that more
	// Envoys fit beside the relays.
	command := func(c FleetChildConfig) (string, []string, []string, error) {
		path, args, env, err := cfg.FleetCommand(c)
		return path, args, append(env, "GOGC=50"), err
	}
	fp, err := StartFleetProcess(ctx, FleetProcessConfig{
		Fleet: fc, Command: command, CPUs: cfg.FleetCPUs, Tracker: r.tracker, Stderr: cfg.FleetStderr,
	})
	if err != nil {
		return fmt.Errorf("start fleet: %w", err)
	}
	r.fleet = fp
	rep.Fleet = report.Process{Pid: fp.Pid(), CPUs: childCPUs(fp.Pid())}
	r.procs.add(fp.Stat, &rep.Fleet)
	r.logf("fleet: pid %d, CPUs %s: %d light %s Envoys over %d keys, spread over the relays, %.0f/s, at most %d syncing at once",
		fp.Pid(), rep.Fleet.CPUs, cfg.Envoys, cfg.Protocol, cfg.Keys, cfg.StartRate, cfg.MaxSyncing)

	r.t0 = time.Now()
	r.phase("fleet start", r.t0)
	progress := r.every(ctx, func(elapsed time.Duration) {
		var streams []string
		total := 0
		for _, p := range r.relays {
			if st, err := p.stats(ctx); err == nil {
				streams = append(streams, strconv.Itoa(st.Stats.Streams))
				total += st.Stats.Streams
			}
		}
		r.logf("%6s: %d Envoys connected (%s), upstream streams %d; %s", elapsed.Round(time.Second), total,
			strings.Join(streams, "/"), r.up.Stats().OpenStreams, r.memory())
	})
	defer progress()
	syncCtx, cancel := context.WithTimeout(ctx, cfg.SyncTimeout)
	defer cancel()
	stopProfile := r.profile(ctx, "sync")
	defer stopProfile()
	if err := fp.Start(syncCtx); err != nil {
		return fmt.Errorf("start fleet: %w", err)
	}
	rep.FleetStartS = time.Since(r.t0).Seconds()
	if err := fp.WaitSynced(syncCtx, r.up); err != nil {
		return fmt.Errorf("initial sync: %w", err)
	}
	synced := time.Now()
	stopProfile()
	progress()
	rep.InitialSyncS, rep.Synced = synced.Sub(r.t0).Seconds(), true
	r.phase("synced", synced)
	rep.UpstreamBytesSync = r.up.Stats().BytesSent
	// A divergence check's stream may still be open when the last Envoy
	// synced: count the streams that stay.
	rep.UpstreamStreams.AfterSync = settledStreams(ctx, r.up)
	r.procs.mark(phaseSync)
	fig, err := fp.Figures(ctx)
	if err != nil {
		return err
	}
	rep.EnvoyBytesSync = fig.BytesReceived
	if rep.FleetHeapAfterSync, err = fp.Heap(ctx); err != nil {
		return err
	}
	rep.FleetHeapPerEnvoy = rep.FleetHeapAfterSync / uint64(cfg.Envoys)
	for i, p := range r.relays {
		if rep.Relays[i].HeapSync, err = p.heap(ctx); err != nil {
			return err
		}
	}
	r.logf("%d Envoys synced in %.1fs (started in %.1fs); upstream streams %d, upstream sent %s, Envoys received %s; fleet heap %s (%s an Envoy); %s",
		cfg.Envoys, rep.InitialSyncS, rep.FleetStartS, rep.UpstreamStreams.AfterSync, fmtBytes(rep.UpstreamBytesSync),
		fmtBytes(rep.EnvoyBytesSync), fmtBytes(rep.FleetHeapAfterSync), fmtBytes(rep.FleetHeapPerEnvoy), r.memory())
	return nil
}

// churn runs the churn and measures it.
func (r *ctripRun) churn(ctx context.Context) error {
	cfg, rep := r.cfg, r.rep
	runtime.GC()
	if !traffic.SleepCtx(ctx, cfg.Settle) {
		return ctx.Err()
	}
	r.tracker.Reset()
	if err := r.fleet.Track(ctx, r.up.Generation()); err != nil {
		return err
	}
	// ACKs recorded from here on count (if their version was received
	// after the churn started).
	r.samples.setStart(time.Now())
	before := make([]TierRelayStats, len(r.relays))
	for i, p := range r.relays {
		st, err := p.stats(ctx)
		if err != nil {
			return err
		}
		before[i] = st
		if err := p.ledgerOn(ctx, cfg.LedgerInterval); err != nil {
			return err
		}
	}
	fig, err := r.fleet.Figures(ctx)
	if err != nil {
		return err
	}
	upBytes, envoyBytes := r.up.Stats().BytesSent, fig.BytesReceived
	r.procs.mark(phaseChangesStart)
	start := time.Now()
	r.phase("churn start", start)
	r.logf("churn: %.1f WorkloadEntry changes a second for %v (%.0f%% add or remove a ServiceEntry)", cfg.ChurnRate, cfg.Duration, 100*cfg.AddRemoveFraction)

	stopProfile := r.profile(ctx, "churn")
	defer stopProfile()
	churnCtx, stopChurn := context.WithCancel(ctx)
	defer stopChurn()
	churnErr := make(chan error, 1)
	go func() {
		churnErr <- r.up.Churn(churnCtx, upstream.ChurnConfig{
			Rate: cfg.ChurnRate, Duration: cfg.Duration, AddRemoveFraction: cfg.AddRemoveFraction, Seed: cfg.Seed,
		}, nil)
	}()
	stopProgress := r.every(ctx, func(elapsed time.Duration) {
		tracked, _, pending := r.tracker.Counts()
		w := r.samples.window()
		r.logf("%6s: %d changes, %d pending; ledger: %d ACKs, last %v P50 %s P99 %s max %s; %s",
			time.Since(start).Round(time.Second), tracked, pending, w.N, r.cfg.Interval,
			report.MS(w.P50), report.MS(w.P99), report.MS(w.Max), r.memory())
	})
	forget := time.NewTicker(time.Second)
	defer forget.Stop()
	var runErr error
wait:
	for {
		select {
		case runErr = <-churnErr:
			break wait
		case <-forget.C:
			r.tracker.Forget(time.Now().Add(-cfg.ChangeTimeout))
		}
	}
	end := time.Now()
	stopProfile()
	stopProgress()
	rep.ChurnS = end.Sub(start).Seconds()
	r.phase("churn stop", end)
	if runErr != nil && ctx.Err() == nil {
		return fmt.Errorf("churn: %w", runErr)
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}

	// Drain: every change delivered, or timed out.
	for {
		_, _, pending := r.tracker.Counts()
		if pending == 0 {
			break
		}
		if time.Since(end) > cfg.ChangeTimeout {
			r.tracker.Forget(time.Now())
			break
		}
		r.tracker.Forget(time.Now().Add(-cfg.ChangeTimeout))
		if !traffic.SleepCtx(ctx, 50*time.Millisecond) {
			return ctx.Err()
		}
	}
	drained := time.Now()
	rep.DrainS = drained.Sub(end).Seconds()
	r.phase("delivered", drained)

	// The end state: every Envoy holds its namespace's config, and the
	// tier's ledger says every Envoy is on its key's version.
	fctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	rep.FinalSynced = r.fleet.WaitSynced(fctx, r.up) == nil
	cancel()
	for deadline := time.Now().Add(30 * time.Second); ; {
		tc, err := r.relays[0].tier(ctx)
		rep.Tier = tc
		if err != nil {
			rep.Tier.Err = err.Error()
		}
		if (err == nil && tc.Envoys == cfg.Envoys && tc.Current == tc.Envoys) || time.Now().After(deadline) {
			break
		}
		if !traffic.SleepCtx(ctx, 500*time.Millisecond) {
			return ctx.Err()
		}
	}
	r.procs.mark(phaseEnd)

	// What the relays, the upstream and the Envoys say.
	var hist Histogram
	tracked, deliveries, _ := r.tracker.Counts()
	rep.Changes, rep.Deliveries = tracked, deliveries
	for i, p := range r.relays {
		sst, err := p.ledgerOff(ctx)
		if err != nil {
			return err
		}
		st, err := p.stats(ctx)
		if err != nil {
			return err
		}
		hist = hist.Add(st.Converged.Sub(before[i].Converged))
		cr := &rep.Relays[i]
		cr.Process = *p.fig
		cr.Envoys, cr.UpstreamStreams, cr.PeerStreams, cr.PeerClients = st.Stats.Streams, st.Stats.UpstreamStreams, st.Stats.PeerStreams, st.Stats.PeerClients
		cr.BytesSentChurn = st.Stats.BytesSent - before[i].Stats.BytesSent
		cr.SamplerCPUS, cr.SamplerPolls = sst.CPUS, sst.Polls
		if cr.HeapEnd, err = p.heap(ctx); err != nil {
			return err
		}
		rep.Ledger.SamplerCPUS += max(sst.CPUS, 0)
		rep.RelayCPUChurnS += cr.Process.CPUChangesS
		if deliveries > 0 && cr.Envoys > 0 {
			share := float64(deliveries) * float64(cr.Envoys) / float64(cfg.Envoys)
			cr.CPUPerDelivery = cr.Process.CPUChangesS * 1e6 / share
		}
	}
	if deliveries > 0 {
		rep.RelayCPUPerDelivery = rep.RelayCPUChurnS * 1e6 / float64(deliveries)
		rep.RelayCPUPerDeliveryOwn = (rep.RelayCPUChurnS - rep.Ledger.SamplerCPUS) * 1e6 / float64(deliveries)
	}
	st := r.up.Stats()
	rep.UpstreamBytesChurn, rep.UpstreamStreams.AtEnd = st.BytesSent-upBytes, st.OpenStreams
	if fig, err = r.fleet.Figures(ctx); err != nil {
		return err
	}
	rep.EnvoyBytesChurn = fig.BytesReceived - envoyBytes
	rep.Health = fig.Health()
	perEnvoy, complete, timedOut := r.tracker.Results()
	rep.Delivered, rep.Complete, rep.ChangesTimedOut = perEnvoy.Ms(), complete.Ms(), timedOut
	if err := r.fleet.Err(); err != nil {
		return err
	}

	led := r.samples.join(r.t0)
	rep.Ledger.ACK, rep.Ledger.Owner, rep.Ledger.Peer = led.all.Ms(), led.owner.Ms(), led.peer.Ms()
	rep.Ledger.Unresolved = led.unresolved
	rep.Ledger.Histogram = hist
	if hist.Count > 0 {
		rep.Ledger.Coverage = float64(led.all.N) / float64(hist.Count)
	}
	rep.Ledger.HistogramWithin300ms, _ = hist.ShareWithin(0.3)
	rep.Ledger.HistogramWithin1s, _ = hist.ShareWithin(1)
	rep.Ledger.HistogramP95[0], rep.Ledger.HistogramP95[1] = hist.Quantile(0.95)
	rep.Ledger.HistogramP99[0], rep.Ledger.HistogramP99[1] = hist.Quantile(0.99)
	rep.Series = led.series
	rep.Verdicts = ctripVerdicts(cfg, rep)
	if cfg.Plot != "" {
		if err := writeCtripPlot(cfg.Plot, rep, led.points); err != nil {
			return fmt.Errorf("plot: %w", err)
		}
		rep.Plot = cfg.Plot
	}
	return nil
}

// every calls f with the time since the call every cfg.Interval, until
// the returned func is called (which returns once f has stopped).
func (r *ctripRun) every(ctx context.Context, f func(elapsed time.Duration)) (stop func()) {
	start := time.Now()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(r.cfg.Interval)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
				f(time.Since(start))
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() { close(done) })
		wg.Wait()
	}
}

// memory describes the RSS of the run's processes and what the machine
// has left.
func (r *ctripRun) memory() string {
	var parts []string
	var total uint64
	for _, p := range r.relays {
		if st, err := p.child.Stat(); err == nil {
			total += st.RSS
		}
	}
	parts = append(parts, "relays "+fmtBytes(total))
	if r.fleet != nil {
		if st, err := r.fleet.Stat(); err == nil {
			parts = append(parts, "fleet "+fmtBytes(st.RSS))
		}
	}
	if st, err := ReadProcStat(os.Getpid()); err == nil {
		parts = append(parts, "loadtest "+fmtBytes(st.RSS))
	}
	if avail, err := memAvailable(); err == nil {
		parts = append(parts, "available "+fmtBytes(avail))
	}
	return "RSS " + strings.Join(parts, ", ")
}

// ctripVerdicts checks the targets.
func ctripVerdicts(cfg CtripConfig, rep *CtripReport) []report.Verdict {
	v := func(target, measured string, pass bool) report.Verdict {
		return report.Verdict{Protocol: cfg.Protocol.String(), Target: target, Measured: measured, Pass: pass}
	}
	l := rep.Ledger.ACK
	return []report.Verdict{
		v(fmt.Sprintf("ledger push → ACK P95 ≤ %s", report.MS(cfg.TargetP95)), fmtMs(l.P95), l.N > 0 && l.P95 <= ms64(cfg.TargetP95)),
		v(fmt.Sprintf("ledger push → ACK P99 ≤ %s", report.MS(cfg.TargetP99)), fmtMs(l.P99), l.N > 0 && l.P99 <= ms64(cfg.TargetP99)),
		v("every change reached every Envoy", fmt.Sprintf("%d of %d changes, %d timed out", rep.Changes-rep.ChangesTimedOut, rep.Changes, rep.ChangesTimedOut),
			rep.Changes > 0 && rep.ChangesTimedOut == 0),
		v("every Envoy on its key's version at the end (tier ledger)", fmt.Sprintf("%d of %d", rep.Tier.Current, rep.Tier.Envoys),
			rep.Tier.Envoys == cfg.Envoys && rep.Tier.Current == rep.Tier.Envoys && rep.FinalSynced),
		v("one upstream stream per key", fmt.Sprintf("%d after the sync, %d at the end", rep.UpstreamStreams.AfterSync, rep.UpstreamStreams.AtEnd),
			rep.UpstreamStreams.Are(cfg.Keys)),
		v("no protocol violation", strconv.Itoa(rep.Violations), rep.Violations == 0),
	}
}

// PrintCtrip writes rep's figures.
func PrintCtrip(w io.Writer, rep *CtripReport) {
	c := rep.Config
	fmt.Fprintf(w, "\nctrip: %d ServiceEntries + %d WorkloadEntries in %d namespaces; %d relays; %d %s Envoys over %d keys; churn %.1f/s for %.0fs\n",
		c.Services, c.Endpoints, c.Namespaces, c.Relays, c.Envoys, c.Protocol, c.Keys, c.ChurnRate, c.DurationS)
	fmt.Fprintf(w, "machine: %s; %s; commit %s\n", rep.Machine, rep.Date, orUnknown(rep.Commit))
	fmt.Fprintf(w, "pinning: relays %s; fleet %s; upstream: %s, %s caches\n", orNot(rep.Pinning.RelayCPUs), orNot(rep.Pinning.FleetCPUs), c.UpstreamProtocol, c.UpstreamCache)
	l := rep.Ledger
	lat := func(x report.LatencyMs) string {
		return fmt.Sprintf("P50 %s  P95 %s  P99 %s  max %s  (%d)", fmtMs(x.P50), fmtMs(x.P95), fmtMs(x.P99), fmtMs(x.Max), x.N)
	}
	fmt.Fprintf(w, "initial sync            %.1fs (fleet started in %.1fs); upstream sent %s, Envoys received %s\n",
		rep.InitialSyncS, rep.FleetStartS, fmtBytes(rep.UpstreamBytesSync), fmtBytes(rep.EnvoyBytesSync))
	fmt.Fprintf(w, "ledger push → ACK       %s\n", lat(l.ACK))
	fmt.Fprintf(w, "  Envoy on the owner    %s\n", lat(l.Owner))
	fmt.Fprintf(w, "  Envoy via a peer      %s\n", lat(l.Peer))
	fmt.Fprintf(w, "  coverage              %.1f%% of the relays' %d ledger ACKs; %d sampled ACKs unresolved; sampling cost %.2fs of relay CPU\n",
		100*l.Coverage, l.Histogram.Count, l.Unresolved, l.SamplerCPUS)
	fmt.Fprintf(w, "  relays' histogram     %.2f%% ≤ 300ms, %.2f%% ≤ 1s; P95 in %s, P99 in %s (own receipt → ACK, bucket resolution)\n",
		100*l.HistogramWithin300ms, 100*l.HistogramWithin1s, fmtBucket(l.HistogramP95), fmtBucket(l.HistogramP99))
	fmt.Fprintf(w, "publish → Envoy ACK     %s\n", lat(rep.Delivered))
	fmt.Fprintf(w, "publish → last ACK      %s\n", lat(rep.Complete))
	fmt.Fprintf(w, "changes                 %d published, %d (change, Envoy) deliveries, %d timed out (not at every Envoy in %.0fs); drain %.1fs\n",
		rep.Changes, rep.Deliveries, rep.ChangesTimedOut, c.ChangeTimeoutS, rep.DrainS)
	fmt.Fprintf(w, "end state               fleet synced %v; tier ledger %d of %d Envoys current (%d missing relays)\n",
		rep.FinalSynced, rep.Tier.Current, rep.Tier.Envoys, rep.Tier.Missing)
	fmt.Fprintf(w, "upstream                streams %d → %d; sent %s during the churn\n", rep.UpstreamStreams.AfterSync, rep.UpstreamStreams.AtEnd, fmtBytes(rep.UpstreamBytesChurn))
	fmt.Fprintf(w, "Envoys                  received %s during the churn; %d reconnects; %d violations\n", fmtBytes(rep.EnvoyBytesChurn), rep.Reconnects, rep.Violations)
	for _, s := range rep.ViolationSamples {
		fmt.Fprintf(w, "  violation: %s\n", s)
	}
	for _, s := range rep.ReconnectReasons {
		fmt.Fprintf(w, "  reconnected after: %s\n", s)
	}
	fmt.Fprintf(w, "relay CPU, churn        %.2fs in all: %.1fµs per change per Envoy (%.1fµs less the ledger sampling's %.2fs)\n",
		rep.RelayCPUChurnS, rep.RelayCPUPerDelivery, rep.RelayCPUPerDeliveryOwn, rep.Ledger.SamplerCPUS)
	for _, cr := range rep.Relays {
		p := cr.Process
		fmt.Fprintf(w, "  %-8s Envoys %4d, owns %3d keys, %3d from peers; CPU sync %.1fs, churn %.1fs (%.1fµs per change per Envoy, sampler %.2fs); RSS peak %s, end %s; live heap after sync %s, end %s; CPUs %s\n",
			cr.ID, cr.Envoys, cr.UpstreamStreams, cr.PeerStreams, p.CPUSyncS, p.CPUChangesS, cr.CPUPerDelivery, cr.SamplerCPUS,
			fmtBytes(p.RSSPeak), fmtBytes(p.RSSEnd), fmtBytes(cr.HeapSync), fmtBytes(cr.HeapEnd), p.CPUs)
	}
	fmt.Fprintf(w, "fleet                   CPU sync %.1fs, churn %.1fs; RSS peak %s, end %s; heap after sync %s (%s an Envoy)\n",
		rep.Fleet.CPUSyncS, rep.Fleet.CPUChangesS, fmtBytes(rep.Fleet.RSSPeak), fmtBytes(rep.Fleet.RSSEnd),
		fmtBytes(rep.FleetHeapAfterSync), fmtBytes(rep.FleetHeapPerEnvoy))
	fmt.Fprintf(w, "loadtest (upstream)     CPU sync %.1fs, churn %.1fs; RSS peak %s\n", rep.Loadtest.CPUSyncS, rep.Loadtest.CPUChangesS, fmtBytes(rep.Loadtest.RSSPeak))
	if rep.Plot != "" {
		fmt.Fprintf(w, "plot                    %s\n", rep.Plot)
	}
	fmt.Fprintf(w, "\ntargets:\n")
	for _, v := range rep.Verdicts {
		fmt.Fprintf(w, "  %s  %-58s measured %s\n", report.Judge(v.Pass), v.Target, v.Measured)
	}
	if rep.Error != "" {
		fmt.Fprintf(w, "error: %s\n", rep.Error)
	}
}

// upstreamCache names what serves the relays: "incremental" or
// go-control-plane's "linear" caches.
func upstreamCache(cfg CtripConfig) string {
	if cfg.IncrementalUpstream && cfg.UpstreamProtocol == relay.ProtocolDelta {
		return "incremental"
	}
	return "linear"
}

// fmtBucket renders a histogram bucket (low, high], in seconds.
func fmtBucket(b [2]float64) string {
	lo := "0"
	if b[0] > 0 {
		lo = fmtMs(b[0] * 1000)
	}
	if b[1] > 1e9 {
		return fmt.Sprintf("(%s, ∞)", lo)
	}
	return fmt.Sprintf("(%s, %s]", lo, fmtMs(b[1]*1000))
}

func orNot(s string) string {
	if s == "" {
		return "not pinned"
	}
	return "CPUs " + s
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

func ms64(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// buildCommit is the VCS revision the binary was built from, if the
// toolchain stamped it (go build in a checkout), with "+dirty" for a
// modified tree.
func buildCommit() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	var rev string
	var dirty bool
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if rev != "" && dirty {
		rev += "+dirty"
	}
	return rev
}

// memAvailable is MemAvailable of /proc/meminfo, in bytes.
func memAvailable() (uint64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "MemAvailable:"); ok {
			f := strings.Fields(rest)
			if len(f) == 2 && f[1] == "kB" {
				n, err := strconv.ParseUint(f[0], 10, 64)
				return n << 10, err
			}
		}
	}
	return 0, errors.New("no MemAvailable in /proc/meminfo")
}

// guardMemory cancels with a cause, once, when the machine's available
// memory falls below floor (checked every second) until ctx ends.
func guardMemory(ctx context.Context, floor uint64, cancel context.CancelCauseFunc) {
	if floor == 0 {
		return
	}
	for traffic.SleepCtx(ctx, time.Second) {
		if avail, err := memAvailable(); err == nil && avail < floor {
			cancel(fmt.Errorf("stopped: the machine has %s of memory available, under the %s the run keeps free; scale it down",
				fmtBytes(avail), fmtBytes(floor)))
			return
		}
	}
}

// tierRelayProc is the parent's handle on a tier relay child.
type tierRelayProc struct {
	idx     int
	cfg     TierRelayChildConfig
	child   *Child
	fig     *report.Process
	replies chan string
	mu      sync.Mutex // one question at a time
}

// startTierRelay starts relay idx; its ledger sample lines go to sink.
func startTierRelay(ctx context.Context, start StartTierRelayFunc, cfg TierRelayChildConfig, idx int, sink *ledgerSamples) (*tierRelayProc, error) {
	p := &tierRelayProc{idx: idx, cfg: cfg, replies: make(chan string, 16)}
	child, err := start(ctx, cfg, func(line string) {
		if len(line) > 2 && line[1] == ' ' && (line[0] == ledgerVersionLine[0] || line[0] == ledgerACKLine[0]) {
			sink.add(idx, line)
			return
		}
		select {
		case p.replies <- line:
		default: // nobody asked: dropped
		}
	})
	if err != nil {
		return nil, err
	}
	p.child = child
	return p, nil
}

// ask sends cmd and returns the rest of the answer that starts with
// prefix.
func (p *tierRelayProc) ask(ctx context.Context, cmd, prefix string) (string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.replies) > 0 { // answers to questions given up on
		<-p.replies
	}
	if err := p.child.Send(cmd); err != nil {
		return "", fmt.Errorf("%s: %s: %w", p.cfg.ID, cmd, err)
	}
	timer := time.NewTimer(time.Minute)
	defer timer.Stop()
	for {
		select {
		case line := <-p.replies:
			if rest, ok := strings.CutPrefix(line, prefix); ok {
				return strings.TrimSpace(rest), nil
			}
		case <-p.child.Exited():
			return "", fmt.Errorf("%s exited (%v)", p.cfg.ID, p.child.exitErr())
		case <-timer.C:
			return "", fmt.Errorf("%s did not answer %q in a minute", p.cfg.ID, cmd)
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
}

// askJSON sends cmd and decodes the JSON of its answer, "<cmd> <JSON>".
func askJSON[T any](ctx context.Context, p *tierRelayProc, cmd string) (T, error) {
	var v T
	s, err := p.ask(ctx, cmd, cmd+" ")
	if err == nil {
		err = json.Unmarshal([]byte(s), &v)
	}
	return v, err
}

func (p *tierRelayProc) stats(ctx context.Context) (TierRelayStats, error) {
	return askJSON[TierRelayStats](ctx, p, tierStats)
}

// heap returns the relay's live heap after a collection.
func (p *tierRelayProc) heap(ctx context.Context) (uint64, error) {
	s, err := p.ask(ctx, tierHeap, tierHeap+" ")
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(s, 10, 64)
}

func (p *tierRelayProc) tier(ctx context.Context) (TierConvergence, error) {
	return askJSON[TierConvergence](ctx, p, tierConvergence)
}

func (p *tierRelayProc) ledgerOn(ctx context.Context, every time.Duration) error {
	_, err := p.ask(ctx, tierLedgerOn+" "+every.String(), tierLedgerOn)
	return err
}

func (p *tierRelayProc) ledgerOff(ctx context.Context) (LedgerSamplerStats, error) {
	return askJSON[LedgerSamplerStats](ctx, p, tierLedgerOff)
}

// ledgerSamples gathers the relays' ledger sample lines and joins them:
// each ACK with the receipt of its version at the key's origin.
type ledgerSamples struct {
	mu       sync.Mutex
	start    time.Time // of the churn: earlier versions and ACKs are not counted
	names    map[string]int32
	versions map[verKey]int64 // origin receipt, unix ns
	origin   map[int32]int    // key → the relay that is its origin
	acks     []ackRec
	bad      int
	windowAt int // acks before it were in an earlier window
}

type verKey struct {
	key, typ int32
	root     uint64
}

type ackRec struct {
	relay    int
	key, typ int32
	root     uint64
	at       int64
}

func newLedgerSamples() *ledgerSamples {
	return &ledgerSamples{names: map[string]int32{}, versions: map[verKey]int64{}, origin: map[int32]int{}}
}

func (s *ledgerSamples) setStart(t time.Time) {
	s.mu.Lock()
	s.start = t
	s.mu.Unlock()
}

// id interns a name. The caller holds s.mu.
func (s *ledgerSamples) id(name string) int32 {
	if i, ok := s.names[name]; ok {
		return i
	}
	i := int32(len(s.names))
	s.names[name] = i
	return i
}

// add takes one sample line of relay idx.
func (s *ledgerSamples) add(idx int, line string) {
	f := strings.Fields(line)
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case f[0] == ledgerVersionLine && len(f) == 6:
		root, err1 := strconv.ParseUint(f[3], 16, 64)
		at, err2 := strconv.ParseInt(f[4], 10, 64)
		if err1 != nil || err2 != nil {
			s.bad++
			return
		}
		if f[5] != "1" {
			return // a peer's receipt: after the origin's
		}
		k := verKey{s.id(f[1]), s.id(f[2]), root}
		if prev, ok := s.versions[k]; !ok || at < prev {
			s.versions[k] = at
		}
		s.origin[k.key] = idx
	case f[0] == ledgerACKLine && len(f) == 6:
		root, err1 := strconv.ParseUint(f[4], 16, 64)
		at, err2 := strconv.ParseInt(f[5], 10, 64)
		if err1 != nil || err2 != nil {
			s.bad++
			return
		}
		if at < s.start.UnixNano() {
			return // the initial sync's
		}
		s.acks = append(s.acks, ackRec{relay: idx, key: s.id(f[1]), typ: s.id(f[3]), root: root, at: at})
	default:
		s.bad++
	}
}

// window summarises the ACKs sampled since the last call that resolve now.
func (s *ledgerSamples) window() report.Latency {
	s.mu.Lock()
	defer s.mu.Unlock()
	var d []time.Duration
	start := s.start.UnixNano()
	for _, a := range s.acks[s.windowAt:] {
		if rcv, ok := s.versions[verKey{a.key, a.typ, a.root}]; ok && rcv >= start {
			d = append(d, time.Duration(a.at-rcv))
		}
	}
	s.windowAt = len(s.acks)
	return report.Summarize(d)
}

// ledgerJoin is what the samples say.
type ledgerJoin struct {
	all, owner, peer report.Latency
	unresolved       int
	series           []CtripSecond
	points           []ctripPoint
}

// ctripPoint is one sampled ACK on the timeline: seconds since t0, ms.
type ctripPoint struct{ at, ms float64 }

// maxPlotPoints bounds the points drawn (a regular subset of the ACKs).
const maxPlotPoints = 40_000

// join resolves every ACK sampled during the churn against its version's
// receipt at the origin; the timeline counts from t0.
func (s *ledgerSamples) join(t0 time.Time) ledgerJoin {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out ledgerJoin
	var all, owner, peer []time.Duration
	start := s.start.UnixNano()
	perSecond := map[int][]time.Duration{}
	step := max(1, len(s.acks)/maxPlotPoints)
	for i, a := range s.acks {
		rcv, ok := s.versions[verKey{a.key, a.typ, a.root}]
		if !ok {
			out.unresolved++
			continue
		}
		if rcv < start {
			continue // a version of before the churn
		}
		d := time.Duration(a.at - rcv)
		all = append(all, d)
		if s.origin[a.key] == a.relay {
			owner = append(owner, d)
		} else {
			peer = append(peer, d)
		}
		at := time.Unix(0, a.at).Sub(t0).Seconds()
		perSecond[int(at)] = append(perSecond[int(at)], d)
		if i%step == 0 {
			out.points = append(out.points, ctripPoint{at, ms64(d)})
		}
	}
	out.all, out.owner, out.peer = report.Summarize(all), report.Summarize(owner), report.Summarize(peer)
	for _, sec := range slices.Sorted(maps.Keys(perSecond)) {
		l := report.Summarize(perSecond[sec])
		out.series = append(out.series, CtripSecond{AtS: float64(sec), N: l.N, P50: ms64(l.P50), P99: ms64(l.P99), Max: ms64(l.Max)})
	}
	return out
}
