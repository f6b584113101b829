// Package demo is meshrelay demo: a tier in one process (loadtest/cluster)
// behind a synthetic istiod, simulated Envoys with churn, a schedule of
// relay crashes and restarts, and a table of what the tier does, a row a
// second. It imports no benchmark driver, so the relay's binary that runs
// it stays lean.
package demo

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/cluster"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
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
