package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay/snapshot"
)

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
	s := &session{cfg: cfg, out: out, stopCtx: context.WithoutCancel(ctx), tracker: traffic.NewTracker(), churnDone: make(chan error, 1)}
	defer s.close()
	if err := s.startTier(ctx); err != nil {
		return err
	}
	s.intro()
	s.start = time.Now()
	if err := s.startEnvoys(ctx); err != nil {
		return err
	}
	go s.churnAfterSync(ctx)
	commands := readCommands(ctx, cfg.Input)
	s.ledgerShare.Store("-")
	ledgerDone := make(chan struct{})
	s.onClose(func() { <-ledgerDone })
	go func() {
		defer close(ledgerDone)
		s.sampleLedger(ctx)
	}()
	return s.loop(ctx, commands)
}

// session is one run of the demo: what it started, and what its table
// shows.
type session struct {
	cfg     Config
	out     io.Writer
	stopCtx context.Context // outlives the run's end: stops what it started
	closers []func()        // run in reverse by close

	tracker    *traffic.Tracker
	up         *upstream.Upstream
	etcd       []string // the embedded etcd's endpoints, if any
	tier       *cluster.Tier
	fleet      *traffic.Fleet
	realEnvoys *demoEnvoys
	backend    *http.Server

	start       time.Time
	firstSync   atomic.Int64 // when every Envoy held its first config (since start)
	churnDone   chan error
	schedule    []Event
	warming     []*warmWatch // started relays whose restore is not told yet
	shownRelays int          // relays in the last header printed
	ledgerShare atomic.Value // string: the ledger column
}

func (s *session) onClose(f func()) { s.closers = append(s.closers, f) }

func (s *session) close() {
	for i := len(s.closers) - 1; i >= 0; i-- {
		s.closers[i]()
	}
}

// startTier starts the upstream, the embedded etcd (unless NoEtcd) and the
// tier, and waits for its ring to converge.
func (s *session) startTier(ctx context.Context) error {
	cfg := &s.cfg
	if cfg.RealEnvoys > 0 {
		if cfg.EnvoyBinary == "" {
			return errors.New("loadtest: real Envoys need Config.EnvoyBinary")
		}
		backend, err := addDemoService(&cfg.Scenario)
		if err != nil {
			return err
		}
		s.backend = backend
		s.onClose(func() { backend.Close() })
	}
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = cfg.Scenario
	ucfg.OnPublish = func(c upstream.Change) { s.tracker.Track(c) }
	up, err := upstream.Start(ctx, ucfg)
	if err != nil {
		return err
	}
	s.up = up
	s.onClose(func() { up.Stop(s.stopCtx) })

	if !cfg.NoEtcd {
		dir, err := os.MkdirTemp("", "meshrelay-demo-etcd-")
		if err != nil {
			return err
		}
		s.onClose(func() { os.RemoveAll(dir) })
		etcd, err := snapshot.StartEmbedded(ctx, snapshot.EmbeddedConfig{Dir: dir})
		if err != nil {
			return err
		}
		s.onClose(func() { etcd.Close() })
		s.etcd = etcd.Endpoints()
	}
	tier, err := cluster.StartTier(s.stopCtx, cluster.TierConfig{
		Relays: cfg.Relays, Upstream: up.Addr(), UpstreamProtocol: cfg.UpstreamProtocol, Logger: cfg.Logger,
		Etcd: s.etcd,
	})
	if err != nil {
		return err
	}
	s.tier = tier
	s.onClose(func() { tier.Stop(s.stopCtx) })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return tier.WaitConverged(wctx)
}

