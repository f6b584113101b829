// Package demo is meshrelay demo: a tier in one process (loadtest/cluster)
// behind a synthetic istiod, simulated Envoys with churn, a schedule of
// relay crashes and restarts, and a table of what the tier does, a row a
// second. It imports no benchmark driver, so the relay's binary that runs
// it stays lean.
package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/snapshot"
)

// Config configures Run: a whole tier in one process.
type Config struct {
	Scenario         upstream.Scenario
	Envoys           int
	Keys             int
	Protocol         envoy.Protocol // the Envoys'
	UpstreamProtocol relay.Protocol // the relays', to the upstream
	// Relays is the number of relays started. Default 3.
	Relays int
	// Schedule lists tier events to play (see ParseSchedule).
	Schedule []Event
	// Input, if set, is read for commands while the demo runs, one a line:
	// "kill N", "stop N", "start N", "add" (see ParseCommand).
	Input io.Reader
	// ChurnRate is upstream changes per second (endpoint moves, and now and
	// then a service added or removed). 0: no churn.
	ChurnRate float64
	// Duration bounds the run; 0 runs until ctx ends.
	Duration time.Duration
	// Interval between table rows. Default 1s.
	Interval time.Duration
	// Logger for the relays. Default: discard.
	Logger *slog.Logger
	// NoEtcd runs the tier without snapshots. By default an embedded etcd
	// (in a temporary directory) holds the relays' snapshots, and a
	// restarted relay starts warm from it.
	NoEtcd bool
	// RealEnvoys real Envoys (of EnvoyBinary, see realenvoy.Find) join
	// the simulated ones, each with a listener of its own routing to a
	// backend the demo runs: every row shows, for each, its relay, its
	// key, whether it is SYNCED, and a request through it.
	RealEnvoys  int
	EnvoyBinary string
}

// Event is one change to the tier: At after the start, Action (kill,
// stop, start or add) on relay Relay.
type Event struct {
	At     time.Duration
	Action string
	Relay  int
}

func (e Event) String() string {
	if e.Action == "add" {
		return "add a relay"
	}
	return fmt.Sprintf("%s relay-%d", e.Action, e.Relay)
}

// DefaultConfig is what `meshrelay demo` runs with no flags: three
// relays, one of which crashes at 8 s and comes back at 13 s.
func DefaultConfig() Config {
	sc := upstream.DefaultScenario()
	sc.Services, sc.Endpoints, sc.Namespaces, sc.LocalFraction = 200, 400, 5, 0.2
	return Config{
		Scenario:         sc,
		Envoys:           200,
		Keys:             20,
		Protocol:         envoy.Delta,
		UpstreamProtocol: relay.ProtocolDelta,
		Relays:           3,
		Schedule:         []Event{{At: 8 * time.Second, Action: "kill", Relay: 1}, {At: 13 * time.Second, Action: "start", Relay: 1}},
		ChurnRate:        5,
		Duration:         20 * time.Second,
		Interval:         time.Second,
	}
}

// ParseSchedule parses a comma-separated list of AT:ACTION[:RELAY], e.g.
// "8s:kill:1,13s:start:1,16s:add". Actions: kill (crash: no leave, no
// drain), stop (graceful: leave the ring, drain), start (a new incarnation
// of a stopped relay), add (one more relay). An empty string is no event.
func ParseSchedule(s string) ([]Event, error) {
	var out []Event
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		at, rest, ok := strings.Cut(item, ":")
		d, err := time.ParseDuration(at)
		if !ok || err != nil || d < 0 {
			return nil, fmt.Errorf("loadtest: schedule %q: want AT:ACTION[:RELAY] with AT a duration like 8s", item)
		}
		e, err := ParseCommand(strings.ReplaceAll(rest, ":", " "))
		if err != nil {
			return nil, fmt.Errorf("loadtest: schedule %q: %w", item, err)
		}
		e.At = d
		out = append(out, e)
	}
	slices.SortStableFunc(out, func(a, b Event) int { return int(a.At - b.At) })
	return out, nil
}

