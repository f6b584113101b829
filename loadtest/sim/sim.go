package sim

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/loadtest/validation"
	"github.com/meshrelay/meshrelay/relay"
)

// FaultKind names a kind of fault of the simulation.
type FaultKind string

// The faults.
const (
	FaultKill      FaultKind = "kill-relay"      // crash a relay, restart it (warm, from the store)
	FaultFreeze    FaultKind = "freeze-relay"    // stop a relay's traffic as SIGSTOP would, then resume it
	FaultPartition FaultKind = "cut-relays"      // cut two relays apart (gossip and relay-to-relay), then heal
	FaultUpstream  FaultKind = "kill-upstream"   // crash the upstream, restart it
	FaultRolling   FaultKind = "rolling-restart" // stop and restart every relay, one after another
	FaultStore     FaultKind = "kill-store"      // the snapshot store down, then back
	FaultReset     FaultKind = "reset-conns"     // reset every connection of a relay (to the upstream, peers, Envoys)
)

// AllFaults lists every kind.
var AllFaults = []FaultKind{FaultKill, FaultFreeze, FaultPartition, FaultUpstream, FaultRolling, FaultStore, FaultReset}

// Range is a closed interval of durations.
type Range struct{ Min, Max time.Duration }

func (r Range) draw(rng *rand.Rand) time.Duration {
	if r.Max <= r.Min {
		return r.Min
	}
	return r.Min + time.Duration(rng.Int64N(int64(r.Max-r.Min)))
}

// Config configures a simulation. Start from DefaultConfig.
type Config struct {
	// Relays in the tier. Default 3.
	Relays int
	// Envoys spread over Keys aggregation keys. Default 12 over 4.
	Envoys, Keys int
	// Scenario is the upstream's configuration. Default 12 services, 24
	// endpoints, 2 namespaces.
	Scenario upstream.Scenario
	// ChurnRate is upstream changes a second (the churn pauses while the
	// upstream is down). Default 4.
	ChurnRate float64
	// AddRemoveFraction of the changes add or remove a service. Default 0.2.
	AddRemoveFraction float64
	// Faults per seed, drawn from Kinds. Default 3.
	Faults int
	// Kinds are the faults drawn from. Default AllFaults.
	Kinds []FaultKind
	// Hold is how long a freeze, a cut or a store outage lasts. Default
	// 5–15 s.
	Hold Range
	// Down is how long a crashed relay or upstream stays down. Default
	// 1–5 s.
	Down Range
	// DeliveryBound is the history checker's bound. Default 60 s.
	DeliveryBound time.Duration
	// RecoverTimeout bounds the wait after each fault for every Envoy to
	// hold the config of the moment it healed, and the final waits.
	// Default 60 s.
	RecoverTimeout time.Duration
	// Settle is waited after a fault's recovery. Default 2 s.
	Settle time.Duration
	// DivergenceInterval is every relay's (relay.Config). Default 5 s.
	DivergenceInterval time.Duration
	// Relay, if set, adjusts every relay's configuration last.
	Relay func(*relay.Config)
	// Logger receives the relays' logs. Default: discard.
	Logger *slog.Logger
	// Trace, if set, receives every delivery and fault of the network.
	Trace func(string)
}

// DefaultConfig returns the simulation's defaults.
func DefaultConfig() Config {
	sc := upstream.DefaultScenario()
	sc.Services, sc.Endpoints, sc.Namespaces = 12, 24, 2
	return Config{
		Relays: 3, Envoys: 12, Keys: 4, Scenario: sc,
		ChurnRate: 4, AddRemoveFraction: 0.2, Faults: 3, Kinds: AllFaults,
		Hold: Range{5 * time.Second, 15 * time.Second}, Down: Range{time.Second, 5 * time.Second},
		DeliveryBound: time.Minute, RecoverTimeout: time.Minute, Settle: 2 * time.Second,
		DivergenceInterval: 5 * time.Second,
	}
}

// Fault is one scheduled fault.
type Fault struct {
	Kind FaultKind
	// Target is the relay hit (-1: none); Peer a cut's second relay.
	Target, Peer int
	// Hold is how long it lasts.
	Hold time.Duration
}

