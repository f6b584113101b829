package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger/ledgerpb"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/realenvoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/peers"
)

// The fanout benchmark with real Envoys: the same changes, direct and
// relayed, timed as the Envoys themselves see them (each cluster's EDS
// update_time in /stats, Envoy's own clock stamp of when it applied the
// assignment) and, relayed, as the relay's ledger recorded their ACKs;
// beside a simulated fleet of the same size on the same scenario, so the
// report says how far the simulated Envoy's timing is from a real one's.

// MaxRealEnvoys bounds RealFanoutConfig.Envoys: each real Envoy is a
// process of about 84 MiB with the default scenario, and 2 cores run about
// a hundred of them.
const MaxRealEnvoys = 100

// RealFanoutConfig configures RunRealFanout. Start from
// DefaultRealFanoutConfig.
type RealFanoutConfig struct {
	// Binary is the Envoy binary (realenvoy.Find). Required.
	Binary string
	// Scenario is the upstream's configuration.
	Scenario upstream.Scenario
	// Envoys is the number of real Envoys, at most MaxRealEnvoys.
	// Default 20.
	Envoys int
	// Keys is the number of aggregation keys they spread over. Default 5.
	Keys int
	// Changes is the number of endpoint changes timed, one after another.
	// Default 20.
	Changes int
	// Protocols and Modes are run in order, each mode for each protocol.
	Protocols []envoy.Protocol
	Modes     []FanoutMode
	// Simulated also runs a fleet of as many simulated Envoys after the
	// real ones, in each mode, for comparison.
	Simulated bool
	// StartRelay starts the relay child. Required if Modes has Relayed.
	StartRelay StartRelayFunc
	// SyncTimeout bounds the initial sync, ChangeTimeout one change.
	SyncTimeout, ChangeTimeout time.Duration
	// ChangeGap is the pause after a change reached every Envoy; Settle
	// the pause between runs and before the first change.
	ChangeGap, Settle time.Duration
	// Seed picks the endpoints that move (the same in every run).
	Seed int64
}

// DefaultRealFanoutConfig is a scenario 2 cores run with real Envoys: 200
// services and endpoints over 5 namespaces, 20 Envoys over 5 keys.
func DefaultRealFanoutConfig() RealFanoutConfig {
	sc := upstream.DefaultScenario()
	sc.Services, sc.Endpoints, sc.Namespaces = 200, 200, 5
	return RealFanoutConfig{
		Scenario:      sc,
		Envoys:        20,
		Keys:          5,
		Changes:       20,
		Protocols:     []envoy.Protocol{envoy.Delta, envoy.SotW},
		Modes:         []FanoutMode{Direct, Relayed},
		Simulated:     true,
		SyncTimeout:   5 * time.Minute,
		ChangeTimeout: time.Minute,
		ChangeGap:     100 * time.Millisecond,
		Settle:        2 * time.Second,
		Seed:          1,
	}
}

func (c *RealFanoutConfig) validate() error {
	switch {
	case c.Binary == "":
		return errors.New("loadtest: RealFanoutConfig.Binary is required (realenvoy.Find)")
	case c.Envoys <= 0 || c.Envoys > MaxRealEnvoys:
		return fmt.Errorf("loadtest: real Envoys must be in [1, %d], got %d", MaxRealEnvoys, c.Envoys)
	case c.Keys <= 0 || c.Keys > c.Envoys:
		return fmt.Errorf("loadtest: keys must be in [1, Envoys], got %d", c.Keys)
	case c.Changes <= 0:
		return errors.New("loadtest: changes must be positive")
	case len(c.Protocols) == 0 || len(c.Modes) == 0:
		return errors.New("loadtest: no protocol or no mode to run")
	case slices.Contains(c.Modes, Relayed) && c.StartRelay == nil:
		return errors.New("loadtest: field StartRelay is nil")
	case len(movable(c.Scenario)) == 0:
		return errors.New("loadtest: the scenario has no endpoint every namespace sees")
	}
	return nil
}

// RealFanoutReport is what RunRealFanout measured.
type RealFanoutReport struct {
	Date     string          `json:"date"`
	Machine  report.Machine  `json:"machine"`
	Envoy    string          `json:"envoy"`
	Scenario FanoutSummary   `json:"scenario"`
	Runs     []RealFanoutRun `json:"runs"`
	// Simulated are the runs of the simulated fleet of the same size.
	Simulated []FanoutRun `json:"simulated,omitempty"`
}