// intro prints what runs.
func (s *session) intro() {
	cfg, out, sc := s.cfg, s.out, s.cfg.Scenario
	fmt.Fprintf(out, "meshrelay demo\n")
	fmt.Fprintf(out, "  upstream  %s: synthetic istiod, %d ServiceEntries, %d WorkloadEntries, %d namespaces\n",
		s.up.Addr(), sc.Services, sc.Endpoints, sc.Namespaces)
	fmt.Fprintf(out, "  relays    %d, gossiping in memory, behind a Service at %s; upstream protocol %s, key profile istio\n",
		cfg.Relays, s.tier.Addr(), cfg.UpstreamProtocol)
	fmt.Fprintf(out, "  envoys    %d simulated (%s) over %d keys; churn %.1f changes/s\n", cfg.Envoys, cfg.Protocol, cfg.Keys, cfg.ChurnRate)
	if cfg.RealEnvoys > 0 {
		fmt.Fprintf(out, "  real      %d Envoys beside them, each with a listener of its own whose route, cluster and endpoints come over xDS; a request through each every row\n", cfg.RealEnvoys)
	}
	if len(s.etcd) > 0 {
		fmt.Fprintf(out, "  etcd      embedded at %s: owners persist their keys; a relay that starts is warm from it\n", s.etcd[0])
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
}

// startEnvoys starts the simulated Envoys and the real ones. They live
// until the run closes, so the last row still shows them connected.
func (s *session) startEnvoys(ctx context.Context) error {
	cfg := s.cfg
	fleet, err := traffic.StartFleet(s.stopCtx, traffic.FleetConfig{
		Scenario: cfg.Scenario, Envoys: cfg.Envoys, Keys: cfg.Keys, Protocol: cfg.Protocol,
		Target: s.tier.Addr(), Tracker: s.tracker,
	})
	if err != nil {
		return err
	}
	s.fleet = fleet
	s.onClose(func() { fleet.Stop(s.stopCtx) })
	if cfg.RealEnvoys == 0 {
		return nil
	}
	// Envoys of one key share a bootstrap: the simulated ones ask for the
	// route the real ones' own listener uses, as those do.
	_, route, _ := upstream.HTTPNames(demoService)
	for _, e := range fleet.Envoys() {
		e.Subscribe(resource.RouteType, []string{route})
	}
	real, err := startDemoEnvoys(ctx, cfg.EnvoyBinary, cfg.RealEnvoys, cfg.Envoys, cfg.Keys, cfg.Scenario, cfg.Protocol, s.tier.Addr(), s.backend)
	if err != nil {
		return fmt.Errorf("loadtest: real Envoys: %w", err)
	}
	s.realEnvoys = real
	s.onClose(real.stop)
	real.run(ctx, cfg.Interval)
	return nil
}

// churnAfterSync churns the upstream once every Envoy holds its first
// config: a change made before then would be timed by the initial sync of
// the slowest Envoy, which is its own figure (firstSync). Its result goes
// to churnDone.
func (s *session) churnAfterSync(ctx context.Context) {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for s.fleet.Synced(s.up) < s.cfg.Envoys {
		select {
		case <-tick.C:
		case <-ctx.Done():
			s.churnDone <- nil
			return
		}
	}
	s.firstSync.Store(int64(time.Since(s.start)))
	if s.cfg.ChurnRate <= 0 {
		s.churnDone <- nil
		return
	}
	// Churn is always bounded; ctx ends it sooner.
	s.churnDone <- s.up.Churn(ctx, upstream.ChurnConfig{Rate: s.cfg.ChurnRate, AddRemoveFraction: 0.05, Seed: 1, Duration: 24 * time.Hour}, nil)
}

// readCommands hands the lines of in over on a channel; the reader is
// abandoned at the end (a terminal read cannot be interrupted), never
// waited for. Lines typed while a command plays wait in the channel's
// buffer (and are played at the end if the run ends first).
func readCommands(ctx context.Context, in io.Reader) <-chan string {
	commands := make(chan string, 64)
	if in == nil {
		return commands
	}
	go func() {
		sc := bufio.NewScanner(in)
		for sc.Scan() {
			select {
			case commands <- sc.Text():
			case <-ctx.Done():
				return
			}
		}
	}()
	return commands
}

// sampleLedger keeps the ledger column: what the relays' own ledger says,
// asked of one relay for the whole tier (the share of Envoys that ACKed
// their key's current version). It runs apart from the table's loop, which
// must not wait on a gather that waits for a relay just killed.
func (s *session) sampleLedger(ctx context.Context) {
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		running := s.tier.Running()
		if len(running) == 0 {
			continue
		}
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		tl := running[0].Node.Relay().TierLedger(qctx, ledger.Scope{}, ledger.Brief)
		cancel()
		if c := tl.Convergence(); c.Envoys > 0 {
			s.ledgerShare.Store(fmt.Sprintf("%.1f%%", 100*c.Share()))
		}
		if s.realEnvoys != nil {
			s.realEnvoys.observe(tl.Report)
		}
	}
}