// ParseCommand parses "kill N", "stop N", "start N" or "add".
func ParseCommand(s string) (Event, error) {
	f := strings.Fields(s)
	switch {
	case len(f) == 1 && f[0] == "add":
		return Event{Action: "add"}, nil
	case len(f) == 2 && (f[0] == "kill" || f[0] == "stop" || f[0] == "start"):
		n, err := strconv.Atoi(strings.TrimPrefix(f[1], "relay-"))
		if err != nil || n < 0 || n > 1000 {
			return Event{}, fmt.Errorf("relay %q: want a relay number", f[1])
		}
		return Event{Action: f[0], Relay: n}, nil
	}
	return Event{}, fmt.Errorf("command %q: want kill N, stop N, start N or add", s)
}

// warmWatch follows a relay the demo just started until it is ready:
// then its count of keys restored from etcd is final (a relay that loads
// snapshots takes streams only once they are loaded, and it loads them
// within 30 s or starts cold).
type warmWatch struct {
	relay    string
	started  time.Time
	ready    func() bool // the relay takes streams
	gone     func() bool // the relay was stopped since
	restored func() int  // keys it restored from etcd so far
}

const (
	// warmInline is how long a start's line waits for the count; past it
	// the line says the restore is under way and a later line gives it.
	warmInline = 2 * time.Second
	// warmBound bounds the wait for readiness: the relay's own bound on
	// loading snapshots (30 s), and some.
	warmBound = 35 * time.Second
)

// watchWarm returns a warmWatch of slot i of t, just started (nil if the
// tier has no etcd or the slot does not run).
func watchWarm(t *cluster.Tier, i int, etcd bool) *warmWatch {
	if !etcd {
		return nil
	}
	r := t.Relay(i)
	if r.Node == nil {
		return nil
	}
	rel := r.Node.Relay()
	return &warmWatch{
		relay: r.ID, started: time.Now(), ready: rel.Ready,
		gone:     func() bool { return !t.IsRunning(r) },
		restored: func() int { return rel.Stats().RestoredKeys },
	}
}

// note says what the relay restored, once that is known (done); after
// warmBound, or once the relay was stopped, it says what it restored so
// far (done too). final asks for a note now, known or not.
func (w *warmWatch) note(now time.Time, final bool) (note string, done bool) {
	switch {
	case w.ready():
		return fmt.Sprintf("warm: %d keys restored from etcd", w.restored()), true
	case w.gone():
		return fmt.Sprintf("stopped before it was ready; %d keys restored from etcd by then", w.restored()), true
	case final || now.Sub(w.started) >= warmBound:
		return fmt.Sprintf("not ready yet; %d keys restored from etcd so far", w.restored()), true
	}
	return "", false
}

// apply carries out e on the tier t.
func apply(ctx context.Context, t *cluster.Tier, e Event) error {
	if e.Action == "add" {
		_, err := t.Add(ctx)
		return err
	}
	n := t.Slots()
	if e.Relay >= n {
		return fmt.Errorf("no relay-%d (the tier has relay-0 to relay-%d)", e.Relay, n-1)
	}
	running := t.IsRunning(t.Relay(e.Relay))
	switch e.Action {
	case "kill", "stop":
		if !running {
			return fmt.Errorf("relay-%d is not running", e.Relay)
		}
		return t.StopRelay(ctx, e.Relay, e.Action == "stop")
	case "start":
		if running {
			return fmt.Errorf("relay-%d is running", e.Relay)
		}
		return t.Start(ctx, e.Relay)
	}
	return fmt.Errorf("unknown action %q", e.Action)
}

