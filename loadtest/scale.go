package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/aggkey"
)

// ScaleConfig configures RunScale: a tier scaled out by one relay, then in
// by one, with Envoys connected through a Service-like proxy.
type ScaleConfig struct {
	Scenario upstream.Scenario
	// Relays is the tier's size before the scale-out. Default 3.
	Relays int
	// Envoys and Keys: the fleet. Defaults 3,000 and 100.
	Envoys, Keys int
	// StartRate bounds Envoys connecting per second. Default 500.
	StartRate float64
	// EnvoysPerConn is how many Envoys share a gRPC connection. Default 3:
	// in one process every connection costs about six file descriptors
	// (the Envoy's, the proxy's two, the relay's, and their share of
	// peers), and 3,000 connections alone would exhaust a limit of 20,000.
	EnvoysPerConn int
	// Changes is the number of endpoint changes timed before the
	// scale-out (the baseline) and during the scale-in. Default 10.
	Changes int
	// ChangeGap is the time between two changes. Default 500ms.
	ChangeGap time.Duration
	// Tolerance is how far from the fair share (a fraction) a relay's
	// Envoy streams may be for the tier to count as rebalanced. Default 0.2.
	Tolerance float64
	// SyncTimeout and PhaseTimeout bound the initial sync and each phase.
	// Defaults 10m and 3m.
	SyncTimeout, PhaseTimeout time.Duration
	// TLS makes every relay serve a TLS port too, authenticating streams
	// with Verifier, and the Envoys connect through a Service in front of
	// those ports, each with its service account's token: every stream a
	// relay sheds is a new handshake and authentication. Default false.
	TLS bool
	// Verifier is the relays' token verifier with TLS. Default local.
	Verifier Verifier
	// TokenReviewLatency is the fake Kubernetes API's answer time
	// (tokenreview). Default 2ms.
	TokenReviewLatency time.Duration
	// FleetCommand, if set, runs the fleet in a child process of its own
	// (as FanoutConfig.FleetCommand), its stderr to FleetStderr; nil runs
	// it in this process, beside the tier. cmd/loadtest sets it unless
	// --fleet-process=false.
	FleetCommand FleetCommand
	FleetStderr  io.Writer
	// TierCPUs, if set, pins this process (the tier of relays, the
	// synthetic upstream and the Tracker) to these CPUs for the run
	// (PinProcess; its CPUs are restored after). FleetCPUs pins the fleet
	// child (needs FleetCommand). Default: not pinned.
	TierCPUs, FleetCPUs CPUSet
}

// DefaultScaleConfig is what `loadtest scale` runs with no flags.
func DefaultScaleConfig() ScaleConfig {
	sc := upstream.DefaultScenario()
	sc.Services, sc.Endpoints, sc.Namespaces, sc.LocalFraction = 500, 500, 10, 0.25
	return ScaleConfig{
		Scenario: sc, Relays: 3, Envoys: 3000, Keys: 100, StartRate: 500, EnvoysPerConn: 3,
		Changes: 10, ChangeGap: 500 * time.Millisecond, Tolerance: 0.2,
		SyncTimeout: 10 * time.Minute, PhaseTimeout: 3 * time.Minute,
		Verifier: VerifierLocal, TokenReviewLatency: 2 * time.Millisecond,
	}
}