// RealFanoutRun is one protocol in one mode with real Envoys.
type RealFanoutRun struct {
	Protocol string     `json:"protocol"`
	Mode     FanoutMode `json:"mode"`
	Envoys   int        `json:"envoys"`
	// InitialSyncS is from the first Envoy's start until every Envoy held
	// its namespace's whole config.
	InitialSyncS    float64 `json:"initial_sync_s"`
	UpstreamStreams int     `json:"upstream_streams"`
	ChangesDone     int     `json:"changes_done"`
	// Applied is change → each Envoy applied it (its update_time of the
	// cluster's EDS), over (change, Envoy); AppliedAll change → the last
	// Envoy, over changes.
	Applied    report.LatencyMs `json:"applied_ms"`
	AppliedAll report.LatencyMs `json:"applied_all_ms"`
	// Acked and AckedAll are the same as the relay's ledger recorded the
	// Envoys' ACKs (relayed runs).
	Acked    *report.LatencyMs `json:"acked_ms,omitempty"`
	AckedAll *report.LatencyMs `json:"acked_all_ms,omitempty"`
	// Relay is the relay child's CPU and memory (relayed runs).
	Relay *report.Process `json:"relay,omitempty"`
	// The Envoys' own figures: CPU of all of them over the changes, and
	// RSS at the end, mean and largest.
	EnvoysCPUChangesS float64 `json:"envoys_cpu_changes_s"`
	EnvoyRSSMean      uint64  `json:"envoy_rss_mean_bytes"`
	EnvoyRSSMax       uint64  `json:"envoy_rss_max_bytes"`
	Error             string  `json:"error,omitempty"`
}

// RunRealFanout runs, for each protocol and mode, cfg.Envoys real Envoys
// against a synthetic upstream (relayed: through a relay child), waits for
// their initial sync, then moves cfg.Changes endpoints every namespace
// sees, one at a time, each timed until every Envoy applied it (and,
// relayed, until the relay's ledger has every ACK). With cfg.Simulated a
// simulated fleet of the same size runs the same after each. It prints
// progress and the results to out.
func RunRealFanout(ctx context.Context, cfg RealFanoutConfig, out io.Writer) (*RealFanoutReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	version, _ := realenvoy.VersionOf(ctx, cfg.Binary)
	rep := &RealFanoutReport{
		Date:    time.Now().UTC().Format(time.RFC3339),
		Machine: report.ThisMachine(),
		Envoy:   version,
		Scenario: FanoutSummary{Services: cfg.Scenario.Services, Endpoints: cfg.Scenario.Endpoints,
			Namespaces: cfg.Scenario.Namespaces, LocalFraction: cfg.Scenario.LocalFraction,
			Envoys: cfg.Envoys, Keys: cfg.Keys, Changes: cfg.Changes, EnvoysPerConn: 1,
			ChangeGapMs: float64(cfg.ChangeGap) / float64(time.Millisecond)},
	}
	var errs []error
	for _, p := range cfg.Protocols {
		for _, m := range cfg.Modes {
			if ctx.Err() != nil {
				break
			}
			run := runRealFanoutOnce(ctx, cfg, p, m, out)
			rep.Runs = append(rep.Runs, run)
			if run.Error != "" {
				errs = append(errs, fmt.Errorf("%s %s (real): %s", p, m, run.Error))
			}
			if !traffic.SleepCtx(ctx, cfg.Settle) {
				break
			}
			if cfg.Simulated {
				fc := DefaultFanoutConfig()
				fc.Scenario, fc.Envoys, fc.Keys, fc.Changes = cfg.Scenario, cfg.Envoys, cfg.Keys, cfg.Changes
				fc.StartRate, fc.SyncTimeout, fc.ChangeTimeout = 0, cfg.SyncTimeout, cfg.ChangeTimeout
				fc.ChangeGap, fc.Settle, fc.Seed, fc.StartRelay = cfg.ChangeGap, cfg.Settle, cfg.Seed, cfg.StartRelay
				sim := runFanoutOnce(ctx, fc, p, m, runTransport{}, nil, io.Discard)
				rep.Simulated = append(rep.Simulated, sim)
				if sim.Error != "" {
					errs = append(errs, fmt.Errorf("%s %s (simulated): %s", p, m, sim.Error))
				}
				if !traffic.SleepCtx(ctx, cfg.Settle) {
					break
				}
			}
		}
	}
	PrintRealFanout(out, rep)
	if ctx.Err() != nil {
		errs = append(errs, ctx.Err())
	}
	return rep, errors.Join(errs...)
}

