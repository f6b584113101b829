package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay/snapshot"
)

// WarmStartConfig configures RunWarmStart. Start from
// DefaultWarmStartConfig.
type WarmStartConfig struct {
	// Scenario is the upstream's configuration. Default: Ctrip's scale,
	// 30,000 ServiceEntries and 30,000 WorkloadEntries in 10 namespaces.
	Scenario upstream.Scenario
	// Keys is the number of aggregation keys; one Envoy per key probes
	// that the key's config is served. Default 100.
	Keys int
	// EnvoysPerConn is how many probe Envoys share a connection. Default 10.
	EnvoysPerConn int
	// Changes is the number of single endpoint changes whose etcd writes
	// are measured. Default 10.
	Changes int
	// EtcdDir holds the embedded etcd's data. Default: a temporary
	// directory, removed at the end.
	EtcdDir string
	// Quiet is how long etcd must see no write for the relay's
	// persistence to count as caught up: longer than the store's
	// FlushInterval (1s). Default 2s.
	Quiet time.Duration
	// SyncTimeout bounds each start. Default 10m.
	SyncTimeout time.Duration
	// WarmOnly skips the cold start and the changes: EtcdDir must hold
	// the snapshots of an earlier run (kept with --etcd-dir). Only the warm
	// start's time to ready and RSS are measured: the probes could not tell
	// what the earlier run's changes left.
	WarmOnly bool
	// RelayMemoryLimit, if set, runs the relay as in a container of this
	// memory limit, in bytes (RelayChildConfig.MemoryLimit). Default 0:
	// no limit, the Go runtime's default.
	RelayMemoryLimit int64
	// StartRelay starts the relay child. Required.
	StartRelay StartRelayFunc
	// StartEtcd, if set, runs etcd in a process of its own (as in
	// production, and so that this process's gigabytes of probe Envoys do
	// not slow it down); nil runs it in this process.
	StartEtcd func(ctx context.Context, dir string) (*Child, error)
	// Targets are the goals the run is judged against.
	Targets WarmStartTargets
}

// WarmStartTargets are the goals of the warm-start benchmark (issue 4).
type WarmStartTargets struct {
	// WarmStart bounds the time from a relay process's start until every
	// key's full config is servable from etcd: restored, checked, and the
	// relay ready. (Delivering it to the probes is timed too, but on this
	// benchmark that is bound by the probes decoding 4.6 million resources
	// on the same cores.) Default 5s.
	WarmStart time.Duration
	// BytesPerChange bounds the bytes written to etcd for one endpoint
	// change. Default 4 KiB.
	BytesPerChange int64
	// PeakRSS bounds the relay's peak resident set, cold and warm (issue
	// 17). Default 1.5 GiB.
	PeakRSS uint64 `json:"peak_rss"`
}

// DefaultWarmStartConfig returns the benchmark at Ctrip's scale.
func DefaultWarmStartConfig() WarmStartConfig {
	sc := upstream.DefaultScenario()
	sc.Services, sc.Endpoints, sc.Namespaces = 30000, 30000, 10
	return WarmStartConfig{
		Scenario: sc, Keys: 100, EnvoysPerConn: 10, Changes: 10,
		Quiet: 2 * time.Second, SyncTimeout: 10 * time.Minute,
		Targets: WarmStartTargets{WarmStart: 5 * time.Second, BytesPerChange: 4 << 10, PeakRSS: 3 << 29},
	}
}

// WarmStartPhase is one start of the relay.
type WarmStartPhase struct {
	// ReadyS is from the process's start until it reported ready to serve
	// (warm: every persisted key restored; cold: upstream reached).
	ReadyS float64 `json:"ready_s"`
	// ServedS is from the process's start until one Envoy of every key
	// held its full clusters and endpoints.
	ServedS float64 `json:"served_s"`
	// PeakRSS is the relay process's peak resident set, in bytes.
	PeakRSS uint64 `json:"peak_rss"`
	// CPUS is the relay process's CPU time until served.
	CPUS float64 `json:"cpu_s"`
}