// ScaleReport is what RunScale measured.
type ScaleReport struct {
	Date    string         `json:"date"`
	Machine report.Machine `json:"machine"`
	Config  ScaleSummary   `json:"config"`
	// SyncS is the initial sync of the fleet through the tier.
	SyncS float64 `json:"initial_sync_s"`
	// Baseline is change → last Envoy's ACK before any scaling.
	Baseline report.Latency `json:"baseline_change_to_all"`
	Phases   []ScalePhase   `json:"phases"`
	// Transport is plaintext, tls-local or tls-tokenreview; TokenReviews
	// the reviews the fake Kubernetes API answered (every relay's cache
	// misses).
	Transport    string `json:"transport"`
	TokenReviews int    `json:"token_reviews,omitempty"`
	// Pinning says where the tier and the fleet ran.
	Pinning ScalePinning `json:"pinning"`
	// Tier and Fleet are this process's and the fleet child's CPU and
	// memory: CPUSyncS over the initial sync, CPUChangesS over the
	// baseline changes. Fleet is nil with the fleet in this process.
	Tier  report.Process  `json:"tier_process"`
	Fleet *report.Process `json:"fleet_process,omitempty"`
	// TierCPUPerChangeEnvoyUs is this process's CPU over the baseline
	// changes per change per Envoy, in µs, and TierCPUPerMBMs per MB
	// (10^6 bytes) the Envoys received meanwhile, in ms: the relays' cost,
	// with the upstream's and the Tracker's (and, with the fleet in this
	// process, the Envoys').
	EnvoyBytesBaseline      uint64  `json:"envoy_bytes_baseline"`
	TierCPUPerChangeEnvoyUs float64 `json:"tier_cpu_per_change_per_envoy_us"`
	TierCPUPerMBMs          float64 `json:"tier_cpu_ms_per_mb_baseline"`
}

// ScalePinning says where a scale run's processes ran.
type ScalePinning struct {
	// FleetProcess: the simulated Envoys ran in a child process.
	FleetProcess bool `json:"fleet_process"`
	// TierCPUs and FleetCPUs are what the kernel reported of this
	// process's and the fleet child's threads once pinned ("" not pinned).
	TierCPUs  string `json:"tier_cpus,omitempty"`
	FleetCPUs string `json:"fleet_cpus,omitempty"`
}

// ScaleSummary is the configuration a report was measured with.
type ScaleSummary struct {
	Services, Endpoints, Namespaces int
	Relays, Envoys, Keys            int
	Tolerance                       float64
}

// ScalePhase is one scaling step.
type ScalePhase struct {
	Name string `json:"name"`
	// RelaysBefore and RelaysAfter count running relays.
	RelaysBefore int `json:"relays_before"`
	RelaysAfter  int `json:"relays_after"`
	// KeysMoved is the number of keys whose owner changed; Ideal is the
	// fraction a perfect consistent hash would move (1/relays after an
	// add, 1/relays before a removal).
	KeysMoved     int     `json:"keys_moved"`
	KeysMovedFrac float64 `json:"keys_moved_fraction"`
	IdealFrac     float64 `json:"ideal_fraction"`
	// StreamsMoved is the number of Envoy streams that were reopened
	// (moved by balancing or draining).
	StreamsMoved int `json:"envoy_streams_moved"`
	// RebalancedS is the time from the step until every relay holds
	// within Tolerance of its fair share, every Envoy is connected and the
	// upstream holds one stream per key; Rebalanced is false if
	// PhaseTimeout passed first.
	RebalancedS float64 `json:"rebalanced_s"`
	Rebalanced  bool    `json:"rebalanced"`
	// StreamsPerRelay is each running relay's Envoy streams at the end.
	StreamsPerRelay []int `json:"envoy_streams_per_relay"`
	// BytesResent is what the moved Envoys received during the phase;
	// FullState what the same Envoys received in their initial sync.
	BytesResent uint64  `json:"bytes_resent_to_moved"`
	FullState   uint64  `json:"full_state_of_moved"`
	ResentPct   float64 `json:"resent_percent"`
	// MoveBytes is what moving cost the moved Envoys: what each received
	// beyond the mean of the Envoys of its group that did not move (the
	// changes made meanwhile reached both); MovePct against FullState.
	// Without changes it is BytesResent less the unmoved Envoys' traffic.
	MoveBytes uint64  `json:"move_bytes"`
	MovePct   float64 `json:"move_percent"`
	// UpstreamBefore and UpstreamAfter are the upstream's open streams.
	UpstreamBefore int64 `json:"upstream_streams_before"`
	UpstreamAfter  int64 `json:"upstream_streams_after"`
	// During is change → last Envoy's ACK for changes made during the
	// phase (the scale-in only).
	During     report.Latency `json:"change_to_all_during"`
	Violations int            `json:"violations"`
}