// loop prints a row every Interval and plays the schedule and the
// commands, until ctx ends; then it plays what was due and prints the
// summary.
func (s *session) loop(ctx context.Context, commands <-chan string) error {
	s.schedule = slices.Clone(s.cfg.Schedule)
	var next <-chan time.Time
	arm := func() {
		next = nil
		if len(s.schedule) > 0 {
			next = time.After(time.Until(s.start.Add(s.schedule[0].At)))
		}
	}
	arm()
	playNext := func() {
		s.play(s.schedule[0], "schedule")
		s.schedule = s.schedule[1:]
		arm()
	}
	tick := time.NewTicker(s.cfg.Interval)
	defer tick.Stop()
	for {
		// An event that is due goes first: on a starved machine every
		// channel is ready at once, and a random pick could leave the
		// schedule unplayed past the end.
		select {
		case <-next:
			playNext()
			continue
		default:
		}
		select {
		case <-tick.C:
			s.noteWarm(false)
			s.row()
		case <-next:
			playNext()
		case line := <-commands:
			s.command(line)
		case <-ctx.Done():
			// Events due before the end are played, however late, and
			// commands typed before it too.
			for len(s.schedule) > 0 && s.schedule[0].At <= time.Since(s.start) {
				s.play(s.schedule[0], "schedule")
				s.schedule = s.schedule[1:]
			}
			for typed := true; typed; {
				select {
				case line := <-commands:
					s.command(line)
				default:
					typed = false
				}
			}
			s.noteWarm(true)
			s.row()
			return s.summary()
		}
	}
}

func (s *session) command(line string) {
	if strings.TrimSpace(line) == "" {
		return
	}
	e, err := ParseCommand(line)
	if err != nil {
		fmt.Fprintf(s.out, "        %v\n", err)
		return
	}
	s.play(e, "command")
}