func (f Fault) String() string {
	switch f.Kind {
	case FaultKill:
		return fmt.Sprintf("kill relay-%d, restart after %v", f.Target, f.Hold.Round(time.Millisecond))
	case FaultFreeze:
		return fmt.Sprintf("freeze relay-%d for %v", f.Target, f.Hold.Round(time.Millisecond))
	case FaultPartition:
		return fmt.Sprintf("cut relay-%d from relay-%d for %v", f.Target, f.Peer, f.Hold.Round(time.Millisecond))
	case FaultUpstream:
		return fmt.Sprintf("kill the upstream, restart after %v", f.Hold.Round(time.Millisecond))
	case FaultRolling:
		return "rolling restart of every relay"
	case FaultStore:
		return fmt.Sprintf("snapshot store down for %v", f.Hold.Round(time.Millisecond))
	case FaultReset:
		return fmt.Sprintf("reset every connection of relay-%d", f.Target)
	}
	return string(f.Kind)
}

// Plan is what a seed draws before anything runs.
type Plan struct {
	Seed             uint64
	EnvoyProtocol    envoy.Protocol
	UpstreamProtocol relay.Protocol
	Faults           []Fault
}

func (p Plan) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d: %s Envoys, %s upstream", p.Seed, p.EnvoyProtocol, p.UpstreamProtocol)
	for i, f := range p.Faults {
		fmt.Fprintf(&b, "; %d. %s", i+1, f)
	}
	return b.String()
}

// Draw draws seed's plan: protocols and faults.
func Draw(cfg Config, seed uint64) Plan {
	rng := rand.New(rand.NewPCG(seed, 0x706c616e))
	p := Plan{Seed: seed, EnvoyProtocol: envoy.SotW, UpstreamProtocol: relay.ProtocolSotW}
	if rng.IntN(2) == 1 {
		p.EnvoyProtocol = envoy.Delta
	}
	if rng.IntN(2) == 1 {
		p.UpstreamProtocol = relay.ProtocolDelta
	}
	for range cfg.Faults {
		f := Fault{Kind: cfg.Kinds[rng.IntN(len(cfg.Kinds))], Target: -1}
		switch f.Kind {
		case FaultKill:
			f.Target, f.Hold = rng.IntN(cfg.Relays), cfg.Down.draw(rng)
		case FaultFreeze:
			f.Target, f.Hold = rng.IntN(cfg.Relays), cfg.Hold.draw(rng)
		case FaultPartition:
			f.Target = rng.IntN(cfg.Relays)
			f.Peer = (f.Target + 1 + rng.IntN(cfg.Relays-1)) % cfg.Relays
			f.Hold = cfg.Hold.draw(rng)
		case FaultUpstream:
			f.Hold = cfg.Down.draw(rng)
		case FaultStore:
			f.Hold = cfg.Hold.draw(rng)
		case FaultReset:
			f.Target = rng.IntN(cfg.Relays)
		}
		p.Faults = append(p.Faults, f)
	}
	return p
}

// Result is what one seed found.
type Result struct {
	Plan Plan
	// Violations are the history checker's, the simulated Envoys' own, and
	// the run's (liveness, steady state), one line each.
	Violations []string
	// Log is the run's event log: faults, churn steps and every Envoy
	// event, in order, with the simulated time.
	Log []string
	// Changes published; Deliveries made by the network; Simulated time.
	Changes    int
	Deliveries uint64
	Simulated  time.Duration
	// Err is set if the run could not be played.
	Err error
}

// Failed reports whether the seed found anything.
func (r *Result) Failed() bool { return len(r.Violations) > 0 || r.Err != nil }

// run is one seed's state.
type run struct {
	t     *tier
	cfg   Config
	plan  Plan
	start time.Time

	mu        sync.Mutex
	log       []string
	published []validation.Published
	events    [][]envoy.Event
	fails     []string

	// upSem is held by a churn step, and while the upstream is down: a
	// channel, not a mutex, so that waiting on it is durably blocking and
	// the bubble's time moves on.
	upSem chan struct{}
}

func (r *run) logf(format string, args ...any) {
	line := fmt.Sprintf("%9.6f ", time.Since(r.start).Seconds()) + fmt.Sprintf(format, args...)
	r.mu.Lock()
	r.log = append(r.log, line)
	r.mu.Unlock()
}

func (r *run) fail(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	r.logf("FAIL %s", msg)
	r.mu.Lock()
	r.fails = append(r.fails, msg)
	r.mu.Unlock()
}