// scaleRun holds the parts of one RunScale.
type scaleRun struct {
	cfg     ScaleConfig
	up      *upstream.Upstream
	tier    *cluster.Tier
	fleet   benchFleet
	groups  []string // each Envoy's upstream group
	tracker *traffic.Tracker
	keys    []aggkey.Key
}

// RunScale measures a tier scaling out and in: cfg.Relays relays, a fleet
// connected through a Service-like proxy; add one relay (no changes, so
// that what is re-sent is only what moving costs), then stop one
// gracefully while endpoints change. Everything runs in this process.
func RunScale(ctx context.Context, cfg ScaleConfig, out io.Writer) (*ScaleReport, error) {
	if cfg.Relays < 2 || cfg.Envoys < 1 || cfg.Keys < 1 || cfg.Changes < 1 || cfg.Tolerance <= 0 {
		return nil, errors.New("loadtest: scale needs at least 2 relays, 1 Envoy, 1 key, 1 change and a positive tolerance")
	}
	if cfg.Verifier == "" {
		cfg.Verifier = VerifierLocal
	}
	if _, err := ParseVerifier(string(cfg.Verifier)); err != nil {
		return nil, err
	}
	if len(cfg.FleetCPUs) > 0 && cfg.FleetCommand == nil {
		return nil, errors.New("loadtest: field FleetCPUs needs a fleet in a child process (FleetCommand)")
	}
	for _, err := range []error{CheckCPUs("field TierCPUs", cfg.TierCPUs), CheckCPUs("field FleetCPUs", cfg.FleetCPUs)} {
		if err != nil {
			return nil, fmt.Errorf("loadtest: %w", err)
		}
	}
	rep := &ScaleReport{
		Date:    time.Now().UTC().Format(time.RFC3339),
		Machine: report.ThisMachine(),
		Config: ScaleSummary{Services: cfg.Scenario.Services, Endpoints: cfg.Scenario.Endpoints, Namespaces: cfg.Scenario.Namespaces,
			Relays: cfg.Relays, Envoys: cfg.Envoys, Keys: cfg.Keys, Tolerance: cfg.Tolerance},
		Transport: transportName(cfg.TLS, cfg.Verifier),
		Pinning:   ScalePinning{FleetProcess: cfg.FleetCommand != nil},
	}
	stopCtx := context.WithoutCancel(ctx)
	if len(cfg.TierCPUs) > 0 {
		all, err := AllowedCPUs()
		if err != nil {
			return nil, err
		}
		if err := PinProcess(cfg.TierCPUs); err != nil {
			return nil, err
		}
		defer func() { _ = PinProcess(all) }()
		rep.Pinning.TierCPUs = childCPUs(os.Getpid())
		fmt.Fprintf(out, "scale: this process (the tier, the upstream) pinned to CPUs %s\n", rep.Pinning.TierCPUs)
	}
	s := &scaleRun{cfg: cfg, tracker: traffic.NewTracker()}
	for i := range cfg.Envoys {
		s.groups = append(s.groups, cfg.Scenario.Group(traffic.KeyNode(cfg.Scenario, i%cfg.Keys, i/cfg.Keys)))
	}
	procs := &procMeter{}
	procs.add(func() (ProcStat, error) { return ReadProcStat(os.Getpid()) }, &rep.Tier)

	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = cfg.Scenario
	ucfg.OnPublish = func(c upstream.Change) { s.tracker.Track(c) }
	up, err := upstream.Start(ctx, ucfg)
	if err != nil {
		return nil, err
	}
	defer up.Stop(stopCtx)
	s.up = up

	tcfg := cluster.TierConfig{Relays: cfg.Relays, Upstream: up.Addr(), DrainPeriod: 5 * time.Second,
		BalanceInterval: 2 * time.Second, ShedRate: 100}
	var creds *MeshCredentials
	var kube *FakeKubeAPI
	var tlsErr error // of the relays' TLS set-up
	if cfg.TLS {
		dir, err := os.MkdirTemp("", "loadtest-tls-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
		if creds, err = NewMeshCredentials(dir); err != nil {
			return nil, err
		}
		reviewURL := ""
		if cfg.Verifier == VerifierTokenReview {
			if kube, err = creds.StartTokenReview(cfg.TokenReviewLatency); err != nil {
				return nil, err
			}
			defer kube.Stop()
			reviewURL = kube.URL()
		}
		tcfg.Relay = func(rc *relay.Config) {
			rc.XDS.TLSListen = "127.0.0.1:0"
			if err := creds.RelayTLS(cfg.Verifier, reviewURL).Apply(stopCtx, rc); err != nil && tlsErr == nil {
				tlsErr = err
			}
			// What this measures is the TLS port's admission; the relays
			// talk to each other in this process, over an in-memory
			// network, without mTLS or a gossip key.
			rc.Tier.InsecureForDevelopment = true
		}
	}
	tier, err := cluster.StartTier(stopCtx, tcfg)
	if err != nil {
		return nil, err
	}
	defer tier.Stop(stopCtx)
	if tlsErr != nil {
		return nil, tlsErr
	}
	s.tier = tier
	if err := s.waitConverged(ctx); err != nil {
		return nil, err
	}
	target := tier.Addr()
	for k := range cfg.Keys {
		s.keys = append(s.keys, aggkey.Istio{}.Key(traffic.KeyNode(cfg.Scenario, k, 0)))
	}

	fmt.Fprintf(out, "scale: %d relays, %d Envoys over %d keys (%d services, %d endpoints), connecting at %.0f/s, %s\n",
		cfg.Relays, cfg.Envoys, cfg.Keys, cfg.Scenario.Services, cfg.Scenario.Endpoints, cfg.StartRate, rep.Transport)
	spec := fleetSpec{
		// With TLS the tier's Service fronts the relays' TLS ports
		// (readyAddrs), as a cluster's does istiod's 15012.
		fleet: FleetChildConfig{
			Scenario: cfg.Scenario, Envoys: cfg.Envoys, Keys: cfg.Keys, Protocol: envoy.Delta.String(),
			Target: target, StartRate: cfg.StartRate, EnvoysPerConn: cfg.EnvoysPerConn,
		},
		creds:   creds,
		command: cfg.FleetCommand, cpus: cfg.FleetCPUs, stderr: cfg.FleetStderr, tracker: s.tracker,
		started: func(fp *FleetProcess) {
			rep.Fleet = &report.Process{Pid: fp.Pid(), CPUs: childCPUs(fp.Pid())}
			rep.Pinning.FleetCPUs = rep.Fleet.CPUs
			procs.add(fp.Stat, rep.Fleet)
			fmt.Fprintf(out, "scale: fleet pid %d, CPUs %s\n", fp.Pid(), rep.Fleet.CPUs)
		},
	}
	// The fleet follows ctx (an interrupted start returns), and its stop
	// is bounded: a fleet child that does not exit in time is killed.
	fleet, start, err := startBenchFleet(ctx, spec)
	if fleet != nil {
		defer func() {
			sctx, cancel := stopContext(ctx)
			defer cancel()
			_ = fleet.Stop(sctx)
		}()
	}
	if err != nil {
		return nil, err
	}
	s.fleet = fleet
	sctx, cancel := context.WithTimeout(ctx, cfg.SyncTimeout)
	err = fleet.WaitSynced(sctx, up)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("loadtest: initial sync: %w", err)
	}
	rep.SyncS = time.Since(start).Seconds()
	procs.mark(phaseSync)
	fmt.Fprintf(out, "scale: %d Envoys synced in %.1fs; upstream streams %d\n", cfg.Envoys, rep.SyncS, up.Stats().OpenStreams)
	if cfg.TLS {
		// A proven identity is part of the key (aggkey.WithIdentity):
		// read the keys the relays made.
		if s.keys, err = s.servedKeys(); err != nil {
			return nil, err
		}
	}
	if _, err := s.waitRebalanced(ctx, time.Now()); err != nil {
		return nil, err
	}
	if err := s.waitQuiet(ctx); err != nil {
		return nil, err
	}

	// The baseline: changes with the tier settled. From here a fleet
	// child streams every ACK that can time a change.
	s.tracker.Reset()
	if err := fleet.Track(ctx, up.Generation()); err != nil {
		return nil, err
	}
	fig, err := fleet.Figures(ctx)
	if err != nil {
		return nil, err
	}
	bytesBefore := fig.BytesReceived
	procs.mark(phaseChangesStart)
	if err := s.changes(ctx, 0); err != nil {
		return nil, err
	}
	procs.mark(phaseEnd)
	if fig, err = fleet.Figures(ctx); err != nil {
		return nil, err
	}
	rep.EnvoyBytesBaseline = fig.BytesReceived - bytesBefore
	if rep.Tier.Err == "" {
		rep.TierCPUPerChangeEnvoyUs = rep.Tier.CPUChangesS / float64(cfg.Changes) / float64(cfg.Envoys) * 1e6
		if rep.EnvoyBytesBaseline > 0 {
			rep.TierCPUPerMBMs = rep.Tier.CPUChangesS * 1e3 / (float64(rep.EnvoyBytesBaseline) / 1e6)
		}
	}
	_, rep.Baseline, _ = s.tracker.Results()
	fmt.Fprintf(out, "scale: baseline change → all Envoys P99 %s (%d changes); this process's CPU %.2fs: %.1fµs per change per Envoy, %.1fms per MB sent\n",
		report.MS(rep.Baseline.P99), rep.Baseline.N, rep.Tier.CPUChangesS, rep.TierCPUPerChangeEnvoyUs, rep.TierCPUPerMBMs)
	if rep.Fleet != nil {
		fmt.Fprintf(out, "scale: fleet process CPU %.2fs over the sync, %.2fs over the baseline changes; RSS peak %s\n",
			rep.Fleet.CPUSyncS, rep.Fleet.CPUChangesS, fmtBytes(rep.Fleet.RSSPeak))
	}

	// Scale out: one more relay, nothing changing upstream.
	p, err := s.phase(ctx, fmt.Sprintf("add relay-%d", cfg.Relays), false, func() error {
		if _, err := tier.Add(stopCtx); err != nil {
			return err
		}
		return tlsErr
	})
	if err != nil {
		return nil, err
	}
	rep.Phases = append(rep.Phases, p)
	s.print(out, p)

	// Scale in: stop relay-0 gracefully while endpoints change.
	p, err = s.phase(ctx, "stop relay-0 (graceful)", true, func() error {
		return tier.StopRelay(stopCtx, 0, true)
	})
	if err != nil {
		return nil, err
	}
	rep.Phases = append(rep.Phases, p)
	s.print(out, p)
	// A fleet child's ACKs reach the tracker over its observation stream:
	// if the stream broke, the latencies during the moves missed some.
	if fp, ok := fleet.(*FleetProcess); ok {
		if err := fp.Err(); err != nil {
			return rep, err
		}
	}
	if kube != nil {
		rep.TokenReviews = kube.Requests()
		fmt.Fprintf(out, "scale: %d token reviews for %d tokens over the whole run (each relay caches its verdicts)\n", rep.TokenReviews, creds.Tokens())
		if err := kube.Err(); err != nil {
			return rep, err
		}
	}
	return rep, nil
}