// WarmStartReport is what RunWarmStart measured.
type WarmStartReport struct {
	Date     string `json:"date"`
	Machine  string `json:"machine"`
	Services int    `json:"services"`
	Entries  int    `json:"endpoints"`
	Keys     int    `json:"keys"`
	// RelayMemoryLimit is the container memory limit the relay ran as if
	// in (bytes; 0: none).
	RelayMemoryLimit int64 `json:"relay_memory_limit"`

	Cold WarmStartPhase `json:"cold"`
	// Warm is a start from etcd with the upstream down: everything served
	// comes from etcd.
	Warm WarmStartPhase `json:"warm"`

	// Persisted after the cold start: bytes written until etcd was quiet,
	// and what it holds then.
	SyncWrittenBytes int64 `json:"sync_written_bytes"`
	StoredKeys       int64 `json:"stored_keys"`
	StoredBytes      int64 `json:"stored_bytes"`
	EtcdDBSize       int64 `json:"etcd_db_size"`

	// Per single endpoint change: bytes written to etcd in all, and per
	// key that saw the change.
	ChangeBytes       []int64 `json:"change_bytes"`
	ChangePuts        []int64 `json:"change_puts"`
	ChangeKeys        []int   `json:"change_keys"`
	BytesPerChange    float64 `json:"bytes_per_change"`
	BytesPerChangeKey float64 `json:"bytes_per_change_key"`

	Targets WarmStartTargets `json:"targets"`
}