// play carries out e and prints a line for it. A relay started warms from
// etcd: its line says how many keys it restored, once it is ready (the
// count is final then). A relay not ready within warmInline gets a line
// of its own when it is (noteWarm).
func (s *session) play(e Event, source string) {
	slot := e.Relay
	if e.Action == "add" {
		slot = s.tier.Slots()
	}
	if err := apply(s.stopCtx, s.tier, e); err != nil {
		fmt.Fprintf(s.out, "%6s  %s: %s: %v\n", s.since(), source, e, err)
		return
	}
	var w *warmWatch
	if e.Action == "start" || e.Action == "add" {
		w = watchWarm(s.tier, slot, len(s.etcd) > 0)
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
				s.warming = append(s.warming, w)
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	fmt.Fprintf(s.out, "%6s  %s: %s%s\n", s.since(), source, e, note)
}

func (s *session) since() time.Duration { return time.Since(s.start).Round(time.Second) }

func (s *session) noteWarm(final bool) {
	s.warming = slices.DeleteFunc(s.warming, func(w *warmWatch) bool {
		n, done := w.note(time.Now(), final)
		if done {
			fmt.Fprintf(s.out, "%6s  %s %s (%s after its start)\n", s.since(), w.relay, n,
				time.Since(w.started).Round(100*time.Millisecond))
		}
		return done
	})
}

// row prints a row of the table (and its header first if the tier's
// relays changed).
func (s *session) row() {
	out := s.out
	slots := s.tier.Relays()
	if len(slots) != s.shownRelays {
		fmt.Fprintf(out, "%6s %9s %7s %7s %4s %8s %11s %11s %8s %5s", "time", "envoys", "synced", "ledger", "ring", "upstream",
			"change→all50", "change→all99", "sent MB", "viol")
		for i := range s.tier.Slots() {
			fmt.Fprintf(out, " %13s", fmt.Sprintf("relay-%d", i))
		}
		fmt.Fprintln(out)
		s.shownRelays = len(slots)
	}
	var sent uint64
	ring := 0
	var cols []string
	for _, r := range slots {
		if !r.Running {
			cols = append(cols, "down")
			continue
		}
		st := r.Node.Relay().Stats()
		sent += st.BytesSent
		ring = max(ring, len(r.Node.Ring().Members()))
		cols = append(cols, fmt.Sprintf("%d/%d/%d", st.Streams, st.UpstreamStreams, st.PeerStreams))
	}
	_, complete, _ := s.tracker.Results()
	share, _ := s.ledgerShare.Load().(string)
	fmt.Fprintf(out, "%6s %9s %7d %7s %4d %8d %11s %11s %8.1f %5d",
		s.since(), fmt.Sprintf("%d/%d", s.fleet.Connected(), s.cfg.Envoys),
		s.fleet.Synced(s.up), share, ring, s.up.Stats().OpenStreams, report.MS(complete.P50), report.MS(complete.P99),
		float64(sent)/1e6, len(s.fleet.Violations()))
	for _, c := range cols {
		fmt.Fprintf(out, " %13s", c)
	}
	fmt.Fprintln(out)
	if s.realEnvoys != nil {
		s.realEnvoys.print(out, s.tier)
	}
}

// summary prints what the run measured once it ended, and fails it on a
// protocol violation or a churn that failed.
func (s *session) summary() error {
	out := s.out
	perEnvoy, complete, _ := s.tracker.Results()
	fmt.Fprintln(out)
	if d := time.Duration(s.firstSync.Load()); d > 0 {
		fmt.Fprintf(out, "initial sync: every Envoy held its first config %s after the start; the churn began then\n", report.MS(d))
	} else {
		fmt.Fprintf(out, "initial sync: not every Envoy held its first config by the end; no churn\n")
	}
	fmt.Fprintf(out, "%d changes reached all their Envoys: P50 %s, P99 %s, max %s (per Envoy ACK P99 %s)\n",
		complete.N, report.MS(complete.P50), report.MS(complete.P99), report.MS(complete.Max), report.MS(perEnvoy.P99))
	// The tier may still be settling from the last event: wait for it a
	// bounded while (a slow machine takes longer).
	settle := time.Now()
	for n := s.up.Stats().OpenStreams; int(n) != s.cfg.Keys && time.Since(settle) < 15*time.Second; n = s.up.Stats().OpenStreams {
		time.Sleep(50 * time.Millisecond)
	}
	fmt.Fprintf(out, "upstream streams at the end: %d for %d keys", s.up.Stats().OpenStreams, s.cfg.Keys)
	if d := time.Since(settle); d > 100*time.Millisecond {
		fmt.Fprintf(out, " (settled %s after the end)", d.Round(100*time.Millisecond))
	}
	fmt.Fprintln(out)
	if s.realEnvoys != nil {
		s.realEnvoys.waitReady(30 * time.Second)
	}
	demoLedgerWait(out, s.tier)
	if s.realEnvoys != nil {
		s.realEnvoys.final(out, s.tier)
		s.realEnvoys.summary(out)
	}
	if v := s.fleet.Violations(); len(v) > 0 {
		for _, e := range v[:min(len(v), 5)] {
			fmt.Fprintf(out, "violation: %v\n", e)
		}
		return fmt.Errorf("loadtest: %d protocol violations", len(v))
	}
	if err := <-s.churnDone; err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}