func (s *scaleRun) waitConverged(ctx context.Context) error {
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return s.tier.WaitConverged(wctx)
}

// servedKeys returns the sorted keys of the Envoy streams the running
// relays serve; there must be cfg.Keys.
func (s *scaleRun) servedKeys() ([]aggkey.Key, error) {
	var keys []aggkey.Key
	for _, r := range s.tier.Running() {
		for _, c := range r.Node.Relay().Clients() {
			if c.PeerRelay == "" && !slices.Contains(keys, c.Key) {
				keys = append(keys, c.Key)
			}
		}
	}
	slices.Sort(keys)
	if len(keys) != s.cfg.Keys {
		return nil, fmt.Errorf("loadtest: the relays serve %d keys, want %d", len(keys), s.cfg.Keys)
	}
	return keys, nil
}

// owners returns each key's owner, as the first running relay's ring has
// it.
func (s *scaleRun) owners() []string {
	r := s.tier.Running()[0]
	out := make([]string, len(s.keys))
	for i, k := range s.keys {
		m, _ := r.Node.Ring().Locate(string(k))
		out[i] = m.Name
	}
	return out
}

func (s *scaleRun) snapshot(ctx context.Context) (bytes []uint64, reconnects []uint64, err error) {
	c, err := s.fleet.Counters(ctx)
	return c.Bytes, c.Reconnects, err
}