func runRealFanoutOnce(ctx context.Context, cfg RealFanoutConfig, p envoy.Protocol, mode FanoutMode, out io.Writer) (run RealFanoutRun) {
	run = RealFanoutRun{Protocol: p.String(), Mode: mode, Envoys: cfg.Envoys}
	tag := fmt.Sprintf("%s %s, %d real Envoys", p, mode, cfg.Envoys)
	fail := func(err error) RealFanoutRun {
		run.Error = err.Error()
		fmt.Fprintf(out, "%s: %v\n", tag, err)
		return run
	}
	up, err := upstream.Start(ctx, upstream.Config{Scenario: cfg.Scenario})
	if err != nil {
		return fail(err)
	}
	defer func() {
		sctx, cancel := stopContext(ctx)
		defer cancel()
		_ = up.Stop(sctx)
	}()
	target := up.Addr()
	var child *Child
	if mode == Relayed {
		child, err = cfg.StartRelay(ctx, RelayChildConfig{Upstream: up.Addr(), UpstreamProtocol: relay.Protocol(p.String())})
		if err != nil {
			return fail(fmt.Errorf("start relay: %w", err))
		}
		defer func() {
			sctx, cancel := stopContext(ctx)
			defer cancel()
			if err := child.Stop(sctx); err != nil {
				fmt.Fprintf(out, "%s: stop relay: %v\n", tag, err)
			}
		}()
		target = child.Addr()
	}

	dir, err := os.MkdirTemp("", "loadtest-envoys-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(dir)
	fmt.Fprintf(out, "%s: starting them at %s\n", tag, target)
	start := time.Now()
	envoys := make([]*realenvoy.Envoy, 0, cfg.Envoys)
	defer func() { realenvoy.StopAll(envoys) }()
	groups := make([]string, cfg.Envoys)
	for i := range cfg.Envoys {
		node := traffic.KeyNode(cfg.Scenario, i%cfg.Keys, i/cfg.Keys) // as the fleet spreads its Envoys
		edir := fmt.Sprintf("%s/envoy-%d", dir, i)
		if err := os.Mkdir(edir, 0o700); err != nil {
			return fail(err)
		}
		e, err := realenvoy.Start(ctx, realenvoy.Config{Binary: cfg.Binary, XDS: target, Delta: p == envoy.Delta, Node: node, Dir: edir})
		if err != nil {
			return fail(err)
		}
		envoys = append(envoys, e)
		groups[i] = cfg.Scenario.Group(node)
	}
	sctx, cancel := context.WithTimeout(ctx, cfg.SyncTimeout)
	err = waitRealSynced(sctx, envoys, groups, up)
	cancel()
	run.InitialSyncS = time.Since(start).Seconds()
	run.UpstreamStreams = int(up.Stats().OpenStreams)
	if err != nil {
		return fail(fmt.Errorf("initial sync: %w", err))
	}
	fmt.Fprintf(out, "%s: synced in %.1fs; upstream streams %d\n", tag, run.InitialSyncS, run.UpstreamStreams)
	if !traffic.SleepCtx(ctx, cfg.Settle) {
		return fail(ctx.Err())
	}

	var ledgerConn *grpc.ClientConn
	if child != nil {
		if ledgerConn, err = grpc.NewClient(child.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
			return fail(err)
		}
		defer ledgerConn.Close()
	}
	relayBefore, envoysBefore, err := realFanoutCPU(child, envoys)
	if err != nil {
		return fail(err)
	}
	var applied, appliedAll, acked, ackedAll []time.Duration
	cands := movable(cfg.Scenario)
	rng := rand.New(rand.NewPCG(uint64(cfg.Seed), 0x66616e6f7574)) // moveEndpoints' sequence
	for i := range cfg.Changes {
		c, err := up.MoveEndpoint(cands[rng.IntN(len(cands))])
		if err != nil {
			return fail(fmt.Errorf("change %d: %w", i, err))
		}
		cctx, cancel := context.WithTimeout(ctx, cfg.ChangeTimeout)
		per, err := waitApplied(cctx, envoys, c)
		if err == nil && ledgerConn != nil {
			var ack []time.Duration
			if ack, err = waitLedgerACKs(cctx, ledgerConn, envoys, c); err == nil {
				acked = append(acked, ack...)
				ackedAll = append(ackedAll, slices.Max(ack))
			}
		}
		cancel()
		if err != nil {
			return fail(fmt.Errorf("change %d (%s): %w", i, c.Name, err))
		}
		applied = append(applied, per...)
		appliedAll = append(appliedAll, slices.Max(per))
		run.ChangesDone++
		if !traffic.SleepCtx(ctx, cfg.ChangeGap) {
			return fail(ctx.Err())
		}
	}
	relayAfter, envoysAfter, err := realFanoutCPU(child, envoys)
	if err != nil {
		return fail(err)
	}
	run.Applied, run.AppliedAll = report.Summarize(applied).Ms(), report.Summarize(appliedAll).Ms()
	if child != nil {
		a, aa := report.Summarize(acked).Ms(), report.Summarize(ackedAll).Ms()
		run.Acked, run.AckedAll = &a, &aa
		run.Relay = &report.Process{CPUChangesS: (relayAfter.CPU - relayBefore.CPU).Seconds(), RSSEnd: relayAfter.RSS, RSSPeak: relayAfter.PeakRSS}
	}
	run.EnvoysCPUChangesS = (envoysAfter.CPU - envoysBefore.CPU).Seconds()
	for _, e := range envoys {
		st, err := ReadProcStat(e.Pid())
		if err != nil {
			return fail(err)
		}
		run.EnvoyRSSMean += st.RSS / uint64(len(envoys))
		run.EnvoyRSSMax = max(run.EnvoyRSSMax, st.RSS)
	}
	fmt.Fprintf(out, "%s: %d changes; change → last Envoy applied P50 %s P99 %s\n", tag, run.ChangesDone,
		fmtMs(run.AppliedAll.P50), fmtMs(run.AppliedAll.P99))
	return run
}

// realFanoutCPU reads the relay child's figures (zero without one) and the
// Envoys' CPU summed.
func realFanoutCPU(child *Child, envoys []*realenvoy.Envoy) (relayStat, envoysStat ProcStat, err error) {
	if child != nil {
		if relayStat, err = child.Stat(); err != nil {
			return
		}
	}
	for _, e := range envoys {
		st, err := ReadProcStat(e.Pid())
		if err != nil {
			return relayStat, envoysStat, err
		}
		envoysStat.CPU += st.CPU
	}
	return relayStat, envoysStat, nil
}

// waitRealSynced waits until every Envoy holds every resource name the
// upstream serves its group.
func waitRealSynced(ctx context.Context, envoys []*realenvoy.Envoy, groups []string, up *upstream.Upstream) error {
	for i, e := range envoys {
		want := up.Snapshot(groups[i])
		for {
			dump, err := e.ConfigDump(ctx)
			if err != nil {
				return err
			}
			got, err := realenvoy.Dynamic(dump)
			if err != nil {
				return err
			}
			if holdsNames(got, want) {
				break
			}
			if !traffic.SleepCtx(ctx, 50*time.Millisecond) {
				return fmt.Errorf("envoy %d never held its config: %w", i, ctx.Err())
			}
		}
	}
	return nil
}

func holdsNames(got map[string]map[string]realenvoy.Resource, want map[string]map[string]proto.Message) bool {
	for typeURL, res := range want {
		if len(got[typeURL]) != len(res) {
			return false
		}
		for n := range res {
			if _, ok := got[typeURL][n]; !ok {
				return false
			}
		}
	}
	return true
}

// appliedPoll is how often waitApplied asks each Envoy: seldom, since
// Envoy answers on the thread that applies config (realenvoy.Envoy.Stat).
// Polling every 20 ms at 200 clusters made Envoy apply a change 13 ms
// late instead of under 1 ms.
const appliedPoll = 250 * time.Millisecond

// waitApplied waits until every Envoy applied change c (a
// ClusterLoadAssignment): its cluster's EDS update_time, Envoy's own stamp
// in milliseconds, at or past the change's publication. It returns each
// Envoy's delay, to the millisecond Envoy stamps (a change applied within
// the millisecond it was published counts as 0). The delay is Envoy's
// stamp, not when the poll saw it.
func waitApplied(ctx context.Context, envoys []*realenvoy.Envoy, c upstream.Change) ([]time.Duration, error) {
	stat := "cluster." + c.Name + ".update_time"
	at := c.At.UnixMilli()
	out := make([]time.Duration, len(envoys))
	var wg sync.WaitGroup
	errs := make([]error, len(envoys))
	for i, e := range envoys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				// The first look too only after a while: the Envoys apply
				// the change meanwhile, without answering polls.
				if !traffic.SleepCtx(ctx, appliedPoll) {
					errs[i] = fmt.Errorf("envoy %d did not apply it: %w", i, ctx.Err())
					return
				}
				v, found, err := e.Gauge(ctx, stat)
				if err != nil {
					errs[i] = err
					return
				}
				if ms, err := strconv.ParseInt(v, 10, 64); found && err == nil && ms >= at {
					out[i] = max(0, time.UnixMilli(ms).Sub(c.At))
					return
				}
			}
		}()
	}
	wg.Wait()
	return out, errors.Join(errs...)
}