// RunWarmStart measures a relay's start from the upstream (cold) and from
// etcd (warm), and what persistence costs in etcd:
//
//  1. an embedded etcd and the synthetic upstream start in this process;
//  2. cold: a relay process starts with an empty etcd, and one probe Envoy
//     per key connects; timed until every probe holds its key's clusters
//     and endpoints; then etcd is given time to go quiet, and what it holds
//     is measured;
//  3. Changes single endpoint changes, each given time to reach etcd: the
//     bytes etcd's watchers see written for each;
//  4. the relay stops, and so does the upstream;
//  5. warm: a new relay process starts on the same etcd, with the upstream
//     still down, and new probes connect: timed the same way.
//
// Progress goes to out.
func RunWarmStart(ctx context.Context, cfg WarmStartConfig, out io.Writer) (*WarmStartReport, error) {
	if cfg.StartRelay == nil {
		return nil, errors.New("loadtest: field StartRelay is nil")
	}
	if cfg.Keys <= 0 || cfg.Changes < 0 || cfg.EnvoysPerConn <= 0 {
		return nil, errors.New("loadtest: Keys and EnvoysPerConn must be positive, Changes not negative")
	}
	rep := &WarmStartReport{
		Date:     time.Now().UTC().Format(time.RFC3339),
		Machine:  report.ThisMachine().Short(),
		Services: cfg.Scenario.Services, Entries: cfg.Scenario.Endpoints, Keys: cfg.Keys, RelayMemoryLimit: cfg.RelayMemoryLimit,
		Targets: cfg.Targets,
	}
	dir := cfg.EtcdDir
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "meshrelay-warmstart-"); err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
	}
	var endpoints []string
	if cfg.StartEtcd != nil {
		child, err := cfg.StartEtcd(ctx, dir)
		if err != nil {
			return nil, fmt.Errorf("start etcd: %w", err)
		}
		defer stopServing(ctx, child, nil)
		endpoints = []string{child.Addr()} // its socket's URL
	} else {
		etcd, err := snapshot.StartEmbedded(ctx, snapshot.EmbeddedConfig{Dir: dir})
		if err != nil {
			return nil, err
		}
		defer etcd.Close()
		endpoints = etcd.Endpoints()
	}
	def := snapshot.DefaultConfig()
	meter, err := snapshot.NewMeter(ctx, endpoints, def.Prefix, def.Cluster)
	if err != nil {
		return nil, err
	}
	defer meter.Close()

	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = cfg.Scenario
	up, err := upstream.Start(ctx, ucfg)
	if err != nil {
		return nil, err
	}
	defer up.Stop(context.WithoutCancel(ctx))
	rc := RelayChildConfig{Upstream: up.Addr(), Etcd: endpoints, MemoryLimit: cfg.RelayMemoryLimit}
	if cfg.WarmOnly {
		if err := up.Stop(ctx); err != nil {
			return rep, err
		}
		start := time.Now()
		child, err := cfg.StartRelay(ctx, rc)
		if err != nil {
			return rep, fmt.Errorf("warm: start relay: %w", err)
		}
		rep.Warm.ReadyS = time.Since(start).Seconds()
		if st, err := child.Stat(); err == nil {
			rep.Warm.PeakRSS, rep.Warm.CPUS = st.PeakRSS, st.CPU.Seconds()
		}
		fmt.Fprintf(out, "warm (upstream down): ready in %.2fs; relay peak RSS %s, CPU %.1fs\n", rep.Warm.ReadyS, fmtBytes(rep.Warm.PeakRSS), rep.Warm.CPUS)
		return rep, stopServing(ctx, child, nil)
	}

	fmt.Fprintf(out, "warmstart: %d services, %d endpoints, %d namespaces, %d keys\n", cfg.Scenario.Services, cfg.Scenario.Endpoints, cfg.Scenario.Namespaces, cfg.Keys)
	child, fleet, phase, err := startAndServe(ctx, cfg, rc, up, "cold", out)
	if err != nil {
		return rep, err
	}
	// Whatever ends the run from here stops the cold relay and its probes.
	stopCold := func() { _ = stopServing(ctx, child, fleet) }
	defer func() {
		if stopCold != nil {
			stopCold()
		}
	}()
	rep.Cold = phase
	qctx, cancel := context.WithTimeout(ctx, cfg.SyncTimeout)
	err = meter.WaitBeyond(qctx, 0)
	if err == nil {
		err = meter.Quiet(qctx, cfg.Quiet)
	}
	cancel()
	if err != nil {
		return rep, fmt.Errorf("etcd never went quiet after the cold start: %w", err)
	}
	_, rep.SyncWrittenBytes = meter.Written()
	if rep.StoredKeys, rep.StoredBytes, rep.EtcdDBSize, err = meter.Stored(ctx); err != nil {
		return rep, err
	}
	fmt.Fprintf(out, "cold: persisted %s written; etcd holds %d keys, %s (db %s)\n", fmtBytes(uint64(rep.SyncWrittenBytes)), rep.StoredKeys, fmtBytes(uint64(rep.StoredBytes)), fmtBytes(uint64(rep.EtcdDBSize)))

	// Single endpoint changes.
	groupKeys := map[string]int{}
	for _, g := range fleet.Groups() {
		groupKeys[g]++
	}
	for i := range cfg.Changes {
		putsBefore, before := meter.Written()
		c, err := up.MoveEndpoint((i * 7919) % max(1, cfg.Scenario.Endpoints))
		if err != nil {
			return rep, err
		}
		sctx, cancel := context.WithTimeout(ctx, cfg.SyncTimeout)
		err = fleet.WaitSynced(sctx, up)
		if err == nil {
			// Every change is seen by some key, whose owner writes it.
			err = meter.WaitBeyond(sctx, before)
		}
		if err == nil {
			err = meter.Quiet(sctx, cfg.Quiet)
		}
		cancel()
		if err != nil {
			return rep, fmt.Errorf("change %d: %w", i, err)
		}
		putsAfter, after := meter.Written()
		keys := 0
		for _, g := range c.Groups {
			keys += groupKeys[g]
		}
		rep.ChangeBytes = append(rep.ChangeBytes, after-before)
		rep.ChangePuts = append(rep.ChangePuts, putsAfter-putsBefore)
		rep.ChangeKeys = append(rep.ChangeKeys, keys)
	}
	var sumB, sumK int64
	for i, b := range rep.ChangeBytes {
		sumB += b
		sumK += int64(rep.ChangeKeys[i])
	}
	if n := len(rep.ChangeBytes); n > 0 {
		rep.BytesPerChange = float64(sumB) / float64(n)
		rep.BytesPerChangeKey = float64(sumB) / float64(max(sumK, 1))
		fmt.Fprintf(out, "changes: %d single endpoint changes wrote %.0f bytes each on average (%.0f per key that saw it)\n", n, rep.BytesPerChange, rep.BytesPerChangeKey)
	}
	err = stopServing(ctx, child, fleet)
	stopCold = nil
	if err != nil {
		return rep, fmt.Errorf("stop the cold relay: %w", err)
	}
	if err := up.Stop(ctx); err != nil {
		return rep, err
	}

	child, fleet, phase, err = startAndServe(ctx, cfg, rc, up, "warm (upstream down)", out)
	if err != nil {
		return rep, err
	}
	rep.Warm = phase
	err = stopServing(ctx, child, fleet)
	PrintWarmStart(out, rep)
	return rep, err
}