// Run plays seed and checks its history. It must be called inside a
// synctest bubble (synctest.Test), and returns once everything it started
// has stopped.
func Run(cfg Config, seed uint64) *Result {
	plan := Draw(cfg, seed)
	res := &Result{Plan: plan}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	r := &run{cfg: cfg, plan: plan, start: time.Now(), events: make([][]envoy.Event, cfg.Envoys), upSem: make(chan struct{}, 1)}
	nw := NewNetwork(NetworkConfig{Seed: seed, Trace: cfg.Trace})
	t := &tier{cfg: cfg, seed: seed, net: nw, log: cfg.Logger, store: NewStore(), proto: plan.UpstreamProtocol}
	r.t = t
	ctx := context.Background()
	defer func() {
		t.stopEnvoys()
		for i := range t.relays {
			t.killRelay(i)
		}
		if t.up != nil {
			t.killUpstream(ctx)
		}
		res.Deliveries = nw.Delivered()
		res.Simulated = time.Since(r.start)
		nw.Close()
		// memberlist does not wait for a probe or a push-pull in flight
		// when it shuts down: give them their timeouts, or the bubble
		// would end with them blocked.
		time.Sleep(time.Minute)
	}()
	hist, err := r.play(ctx)
	if err != nil {
		res.Err = err
		r.logf("ERROR %v", err)
	}
	if hist != nil {
		chk := validation.Check(*hist, validation.Config{DeliveryBound: cfg.DeliveryBound})
		res.Changes = len(chk.Changes)
		for _, v := range chk.Violations {
			res.Violations = append(res.Violations, v.String())
		}
	}
	for _, se := range t.envoys {
		for _, v := range se.e.Violations() {
			res.Violations = append(res.Violations, fmt.Sprintf("envoy: %s: %v", se.e.ID(), v))
		}
	}
	res.Violations = append(res.Violations, r.fails...)
	res.Log = r.log
	return res
}

// play runs the scenario and returns the history to check.
func (r *run) play(ctx context.Context) (*validation.History, error) {
	t, cfg := r.t, r.cfg
	r.logf("plan: %s", r.plan)
	t.upHost = t.net.AddHost("upstream", upstreamIP)
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = cfg.Scenario
	ucfg.Listener = func() (net.Listener, error) {
		l, err := t.upHost.Listen(xdsPort)
		if err != nil {
			return nil, err
		}
		return l, nil
	}
	up, err := upstream.New(ucfg)
	if err != nil {
		return nil, err
	}
	t.up = up
	if err := t.startUpstream(ctx); err != nil {
		return nil, err
	}
	churn := up.NewChurner(int64(r.plan.Seed), cfg.AddRemoveFraction)
	t.net.AddService(serviceAddr, t.readyRelays)
	for i := range cfg.Relays {
		t.relays = append(t.relays, &simRelay{i: i, host: t.net.AddHost(fmt.Sprintf("relay-%d", i), relayIP(i))})
	}
	for i := range cfg.Relays {
		if err := t.startRelay(ctx, i); err != nil {
			return nil, err
		}
	}
	if err := r.waitFor(time.Minute, "every relay ready", func() bool { return len(t.readyRelays()) == cfg.Relays }); err != nil {
		return nil, err
	}
	initial := map[string]map[traffic.ResourceKey]uint64{}
	for _, g := range up.Groups() {
		initial[g] = generations(up.Snapshot(g))
	}
	err = t.startEnvoys(ctx, r.plan.EnvoyProtocol, func(i int, ev envoy.Event) {
		r.mu.Lock()
		r.events[i] = append(r.events[i], ev)
		r.mu.Unlock()
		r.logf("envoy-%d %s", i, formatEvent(ev))
	})
	if err != nil {
		return nil, err
	}
	if err := r.waitFor(time.Minute, "initial sync", func() bool { return t.synced() == cfg.Envoys }); err != nil {
		return nil, err
	}
	r.logf("synced")

	// The churn, and the faults one after another.
	churnCtx, stopChurn := context.WithCancel(ctx)
	churnDone := make(chan struct{})
	go func() {
		defer close(churnDone)
		r.runChurn(churnCtx, churn)
	}()
	var runErr error
	for i, f := range r.plan.Faults {
		r.logf("fault %d: %s", i+1, f)
		if err := r.playFault(ctx, f); err != nil {
			runErr = fmt.Errorf("fault %d (%s): %w", i+1, f, err)
			break
		}
		snap := r.expectedNow()
		r.logf("fault %d healed", i+1)
		if err := r.waitFor(cfg.RecoverTimeout, "recovery", func() bool { return r.covers(snap) }); err != nil {
			r.fail("liveness: after fault %d (%s): %v", i+1, f, err)
		} else {
			r.logf("fault %d: every Envoy current", i+1)
		}
		time.Sleep(cfg.Settle)
	}
	stopChurn()
	<-churnDone

	// Steady state: everything delivered, one upstream stream per key.
	if runErr == nil {
		if err := r.waitFor(cfg.RecoverTimeout, "final sync", func() bool { return t.synced() == cfg.Envoys }); err != nil {
			r.fail("liveness: %v", err)
		}
		var why string
		err := r.waitFor(cfg.RecoverTimeout, "one upstream stream per key", func() bool {
			why = t.oneStreamPerKey()
			return why == ""
		})
		if err != nil {
			r.fail("steady state: %s", why)
		}
		time.Sleep(time.Second) // late events of the last pushes
	}
	r.logf("end")
	end := time.Now()
	h := &validation.History{Initial: initial, End: end}
	r.mu.Lock()
	h.Published = slices.Clone(r.published)
	for i, se := range t.envoys {
		h.Envoys = append(h.Envoys, validation.EnvoyHistory{ID: se.e.ID(), Group: se.group, Events: r.events[i]})
	}
	r.mu.Unlock()
	return h, runErr
}