// waitLedgerACKs waits until the relay's ledger (read as a peer relay
// reads it) has every Envoy's ACK of EDS at or after c, and returns each
// Envoy's delay.
func waitLedgerACKs(ctx context.Context, conn *grpc.ClientConn, envoys []*realenvoy.Envoy, c upstream.Change) ([]time.Duration, error) {
	client := ledgerpb.NewLedgerClient(conn)
	mctx := metadata.AppendToOutgoingContext(ctx, peers.MDRelay, "loadtest")
	for {
		p, err := client.GetSummary(mctx, &ledgerpb.SummaryRequest{})
		if err != nil {
			return nil, fmt.Errorf("the relay's ledger: %w", err)
		}
		sum, err := ledgerpb.ToSummary(p)
		if err != nil {
			return nil, err
		}
		var out []time.Duration
		for _, k := range sum.Keys {
			for _, e := range k.Envoys {
				for _, et := range e.Types {
					if et.Type == resource.EndpointType && e.Connected() && !et.AckedAt.Before(c.At) {
						out = append(out, et.AckedAt.Sub(c.At))
					}
				}
			}
		}
		if len(out) == len(envoys) {
			return out, nil
		}
		if !traffic.SleepCtx(ctx, 20*time.Millisecond) {
			return nil, fmt.Errorf("the relay's ledger has %d of %d ACKs: %w", len(out), len(envoys), ctx.Err())
		}
	}
}