// startAndServe starts a relay process and one probe Envoy per key, and
// returns once every probe holds its key's clusters and endpoints. The
// caller stops both.
func startAndServe(ctx context.Context, cfg WarmStartConfig, rc RelayChildConfig, up *upstream.Upstream, tag string, out io.Writer) (*Child, *traffic.Fleet, WarmStartPhase, error) {
	var ph WarmStartPhase
	start := time.Now()
	child, err := cfg.StartRelay(ctx, rc)
	if err != nil {
		return nil, nil, ph, fmt.Errorf("%s: start relay: %w", tag, err)
	}
	ph.ReadyS = time.Since(start).Seconds()
	fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: cfg.Scenario, Envoys: cfg.Keys, Keys: cfg.Keys, Target: child.Addr(), EnvoysPerConn: cfg.EnvoysPerConn})
	if err != nil {
		_ = stopServing(ctx, child, nil)
		return nil, nil, ph, fmt.Errorf("%s: start probes: %w", tag, err)
	}
	sctx, cancel := context.WithTimeout(ctx, cfg.SyncTimeout)
	err = fleet.WaitSynced(sctx, up)
	cancel()
	ph.ServedS = time.Since(start).Seconds()
	if st, serr := child.Stat(); serr == nil {
		ph.PeakRSS, ph.CPUS = st.PeakRSS, st.CPU.Seconds()
	}
	if err != nil {
		_ = stopServing(ctx, child, fleet)
		return nil, nil, ph, fmt.Errorf("%s: %w", tag, err)
	}
	if v := fleet.Violations(); len(v) > 0 {
		_ = stopServing(ctx, child, fleet)
		return nil, nil, ph, fmt.Errorf("%s: protocol violations: %v", tag, v[:min(len(v), 3)])
	}
	fmt.Fprintf(out, "%s: ready in %.2fs, every key served in %.2fs; relay peak RSS %s, CPU %.1fs\n", tag, ph.ReadyS, ph.ServedS, fmtBytes(ph.PeakRSS), ph.CPUS)
	return child, fleet, ph, nil
}

// stopServing stops the probes (if any), then the child, and returns the
// child's Stop: within stopTimeout, after which the child is killed.
func stopServing(ctx context.Context, child *Child, probes *traffic.Fleet) error {
	sctx, cancel := stopContext(ctx)
	defer cancel()
	if probes != nil {
		probes.Stop(sctx)
	}
	return child.Stop(sctx)
}