// Run starts a synthetic upstream, a tier of relays in front of it
// (behind a Service-like proxy) and a fleet of simulated Envoys, churns the
// upstream, plays the schedule and the commands read from Input, and prints
// a live table of the tier's convergence and ring to out until Duration
// passes or ctx ends.
func Run(ctx context.Context, cfg Config, out io.Writer) error {
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.Relays <= 0 {
		cfg.Relays = 3
	}
	if cfg.Duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, cfg.Duration)
		defer cancel()
	}
	stopCtx := context.WithoutCancel(ctx)

	var backend *http.Server
	if cfg.RealEnvoys > 0 {
		if cfg.EnvoyBinary == "" {
			return errors.New("loadtest: real Envoys need Config.EnvoyBinary")
		}
		var err error
		if backend, err = addDemoService(&cfg.Scenario); err != nil {
			return err
		}
		defer backend.Close()
	}
	tracker := traffic.NewTracker()
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = cfg.Scenario
	ucfg.OnPublish = func(c upstream.Change) { tracker.Track(c) }
	up, err := upstream.New(ucfg)
	if err != nil {
		return err
	}
	if err := up.Start(ctx); err != nil {
		return err
	}
	defer up.Stop(stopCtx)

	var etcdEndpoints []string
	if !cfg.NoEtcd {
		dir, err := os.MkdirTemp("", "meshrelay-demo-etcd-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		etcd, err := snapshot.StartEmbedded(ctx, snapshot.EmbeddedConfig{Dir: dir})
		if err != nil {
			return err
		}
		defer etcd.Close()
		etcdEndpoints = etcd.Endpoints()
	}
	tier, err := cluster.StartTier(stopCtx, cluster.TierConfig{
		Relays: cfg.Relays, Upstream: up.Addr(), UpstreamProtocol: cfg.UpstreamProtocol, Logger: cfg.Logger,
		Etcd: etcdEndpoints,
	})
	if err != nil {
		return err
	}
	defer tier.Stop(stopCtx)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err = tier.WaitConverged(wctx)
	cancel()
	if err != nil {
		return err
	}

	sc := cfg.Scenario
	fmt.Fprintf(out, "meshrelay demo\n")
	fmt.Fprintf(out, "  upstream  %s: synthetic istiod, %d ServiceEntries, %d WorkloadEntries, %d namespaces\n",
		up.Addr(), sc.Services, sc.Endpoints, sc.Namespaces)
	fmt.Fprintf(out, "  relays    %d, gossiping in memory, behind a Service at %s; upstream protocol %s, key profile istio\n",
		cfg.Relays, tier.Addr(), cfg.UpstreamProtocol)
	fmt.Fprintf(out, "  envoys    %d simulated (%s) over %d keys; churn %.1f changes/s\n", cfg.Envoys, cfg.Protocol, cfg.Keys, cfg.ChurnRate)
	if cfg.RealEnvoys > 0 {
		fmt.Fprintf(out, "  real      %d Envoys beside them, each with a listener of its own whose route, cluster and endpoints come over xDS; a request through each every row\n", cfg.RealEnvoys)
	}
	if len(etcdEndpoints) > 0 {
		fmt.Fprintf(out, "  etcd      embedded at %s: owners persist their keys; a relay that starts is warm from it\n", etcdEndpoints[0])
	}
	if len(cfg.Schedule) > 0 {
		var ev []string
		for _, e := range cfg.Schedule {
			ev = append(ev, fmt.Sprintf("%v %v", e.At, e))
		}
		fmt.Fprintf(out, "  schedule  %s\n", strings.Join(ev, ", "))
	}
	if cfg.Input != nil {
		fmt.Fprintf(out, "  commands  type kill N, stop N, start N or add, then Enter\n")
	}
	fmt.Fprintf(out, "  relay columns: Envoy streams / keys it holds the upstream stream of (owned) / keys it gets from their owner\n\n")

	start := time.Now()
	// The Envoys live until the deferred Stop, so the last row still shows
	// them connected.
	fleet, err := traffic.StartFleet(stopCtx, traffic.FleetConfig{
		Scenario: sc, Envoys: cfg.Envoys, Keys: cfg.Keys, Protocol: cfg.Protocol,
		Target: tier.Addr(), Tracker: tracker,
	})
	if err != nil {
		return err
	}
	defer fleet.Stop(stopCtx)
	var realEnvoys *demoEnvoys
	if cfg.RealEnvoys > 0 {
		// Envoys of one key share a bootstrap: the simulated ones ask for
		// the route the real ones' own listener uses, as those do.
		_, route, _ := upstream.HTTPNames(demoService)
		for _, e := range fleet.Envoys() {
			e.Subscribe(resource.RouteType, []string{route})
		}
		if realEnvoys, err = startDemoEnvoys(ctx, cfg.EnvoyBinary, cfg.RealEnvoys, cfg.Envoys, cfg.Keys, sc, cfg.Protocol, tier.Addr(), backend); err != nil {
			return fmt.Errorf("loadtest: real Envoys: %w", err)
		}
		defer realEnvoys.stop()
		realEnvoys.run(ctx, cfg.Interval)
	}

	// The churn starts once every Envoy holds its first config: a change
	// made before then would be timed by the initial sync of the slowest
	// Envoy, which is its own figure (firstSync).
	churnDone := make(chan error, 1)
	var firstSync atomic.Int64
	go func() {
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for fleet.Synced(up) < cfg.Envoys {
			select {
			case <-tick.C:
			case <-ctx.Done():
				churnDone <- nil
				return
			}
		}
		firstSync.Store(int64(time.Since(start)))
		if cfg.ChurnRate <= 0 {
			churnDone <- nil
			return
		}
		// Churn is always bounded; ctx ends it sooner.
		churnDone <- up.Churn(ctx, upstream.ChurnConfig{Rate: cfg.ChurnRate, AddRemoveFraction: 0.05, Seed: 1, Duration: 24 * time.Hour},
			nil)
	}()

	// Commands from Input arrive on a channel; the reader is abandoned at
	// the end (a terminal read cannot be interrupted), never waited for.
	// Lines typed while a command plays wait in the channel's buffer (and
	// are played at the end if the run ends first).
	commands := make(chan string, 64)
	if cfg.Input != nil {
		go func() {
			sc := bufio.NewScanner(cfg.Input)
			for sc.Scan() {
				select {
				case commands <- sc.Text():
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	schedule := slices.Clone(cfg.Schedule)
	var next <-chan time.Time
	arm := func() {
		next = nil
		if len(schedule) > 0 {
			next = time.After(time.Until(start.Add(schedule[0].At)))
		}
	}
	arm()
	// A relay started warms from etcd: its line says how many keys it
	// restored, once it is ready (the count is final then). A relay not
	// ready within warmInline gets a line of its own when it is.
	var warming []*warmWatch
	play := func(e Event, source string) {
		slot := e.Relay
		if e.Action == "add" {
			slot = tier.Slots()
		}
		if err := apply(stopCtx, tier, e); err != nil {
			fmt.Fprintf(out, "%6s  %s: %s: %v\n", time.Since(start).Round(time.Second), source, e, err)
			return
		}
		var w *warmWatch
		if e.Action == "start" || e.Action == "add" {
			w = watchWarm(tier, slot, len(etcdEndpoints) > 0)
		}
		note := ""
		if w != nil {
			for deadline := time.Now().Add(warmInline); ; {
				if n, done := w.note(time.Now(), false); done {
					note = " (" + n + ")"
					break
				}
				if time.Now().After(deadline) {
					note = " (warm start: loading snapshots from etcd)"
					warming = append(warming, w)
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
		fmt.Fprintf(out, "%6s  %s: %s%s\n", time.Since(start).Round(time.Second), source, e, note)
	}
	noteWarm := func(final bool) {
		warming = slices.DeleteFunc(warming, func(w *warmWatch) bool {
			n, done := w.note(time.Now(), final)
			if done {
				fmt.Fprintf(out, "%6s  %s %s (%s after its start)\n", time.Since(start).Round(time.Second), w.relay, n,
					time.Since(w.started).Round(100*time.Millisecond))
			}
			return done
		})
	}

	printHeader := func() {
		fmt.Fprintf(out, "%6s %9s %7s %7s %4s %8s %11s %11s %8s %5s", "time", "envoys", "synced", "ledger", "ring", "upstream",
			"change→all50", "change→all99", "sent MB", "viol")
		n := tier.Slots()
		for i := range n {
			fmt.Fprintf(out, " %13s", fmt.Sprintf("relay-%d", i))
		}
		fmt.Fprintln(out)
	}
	shownRelays := -1
	// The ledger column: what the relays' own ledger says, asked of one
	// relay for the whole tier (the share of Envoys that ACKed their key's
	// current version). Asked apart from the loop, which must not wait on
	// a gather that waits for a relay just killed.
	var ledgerShare atomic.Value
	ledgerShare.Store("-")
	ledgerDone := make(chan struct{})
	defer func() { <-ledgerDone }()
	go func() {
		defer close(ledgerDone)
		t := time.NewTicker(cfg.Interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			running := tier.Running()
			if len(running) == 0 {
				continue
			}
			qctx, cancel := context.WithTimeout(ctx, time.Second)
			tl := running[0].Node.Relay().TierLedger(qctx, ledger.Scope{}, ledger.Brief)
			cancel()
			if c := tl.Convergence(); c.Envoys > 0 {
				ledgerShare.Store(fmt.Sprintf("%.1f%%", 100*c.Share()))
			}
			if realEnvoys != nil {
				realEnvoys.observe(tl.Report)
			}
		}
	}()
	print := func() {
		slots := tier.Relays()
		if len(slots) != shownRelays {
			printHeader()
			shownRelays = len(slots)
		}
		var sent uint64
		ring := 0
		var cols []string
		for _, s := range slots {
			if !s.Running {
				cols = append(cols, "down")
				continue
			}
			st := s.Node.Relay().Stats()
			sent += st.BytesSent
			ring = max(ring, len(s.Node.Ring().Members()))
			cols = append(cols, fmt.Sprintf("%d/%d/%d", st.Streams, st.UpstreamStreams, st.PeerStreams))
		}
		_, complete, _ := tracker.Results()
		// What the relays' own ledger says, asked of one relay for the
		// whole tier: the share of Envoys that ACKed their key's current
		// version.
		share, _ := ledgerShare.Load().(string)
		fmt.Fprintf(out, "%6s %9s %7d %7s %4d %8d %11s %11s %8.1f %5d",
			time.Since(start).Round(time.Second), fmt.Sprintf("%d/%d", fleet.Connected(), cfg.Envoys),
			fleet.Synced(up), share, ring, up.Stats().OpenStreams, report.MS(complete.P50), report.MS(complete.P99),
			float64(sent)/1e6, len(fleet.Violations()))
		for _, c := range cols {
			fmt.Fprintf(out, " %13s", c)
		}
		fmt.Fprintln(out)
		if realEnvoys != nil {
			realEnvoys.print(out, tier)
		}
	}
	command := func(line string) {
		if strings.TrimSpace(line) == "" {
			return
		}
		e, err := ParseCommand(line)
		if err != nil {
			fmt.Fprintf(out, "        %v\n", err)
			return
		}
		play(e, "command")
	}
	tick := time.NewTicker(cfg.Interval)
	defer tick.Stop()
	for {
		// An event that is due goes first: on a starved machine every
		// channel is ready at once, and a random pick could leave the
		// schedule unplayed past the end.
		select {
		case <-next:
			play(schedule[0], "schedule")
			schedule = schedule[1:]
			arm()
			continue
		default:
		}
		select {
		case <-tick.C:
			noteWarm(false)
			print()
		case <-next:
			play(schedule[0], "schedule")
			schedule = schedule[1:]
			arm()
		case line := <-commands:
			command(line)
		case <-ctx.Done():
			// Events due before the end are played, however late, and
			// commands typed before it too.
			for len(schedule) > 0 && schedule[0].At <= time.Since(start) {
				play(schedule[0], "schedule")
				schedule = schedule[1:]
			}
			for typed := true; typed; {
				select {
				case line := <-commands:
					command(line)
				default:
					typed = false
				}
			}
			noteWarm(true)
			print()
			perEnvoy, complete, _ := tracker.Results()
			fmt.Fprintln(out)
			if d := time.Duration(firstSync.Load()); d > 0 {
				fmt.Fprintf(out, "initial sync: every Envoy held its first config %s after the start; the churn began then\n", report.MS(d))
			} else {
				fmt.Fprintf(out, "initial sync: not every Envoy held its first config by the end; no churn\n")
			}
			fmt.Fprintf(out, "%d changes reached all their Envoys: P50 %s, P99 %s, max %s (per Envoy ACK P99 %s)\n",
				complete.N, report.MS(complete.P50), report.MS(complete.P99), report.MS(complete.Max), report.MS(perEnvoy.P99))
			// The tier may still be settling from the last event: wait for
			// it a bounded while (a slow machine takes longer).
			settle := time.Now()
			for n := up.Stats().OpenStreams; int(n) != cfg.Keys && time.Since(settle) < 15*time.Second; n = up.Stats().OpenStreams {
				time.Sleep(50 * time.Millisecond)
			}
			fmt.Fprintf(out, "upstream streams at the end: %d for %d keys", up.Stats().OpenStreams, cfg.Keys)
			if d := time.Since(settle); d > 100*time.Millisecond {
				fmt.Fprintf(out, " (settled %s after the end)", d.Round(100*time.Millisecond))
			}
			fmt.Fprintln(out)
			if realEnvoys != nil {
				realEnvoys.waitReady(30 * time.Second)
			}
			demoLedgerWait(out, tier)
			if realEnvoys != nil {
				realEnvoys.final(out, tier)
				realEnvoys.summary(out)
			}
			if v := fleet.Violations(); len(v) > 0 {
				for _, e := range v[:min(len(v), 5)] {
					fmt.Fprintf(out, "violation: %v\n", e)
				}
				return fmt.Errorf("loadtest: %d protocol violations", len(v))
			}
			if err := <-churnDone; err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
				return err
			}
			return nil
		}
	}
}

// demoLedgerWait asks one relay whether the last change reached every
// Envoy of the tier, as an operator would: a wait on the ledger for the
// whole tier, bounded at 10 s.
func demoLedgerWait(out io.Writer, tier *cluster.Tier) {
	running := tier.Running()
	if len(running) == 0 {
		return
	}
	r := running[0]
	wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	tl, err := r.Node.Relay().TierWait(wctx, ledger.Scope{}, 1, nil)
	c := tl.Convergence()
	if err == nil {
		fmt.Fprintf(out, "ledger (asked of %s): %d of %d Envoys ACKed their key's current version, tier-wide, %s after the churn stopped\n",
			r.ID, c.Current, c.Envoys, time.Since(start).Round(time.Millisecond))
		fmt.Fprintf(out, "aggregation: %s\n", aggregationOf(tl.Report))
		return
	}
	fmt.Fprintf(out, "ledger (asked of %s): %d of %d Envoys on their key's current version after 10 s (%v); stragglers:\n", r.ID, c.Current, c.Envoys, err)
	if tl.Report != nil {
		for _, s := range tl.Stragglers(5) {
			fmt.Fprintf(out, "  %s on %s: %s (%s)\n", s.Node, s.Relay, s.Reason, s.Type)
		}
	}
}

// aggregationOf says how a tier's keys aggregate its Envoys, as relayctl
// shards does.
func aggregationOf(rep *ledger.Report) string {
	var a ledger.Aggregation
	for _, k := range rep.Keys() {
		a.Add(k.Convergence.Envoys)
	}
	return a.String()
}