// PrintRealFanout writes rep's results as a table.
func PrintRealFanout(out io.Writer, rep *RealFanoutReport) {
	fmt.Fprintf(out, "\nReal Envoys (%s), %s; %d CPUs, %s, load average at start %s\n", rep.Envoy, rep.Date,
		rep.Machine.CPUs, rep.Machine.GoVersion, rep.Machine.LoadAvg)
	fmt.Fprintf(out, "%d services, %d endpoints, %d namespaces; %d Envoys over %d keys; %d endpoint changes\n\n",
		rep.Scenario.Services, rep.Scenario.Endpoints, rep.Scenario.Namespaces, rep.Scenario.Envoys, rep.Scenario.Keys, rep.Scenario.Changes)
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "protocol\tmode\tEnvoys\tsync\tupstream streams\tchange→all P50\tP99\tper Envoy P50\tP99\tclock\trelay CPU/change\tEnvoys CPU\tEnvoy RSS mean/max")
	for _, r := range rep.Runs {
		if r.Error != "" {
			fmt.Fprintf(w, "%s\t%s\treal\tfailed: %s\n", r.Protocol, r.Mode, r.Error)
			continue
		}
		fmt.Fprintf(w, "%s\t%s\treal\t%.1fs\t%d\t%s\t%s\t%s\t%s\tEnvoy applied\t%s\t%.2fs\t%s / %s\n", r.Protocol, r.Mode, r.InitialSyncS, r.UpstreamStreams,
			fmtMs(r.AppliedAll.P50), fmtMs(r.AppliedAll.P99), fmtMs(r.Applied.P50), fmtMs(r.Applied.P99), relayCPUPerChange(r.Relay, r.ChangesDone), r.EnvoysCPUChangesS,
			fmtBytes(r.EnvoyRSSMean), fmtBytes(r.EnvoyRSSMax))
		if r.AckedAll != nil {
			fmt.Fprintf(w, "\t\t\t\t\t%s\t%s\t%s\t%s\trelay ledger ACK\t\t\t\n", fmtMs(r.AckedAll.P50), fmtMs(r.AckedAll.P99), fmtMs(r.Acked.P50), fmtMs(r.Acked.P99))
		}
	}
	for _, r := range rep.Simulated {
		if r.Error != "" {
			fmt.Fprintf(w, "%s\t%s\tsimulated\tfailed: %s\n", r.Protocol, r.Mode, r.Error)
			continue
		}
		fmt.Fprintf(w, "%s\t%s\tsimulated\t%.1fs\t%d\t%s\t%s\t%s\t%s\tsim ACK\t%s\t\t\n", r.Protocol, r.Mode, r.InitialSyncS, r.UpstreamStreams.AfterSync,
			fmtMs(r.Complete.P50), fmtMs(r.Complete.P99), fmtMs(r.ACK.P50), fmtMs(r.ACK.P99), relayCPUPerChange(r.Relay, r.ChangesDone))
	}
	w.Flush()
}

// relayCPUPerChange is the relay's CPU over the changes, per change ("-"
// without a relay).
func relayCPUPerChange(relay *report.Process, changes int) string {
	if relay == nil || changes == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f ms", 1000*relay.CPUChangesS/float64(changes))
}