// PrintWarmStart writes the report as a table with the targets judged.
func PrintWarmStart(w io.Writer, r *WarmStartReport) {
	fmt.Fprintf(w, "\nwarmstart: %d ServiceEntries, %d WorkloadEntries, %d keys\nmachine: %s; %s\n\n", r.Services, r.Entries, r.Keys, r.Machine, r.Date)
	fmt.Fprintf(w, "  %-52s %14s %14s\n", "", "cold", "warm")
	fmt.Fprintf(w, "  %-52s %13.2fs %13.2fs\n", "process start → ready to serve", r.Cold.ReadyS, r.Warm.ReadyS)
	fmt.Fprintf(w, "  %-52s %13.2fs %13.2fs\n", "process start → every key's config at an Envoy", r.Cold.ServedS, r.Warm.ServedS)
	rssRow := "relay peak RSS"
	if r.RelayMemoryLimit > 0 {
		rssRow += fmt.Sprintf(" (as in a %s container)", fmtBytes(uint64(r.RelayMemoryLimit)))
	}
	fmt.Fprintf(w, "  %-52s %14s %14s\n", rssRow, fmtBytes(r.Cold.PeakRSS), fmtBytes(r.Warm.PeakRSS))
	fmt.Fprintf(w, "  %-52s %13.1fs %13.1fs\n", "relay CPU until served", r.Cold.CPUS, r.Warm.CPUS)
	fmt.Fprintf(w, "\n  etcd after the cold start: %d keys, %s of keys and values (db file %s); %s written to get there\n",
		r.StoredKeys, fmtBytes(uint64(r.StoredBytes)), fmtBytes(uint64(r.EtcdDBSize)), fmtBytes(uint64(r.SyncWrittenBytes)))
	if len(r.ChangeBytes) > 0 {
		fmt.Fprintf(w, "  one endpoint change: %.0f bytes written on average, %.0f per key that saw it\n", r.BytesPerChange, r.BytesPerChangeKey)
		fmt.Fprintf(w, "    %d changes: bytes %v, puts %v, keys that saw it %v\n", len(r.ChangeBytes), r.ChangeBytes, r.ChangePuts, r.ChangeKeys)
	}
	fmt.Fprintf(w, "\ntargets:\n")
	if r.Targets.WarmStart > 0 {
		fmt.Fprintf(w, "  %s  warm start ≤ %s to every key's config servable    measured %.2fs (every key restored and checked, relay ready)\n",
			report.Judge(r.Warm.ReadyS > 0 && r.Warm.ReadyS <= r.Targets.WarmStart.Seconds()), r.Targets.WarmStart, r.Warm.ReadyS)
	}
	if r.Targets.BytesPerChange > 0 && len(r.ChangeBytes) > 0 {
		fmt.Fprintf(w, "  %s  one endpoint change writes ≤ %d bytes     measured %.0f (max %d)\n",
			report.Judge(r.BytesPerChange <= float64(r.Targets.BytesPerChange)), r.Targets.BytesPerChange, r.BytesPerChange, slices.Max(r.ChangeBytes))
	}
	if r.Targets.PeakRSS > 0 {
		for _, ph := range []struct {
			name string
			p    WarmStartPhase
		}{{"cold", r.Cold}, {"warm", r.Warm}} {
			if ph.p.PeakRSS > 0 {
				fmt.Fprintf(w, "  %s  relay peak RSS ≤ %s, %s                 measured %s\n",
					report.Judge(ph.p.PeakRSS <= r.Targets.PeakRSS), fmtBytes(r.Targets.PeakRSS), ph.name, fmtBytes(ph.p.PeakRSS))
			}
		}
	}
}

// RunEtcdChild is the main of an etcd child process: an embedded etcd with
// its data in dir, on the unix socket in dir whose URL it prints as "xds
// <url>" (the protocol StartChild waits for), until ctx ends or in reaches
// EOF.
func RunEtcdChild(ctx context.Context, dir string, in io.Reader, out io.Writer) error {
	e, err := snapshot.StartEmbedded(ctx, snapshot.EmbeddedConfig{Dir: dir})
	if err != nil {
		return err
	}
	defer e.Close()
	return serveChild(ctx, e.Endpoints()[0], in, out, nil)
}

// ExecEtcd returns a WarmStartConfig.StartEtcd that runs path with args
// followed by --dir; cmd/loadtest passes its own executable and
// "etcd-child".
func ExecEtcd(path string, stderr io.Writer, args ...string) func(ctx context.Context, dir string) (*Child, error) {
	return func(ctx context.Context, dir string) (*Child, error) {
		return StartChild(ctx, ChildConfig{
			Path:   path,
			Args:   append(append([]string(nil), args...), "--dir", dir),
			Stderr: stderr,
		})
	}
}