// runChurn steps the upstream at ChurnRate, except while it is down, and
// records what each step published.
func (r *run) runChurn(ctx context.Context, churn *upstream.Churner) {
	tk := time.NewTicker(time.Duration(float64(time.Second) / r.cfg.ChurnRate))
	defer tk.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tk.C:
		}
		if err := r.step(churn); err != nil {
			r.fail("churn: %v", err)
			return
		}
	}
}

// step applies one churn step, unless the upstream is down.
func (r *run) step(churn *upstream.Churner) error {
	r.upSem <- struct{}{}
	defer func() { <-r.upSem }()
	if !r.t.upUp {
		return nil
	}
	at := time.Now()
	changes, err := churn.Step()
	if err != nil {
		return err
	}
	snaps := map[string]map[traffic.ResourceKey]uint64{}
	var pubs []validation.Published
	var names []string
	for _, c := range changes {
		names = append(names, shortType(c.TypeURL)+"/"+c.Name)
		for _, g := range c.Groups {
			if snaps[g] == nil {
				snaps[g] = generations(r.t.up.Snapshot(g))
			}
			key := c.TypeURL + "|" + c.Name
			gen, ok := snaps[g][key]
			pubs = append(pubs, validation.Published{At: at, Group: g, Key: key, Generation: gen, Removed: !ok})
		}
	}
	r.logf("churn %d: %s", churn.Steps(), strings.Join(names, " "))
	r.mu.Lock()
	r.published = append(r.published, pubs...)
	r.mu.Unlock()
	return nil
}

// playFault applies f and returns once it healed.
func (r *run) playFault(ctx context.Context, f Fault) error {
	t := r.t
	switch f.Kind {
	case FaultKill:
		t.killRelay(f.Target)
		time.Sleep(f.Hold)
		return t.startRelay(ctx, f.Target)
	case FaultFreeze:
		t.net.Freeze(t.relays[f.Target].host.name)
		time.Sleep(f.Hold)
		t.net.Thaw(t.relays[f.Target].host.name)
	case FaultPartition:
		t.net.Partition(t.relays[f.Target].host.name, t.relays[f.Peer].host.name)
		time.Sleep(f.Hold)
		t.net.Heal()
	case FaultUpstream:
		// A down upstream publishes nothing: the churn waits.
		r.upSem <- struct{}{}
		defer func() { <-r.upSem }()
		t.killUpstream(ctx)
		time.Sleep(f.Hold)
		return t.startUpstream(ctx)
	case FaultRolling:
		for i := range t.relays {
			if err := t.stopRelay(ctx, i, 30*time.Second); err != nil {
				r.logf("relay-%d stop: %v", i, err)
			}
			if err := t.startRelay(ctx, i); err != nil {
				return err
			}
			addr := t.relays[i].host.Addr(xdsPort)
			if err := r.waitFor(time.Minute, fmt.Sprintf("relay-%d ready", i), func() bool {
				return slices.Contains(t.readyRelays(), addr)
			}); err != nil {
				return err
			}
		}
	case FaultStore:
		t.store.SetDown(true)
		time.Sleep(f.Hold)
		t.store.SetDown(false)
	case FaultReset:
		t.net.ResetHost(t.relays[f.Target].host.name)
	default:
		return fmt.Errorf("unknown fault %q", f.Kind)
	}
	return nil
}

// expectedNow is what the upstream serves each group now (clusters and
// endpoints).
func (r *run) expectedNow() map[string]map[string]uint64 {
	out := map[string]map[string]uint64{}
	for _, g := range r.t.up.Groups() {
		out[g] = generations(r.t.up.Snapshot(g), envoy.ClusterType, envoy.EndpointType)
	}
	return out
}