// violations counts the fleet's protocol violations.
func (s *scaleRun) violations(ctx context.Context) (int, error) {
	fig, err := s.fleet.Figures(ctx)
	return fig.Violations, err
}

// phase runs one scaling step and measures it.
func (s *scaleRun) phase(ctx context.Context, name string, withChanges bool, step func() error) (ScalePhase, error) {
	p := ScalePhase{Name: name, RelaysBefore: len(s.tier.Running()), UpstreamBefore: s.up.Stats().OpenStreams}
	ownersBefore := s.owners()
	bytesBefore, reconnBefore, err := s.snapshot(ctx)
	if err != nil {
		return p, err
	}
	violationsBefore, err := s.violations(ctx)
	if err != nil {
		return p, err
	}
	s.tracker.Reset()

	start := time.Now()
	if err := step(); err != nil {
		return p, err
	}
	// The changes made during the step end with the phase, whatever ends
	// it: none is made once it has returned.
	changesCtx, stopChanges := context.WithCancel(ctx)
	changesDone := make(chan error, 1)
	if withChanges {
		go func() { changesDone <- s.changes(changesCtx, s.cfg.Changes) }()
	} else {
		changesDone <- nil
	}
	changesErr := sync.OnceValue(func() error { return <-changesDone })
	defer func() {
		stopChanges()
		_ = changesErr()
	}()
	if err := s.waitConverged(ctx); err != nil {
		return p, err
	}
	d, err := s.waitRebalanced(ctx, start)
	if err != nil {
		return p, err
	}
	p.Rebalanced, p.RebalancedS = d >= 0, d.Seconds()
	if err := changesErr(); err != nil {
		return p, err
	}
	if err := s.waitQuiet(ctx); err != nil {
		return p, err
	}
	if withChanges {
		_, p.During, _ = s.tracker.Results()
	}

	p.RelaysAfter = len(s.tier.Running())
	p.UpstreamAfter = s.up.Stats().OpenStreams
	ownersAfter := s.owners()
	for i := range ownersBefore {
		if ownersBefore[i] != ownersAfter[i] {
			p.KeysMoved++
		}
	}
	p.KeysMovedFrac = float64(p.KeysMoved) / float64(len(s.keys))
	p.IdealFrac = 1 / float64(max(p.RelaysBefore, p.RelaysAfter))
	bytesAfter, reconnAfter, err := s.snapshot(ctx)
	if err != nil {
		return p, err
	}
	groups := s.groups
	stay := map[string][2]uint64{} // group → bytes received by Envoys that did not move, and their count
	for i := range reconnAfter {
		if reconnAfter[i] == reconnBefore[i] {
			g := stay[groups[i]]
			stay[groups[i]] = [2]uint64{g[0] + bytesAfter[i] - bytesBefore[i], g[1] + 1}
		}
	}
	for i := range reconnAfter {
		if reconnAfter[i] > reconnBefore[i] {
			got := bytesAfter[i] - bytesBefore[i]
			p.StreamsMoved += int(reconnAfter[i] - reconnBefore[i])
			p.BytesResent += got
			p.FullState += bytesBefore[i]
			var mean uint64
			if g := stay[groups[i]]; g[1] > 0 {
				mean = g[0] / g[1]
			}
			if got > mean {
				p.MoveBytes += got - mean
			}
		}
	}
	if p.FullState > 0 {
		p.ResentPct = 100 * float64(p.BytesResent) / float64(p.FullState)
		p.MovePct = 100 * float64(p.MoveBytes) / float64(p.FullState)
	}
	for _, r := range s.tier.Running() {
		p.StreamsPerRelay = append(p.StreamsPerRelay, r.Node.Relay().Stats().Streams)
	}
	violationsAfter, err := s.violations(ctx)
	p.Violations = violationsAfter - violationsBefore
	return p, err
}