// covers reports whether every Envoy holds, of the clusters and endpoints
// snap had, that generation or a newer one (or nothing, if the upstream
// removed it since), and nothing removed before snap.
func (r *run) covers(snap map[string]map[string]uint64) bool {
	now := r.expectedNow()
	for _, se := range r.t.envoys {
		was, is := snap[se.group], now[se.group]
		held := map[string]uint64{}
		for _, typeURL := range []string{envoy.ClusterType, envoy.EndpointType} {
			for name, h := range se.e.Resources(typeURL) {
				held[typeURL+"|"+name] = h.Generation
			}
		}
		for key, gen := range was {
			h, ok := held[key]
			_, served := is[key]
			if (ok && h < gen) || (!ok && served) {
				return false
			}
		}
		for key := range held {
			if _, ok := was[key]; !ok {
				if _, ok := is[key]; !ok {
					return false
				}
			}
		}
	}
	return true
}

// oneStreamPerKey returns "" if the upstream has exactly one stream per
// key, and what differs otherwise.
func (t *tier) oneStreamPerKey() string {
	streams := t.up.StreamsByNode()
	keyOf := t.keyIndex()
	perKey := map[int]int{}
	var stray []string
	for _, node := range slices.Sorted(maps.Keys(streams)) {
		k, ok := keyOf[node]
		if !ok {
			stray = append(stray, fmt.Sprintf("%s: %d", node, streams[node]))
			continue
		}
		perKey[k] += streams[node]
	}
	var bad []string
	for k := range t.cfg.Keys {
		if perKey[k] != 1 {
			bad = append(bad, fmt.Sprintf("key %d: %d streams", k, perKey[k]))
		}
	}
	if len(bad) == 0 && len(stray) == 0 {
		return ""
	}
	return fmt.Sprintf("want one upstream stream per key: %s %s", strings.Join(bad, ", "), strings.Join(stray, ", "))
}

// waitFor checks cond every 100 ms (simulated) for up to d.
func (r *run) waitFor(d time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not after %v", what, d)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return nil
}

// synced counts the Envoys that hold exactly what the upstream serves their
// group now (clusters and endpoints, names and generations).
func (t *tier) synced() int {
	want := map[string]map[string]uint64{}
	n := 0
	for _, se := range t.envoys {
		w, ok := want[se.group]
		if !ok {
			w = generations(t.up.Snapshot(se.group), envoy.ClusterType, envoy.EndpointType)
			want[se.group] = w
		}
		if holds(se.e, w) {
			n++
		}
	}
	return n
}

func holds(e *envoy.Envoy, want map[string]uint64) bool {
	n := 0
	for _, typeURL := range []string{envoy.ClusterType, envoy.EndpointType} {
		held := e.Resources(typeURL)
		for name, h := range held {
			g, ok := want[typeURL+"|"+name]
			if !ok || g != h.Generation {
				return false
			}
		}
		n += len(held)
	}
	return n == len(want)
}

// generations maps "type|name" to generation over the given types of a
// snapshot (every type if none is given).
func generations(snap map[string]map[string]proto.Message, types ...string) map[traffic.ResourceKey]uint64 {
	out := map[traffic.ResourceKey]uint64{}
	for typeURL, res := range snap {
		if len(types) > 0 && !slices.Contains(types, typeURL) {
			continue
		}
		for name, m := range res {
			g, _ := upstream.Generation(m)
			out[typeURL+"|"+name] = g
		}
	}
	return out
}

// formatEvent is one line of the event log.
func formatEvent(ev envoy.Event) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s", ev.Kind, shortType(ev.TypeURL))
	if ev.Nonce != "" {
		fmt.Fprintf(&b, " nonce=%s", ev.Nonce)
	}
	if ev.ControlPlane != "" {
		fmt.Fprintf(&b, " from=%s", ev.ControlPlane)
	}
	if len(ev.Names) > 0 {
		parts := make([]string, len(ev.Names))
		for i, n := range ev.Names {
			g := uint64(0)
			if i < len(ev.Generations) {
				g = ev.Generations[i]
			}
			parts[i] = fmt.Sprintf("%s@%d", n, g)
		}
		slices.Sort(parts)
		fmt.Fprintf(&b, " [%s]", strings.Join(parts, " "))
	}
	if ev.Err != nil {
		fmt.Fprintf(&b, " err=%q", ev.Err.Error())
	}
	return b.String()
}

func shortType(t string) string {
	if i := strings.LastIndexByte(t, '.'); i >= 0 {
		return t[i+1:]
	}
	return t
}