// rebalanced reports whether every running relay holds within Tolerance of
// the fair share, every Envoy is connected, and the upstream holds one
// stream per key.
func (s *scaleRun) rebalanced(ctx context.Context) (bool, error) {
	running := s.tier.Running()
	fair := float64(s.cfg.Envoys) / float64(len(running))
	total := 0
	for _, r := range running {
		n := r.Node.Relay().Stats().Streams
		total += n
		if math.Abs(float64(n)-fair) > s.cfg.Tolerance*fair {
			return false, nil
		}
	}
	if total != s.cfg.Envoys || s.up.Stats().OpenStreams != int64(len(s.keys)) {
		return false, nil
	}
	fig, err := s.fleet.Figures(ctx)
	return fig.Connected == s.cfg.Envoys, err
}

// waitRebalanced waits until rebalanced and returns the time since start,
// or -1 if PhaseTimeout passed first.
func (s *scaleRun) waitRebalanced(ctx context.Context, start time.Time) (time.Duration, error) {
	deadline := time.Now().Add(s.cfg.PhaseTimeout)
	for {
		ok, err := s.rebalanced(ctx)
		if err != nil {
			return 0, err
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			return -1, nil
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return time.Since(start), nil
}

// waitQuiet waits until no Envoy stream has been moved for 3 s (balancing
// goes on past "within tolerance", down to the share plus a small margin),
// or PhaseTimeout passes.
func (s *scaleRun) waitQuiet(ctx context.Context) error {
	total := func() (uint64, error) {
		fig, err := s.fleet.Figures(ctx)
		return fig.Reconnects, err
	}
	deadline := time.Now().Add(s.cfg.PhaseTimeout)
	last, err := total()
	since := time.Now()
	for err == nil && time.Since(since) < 3*time.Second && time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
		var n uint64
		if n, err = total(); n != last {
			last, since = n, time.Now()
		}
	}
	return err
}

// changes moves n endpoints, ChangeGap apart (n = 0: cfg.Changes, each
// waited for until it reached every Envoy).
func (s *scaleRun) changes(ctx context.Context, n int) error {
	wait := n == 0
	if wait {
		n = s.cfg.Changes
	}
	for i := range n {
		c, err := s.up.MoveEndpoint(i * 7 % s.cfg.Scenario.Endpoints)
		if err != nil {
			return err
		}
		if wait {
			select {
			case <-s.tracker.Track(c):
			case <-time.After(s.cfg.PhaseTimeout):
				return fmt.Errorf("loadtest: change %d did not reach every Envoy in %v", i, s.cfg.PhaseTimeout)
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		select {
		case <-time.After(s.cfg.ChangeGap):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

func (s *scaleRun) print(out io.Writer, p ScalePhase) {
	reb := fmt.Sprintf("%.1fs", p.RebalancedS)
	if !p.Rebalanced {
		reb = "not within the phase timeout"
	}
	fmt.Fprintf(out, "scale: %s: relays %d → %d; keys moved %d (%.1f%%, ideal %.1f%%); Envoy streams moved %d; rebalanced %s, per relay %v\n",
		p.Name, p.RelaysBefore, p.RelaysAfter, p.KeysMoved, 100*p.KeysMovedFrac, 100*p.IdealFrac, p.StreamsMoved, reb, p.StreamsPerRelay)
	fmt.Fprintf(out, "scale: %s: bytes re-sent to moved Envoys %d of their full state %d (%.2f%%), %d (%.2f%%) beyond what their unmoved group received; upstream streams %d → %d (keys %d); violations %d\n",
		p.Name, p.BytesResent, p.FullState, p.ResentPct, p.MoveBytes, p.MovePct, p.UpstreamBefore, p.UpstreamAfter, len(s.keys), p.Violations)
	if p.During.N > 0 {
		fmt.Fprintf(out, "scale: %s: change → all Envoys during the move P50 %s P99 %s (%d changes)\n", p.Name, report.MS(p.During.P50), report.MS(p.During.P99), p.During.N)
	}
}
