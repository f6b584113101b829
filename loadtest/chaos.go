package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/failpoints"
	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/scenario"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/loadtest/validation"
	"github.com/meshrelay/meshrelay/relay"
)

// FaultKind names a kind of fault of the chaos suite.
type FaultKind string

// The faults.
const (
	FaultKill     FaultKind = "kill-relay"      // SIGKILL a relay, restart it (warm, from etcd)
	FaultFreeze   FaultKind = "freeze-relay"    // SIGSTOP a relay, SIGCONT it later
	FaultCut      FaultKind = "cut-relays"      // drop every packet between two relays, then heal
	FaultEtcd     FaultKind = "kill-etcd"       // SIGKILL an etcd member, restart it
	FaultUpstream FaultKind = "kill-upstream"   // SIGKILL the upstream, restart it
	FaultRolling  FaultKind = "rolling-restart" // SIGTERM and restart every relay, one after another
	// A relay held to a few percent of a CPU for 20–60 s: a cgroup CPU
	// quota where a cpu controller is writable, else SIGSTOP/SIGCONT
	// bursts of the same duty cycle.
	FaultStarve FaultKind = "starve-relay"
	// Everything a relay sends or is sent goes through a slow, lossy
	// link: netem delay and loss where the kernel has netem, else an htb
	// rate limit with a bounded queue (tbf) and random drops (iptables).
	FaultSlow FaultKind = "slow-link"
	// SIGKILL the etcd leader (etcd's maintenance Status names it) just as
	// the owners flush the snapshots of a burst of changes, restart it.
	FaultEtcdLeader FaultKind = "kill-etcd-leader"
)

// AllFaults lists every kind, in the order the report prints them.
var AllFaults = []FaultKind{FaultKill, FaultFreeze, FaultCut, FaultEtcd, FaultUpstream, FaultRolling, FaultStarve, FaultSlow, FaultEtcdLeader}

// ChaosConfig configures RunChaos. Start from DefaultChaosConfig.
type ChaosConfig struct {
	// Meshrelay is the meshrelay binary the relays run (`meshrelay
	// serve`). Required.
	Meshrelay string
	// StartEtcdMember and StartUpstream start the etcd members and the
	// upstream, each in a process of its own. Required.
	StartEtcdMember StartEtcdMemberFunc
	StartUpstream   StartChaosUpstreamFunc

	// Seeds are run one after another, each with a fresh tier.
	Seeds []uint64
	// Relays is the number of `meshrelay serve` processes. Default 5.
	Relays int
	// EtcdMembers is the size of the etcd cluster. Default 3.
	EtcdMembers int
	// Scenario is the upstream's configuration. Default 40 services, 80
	// endpoints, 4 namespaces.
	Scenario upstream.Scenario
	// Envoys spread over Keys aggregation keys. Default 100 over 16.
	Envoys, Keys int
	// Protocols are the Envoys' ADS variants and UpstreamProtocols the
	// relays'; each seed plays one pair of them (ChaosProtocols), and
	// every len(Protocols)·len(UpstreamProtocols) consecutive seeds play
	// every pair. Default Delta, SotW for both.
	Protocols         []envoy.Protocol
	UpstreamProtocols []relay.Protocol
	// ChurnRate is upstream changes a second, stepped by the driver; the
	// churn pauses while the upstream is down. Default 8.
	ChurnRate float64
	// AddRemoveFraction of the changes add or remove a service. Default 0.1.
	AddRemoveFraction float64
	// Faults per seed. Kinds are drawn as shuffled rounds of Kinds, so
	// every len(Kinds) faults cover every kind. Default 10.
	Faults int
	// Kinds are the faults drawn from. Default AllFaults. A kind this
	// machine cannot play (slow-link without tc) is left out with a line
	// saying why, or fails the run with Strict.
	Kinds []FaultKind
	// Strict fails the run when a kind of Kinds cannot be played here,
	// instead of leaving it out (cmd/loadtest and TestChaosShort set it
	// under CI=true).
	Strict bool
	// Hold is how long a freeze, a cut or a slow link lasts: drawn in
	// [Hold.Min, Hold.Max]. Default 5–20 s.
	Hold Range
	// Starve is how long a relay is CPU-starved. Default 20–60 s.
	Starve Range
	// StarveSignals starves a relay with SIGSTOP/SIGCONT bursts even
	// where a cgroup CPU quota could be used (what a machine without a
	// writable cpu controller gets). Default false.
	StarveSignals bool
	// Down is how long a killed process stays down: drawn in [Down.Min,
	// Down.Max]. Default 1–5 s.
	Down Range
	// DeliveryBound is the checker's bound on a change reaching every
	// Envoy that must get it. Default 2 min: a relay starved for up to
	// 60 s (or frozen for 20 s) holds its Envoys, which cannot tell a
	// stalled server from a quiet one, plus the time to notice, move and
	// resync.
	DeliveryBound time.Duration
	// RecoverTimeout bounds the wait after each fault for every Envoy to
	// hold the config of the moment it healed; past it the run records a
	// liveness violation and goes on. Default 2 min.
	RecoverTimeout time.Duration
	// Settle is waited after a fault's recovery before the next fault.
	// Default 2 s.
	Settle time.Duration
	// Dir holds each seed's logs (seed-N/…); kept. Default: a temporary
	// directory, removed if every seed passed.
	Dir string
	// RelayLogLevel is the relays' --log-level. Default info.
	RelayLogLevel string
	// Log receives progress lines. Default: discard.
	Log io.Writer
}

// Range is a closed interval of durations.
type Range struct{ Min, Max time.Duration }

func (r Range) draw(rng *rand.Rand) time.Duration {
	if r.Max <= r.Min {
		return r.Min
	}
	return r.Min + time.Duration(rng.Int64N(int64(r.Max-r.Min)))
}

// DefaultChaosConfig returns the suite's defaults (Meshrelay and the
// start functions still to set).
func DefaultChaosConfig() ChaosConfig {
	sc := upstream.DefaultScenario()
	sc.Services, sc.Endpoints, sc.Namespaces = 40, 80, 4
	return ChaosConfig{
		Seeds: []uint64{1}, Relays: 5, EtcdMembers: 3, Scenario: sc, Envoys: 100, Keys: 16,
		Protocols:         []envoy.Protocol{envoy.Delta, envoy.SotW},
		UpstreamProtocols: []relay.Protocol{relay.ProtocolDelta, relay.ProtocolSotW},
		ChurnRate:         8, AddRemoveFraction: 0.1, Faults: 10, Kinds: slices.Clone(AllFaults),
		Hold: Range{5 * time.Second, 20 * time.Second}, Starve: Range{20 * time.Second, 60 * time.Second},
		Down:          Range{time.Second, 5 * time.Second},
		DeliveryBound: 2 * time.Minute, RecoverTimeout: 2 * time.Minute, Settle: 2 * time.Second,
		RelayLogLevel: "info",
	}
}

// ChaosProtocols returns the Envoys' and the relays' upstream protocol of
// seed: seeds 1, 2, … walk the pairs so that every run of
// len(Protocols)·len(UpstreamProtocols) consecutive seeds plays every
// pair, and consecutive seeds differ in both where they can (with two of
// each: seed 1 Delta and Delta, 2 SotW and SotW, 3 Delta Envoys and a
// SotW upstream, 4 SotW Envoys and a Delta upstream).
func ChaosProtocols(cfg ChaosConfig, seed uint64) (envoy.Protocol, relay.Protocol) {
	ne, nu := uint64(len(cfg.Protocols)), uint64(len(cfg.UpstreamProtocols))
	i := (max(seed, 1) - 1) % (ne * nu)
	return cfg.Protocols[i%ne], cfg.UpstreamProtocols[(i/ne+i%ne)%nu]
}

func (c *ChaosConfig) validate() error {
	var errs []error
	bad := func(f string, args ...any) { errs = append(errs, fmt.Errorf("loadtest: chaos: "+f, args...)) }
	if c.Meshrelay == "" || c.StartEtcdMember == nil || c.StartUpstream == nil {
		bad("Meshrelay, StartEtcdMember and StartUpstream are required")
	}
	if c.Relays < 2 || c.Relays > 5 {
		bad("Relays %d: want 2 to 5", c.Relays)
	}
	if c.EtcdMembers < 1 || c.EtcdMembers > 5 {
		bad("EtcdMembers %d: want 1 to 5", c.EtcdMembers)
	}
	if c.Envoys < 1 || c.Keys < 1 || len(c.Seeds) == 0 || len(c.Protocols) == 0 || len(c.UpstreamProtocols) == 0 || len(c.Kinds) == 0 || c.Faults < 0 {
		bad("Envoys, Keys, Seeds, Protocols, UpstreamProtocols and Kinds must be set")
	}
	for _, k := range c.Kinds {
		if !slices.Contains(AllFaults, k) {
			bad("unknown fault kind %q", k)
		}
	}
	if c.ChurnRate <= 0 || c.DeliveryBound <= 0 || c.RecoverTimeout <= 0 {
		bad("ChurnRate, DeliveryBound and RecoverTimeout must be positive")
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	return errors.Join(errs...)
}

// Fault is one scheduled fault.
type Fault struct {
	Kind FaultKind `json:"kind"`
	// Target is the relay or etcd member (-1: none; a cut's first relay;
	// the etcd leader is known only when the fault is played, and its
	// record has it).
	Target int `json:"target"`
	// Peer is a cut's second relay.
	Peer int `json:"peer,omitempty"`
	// Hold is how long the fault lasts (a freeze, a cut, a starvation, a
	// slow link, a process down).
	Hold time.Duration `json:"hold_ns"`
	// CPU is a starved relay's share of one CPU (0.02–0.05).
	CPU float64 `json:"cpu,omitempty"`
	// A slow link's delay each way (with netem), rate (without it) and
	// share of packets lost.
	Delay    time.Duration `json:"delay_ns,omitempty"`
	RateKbit int           `json:"rate_kbit,omitempty"`
	Loss     float64       `json:"loss,omitempty"`
}

func (f Fault) String() string {
	switch f.Kind {
	case FaultKill:
		return fmt.Sprintf("kill relay-%d, restart after %v", f.Target, f.Hold.Round(time.Millisecond))
	case FaultFreeze:
		return fmt.Sprintf("freeze relay-%d for %v", f.Target, f.Hold.Round(time.Millisecond))
	case FaultCut:
		return fmt.Sprintf("cut relay-%d from relay-%d for %v", f.Target, f.Peer, f.Hold.Round(time.Millisecond))
	case FaultEtcd:
		return fmt.Sprintf("kill etcd-%d, restart after %v", f.Target, f.Hold.Round(time.Millisecond))
	case FaultUpstream:
		return fmt.Sprintf("kill the upstream, restart after %v", f.Hold.Round(time.Millisecond))
	case FaultRolling:
		return "rolling restart of every relay"
	case FaultStarve:
		return fmt.Sprintf("starve relay-%d to %.0f%% of a CPU for %v", f.Target, 100*f.CPU, f.Hold.Round(time.Millisecond))
	case FaultSlow:
		return fmt.Sprintf("slow link to and from relay-%d for %v: %v delay (netem) or %d kbit/s (no netem), %.1f%% loss",
			f.Target, f.Hold.Round(time.Millisecond), f.Delay.Round(time.Millisecond), f.RateKbit, 100*f.Loss)
	case FaultEtcdLeader:
		return fmt.Sprintf("kill the etcd leader during a flush, restart after %v", f.Hold.Round(time.Millisecond))
	}
	return string(f.Kind)
}

// ChaosSchedule draws seed's faults: the same seed and config give the
// same schedule. The kinds come from one sequence of shuffled rounds of
// Kinds, seed s taking its Faults from position (s-1)·Faults on, so that
// seeds 1 … N cover every kind evenly (with 10 faults and nine kinds, seed
// 1 plays every kind, and seeds 1 and 2 every kind twice); what each fault
// hits, for how long and how hard is drawn from the seed.
func ChaosSchedule(cfg ChaosConfig, seed uint64) []Fault {
	kindRNG := rand.New(rand.NewPCG(0x6b696e6473, 0x63686161730a))
	var kinds []FaultKind
	first := int(max(seed, 1)-1) * cfg.Faults
	for len(kinds) < first+cfg.Faults {
		round := slices.Clone(cfg.Kinds)
		kindRNG.Shuffle(len(round), func(i, j int) { round[i], round[j] = round[j], round[i] })
		kinds = append(kinds, round...)
	}
	kinds = kinds[first : first+cfg.Faults]
	rng := rand.New(rand.NewPCG(seed, 0x63686161730a))
	var out []Fault
	for _, k := range kinds {
		f := Fault{Kind: k, Target: -1}
		switch f.Kind {
		case FaultKill:
			f.Target, f.Hold = rng.IntN(cfg.Relays), cfg.Down.draw(rng)
		case FaultFreeze:
			f.Target, f.Hold = rng.IntN(cfg.Relays), cfg.Hold.draw(rng)
		case FaultCut:
			f.Target = rng.IntN(cfg.Relays)
			f.Peer = (f.Target + 1 + rng.IntN(cfg.Relays-1)) % cfg.Relays
			f.Hold = cfg.Hold.draw(rng)
		case FaultEtcd:
			f.Target, f.Hold = rng.IntN(cfg.EtcdMembers), cfg.Down.draw(rng)
		case FaultUpstream, FaultEtcdLeader:
			f.Hold = cfg.Down.draw(rng)
		case FaultStarve:
			f.Target, f.Hold = rng.IntN(cfg.Relays), cfg.Starve.draw(rng)
			f.CPU = 0.02 + 0.03*rng.Float64()
		case FaultSlow:
			f.Target, f.Hold = rng.IntN(cfg.Relays), cfg.Hold.draw(rng)
			f.Delay = 50*time.Millisecond + time.Duration(rng.Int64N(int64(250*time.Millisecond)))
			f.RateKbit = 256 + rng.IntN(769)
			f.Loss = 0.01 + 0.04*rng.Float64()
		}
		out = append(out, f)
	}
	return out
}

// FaultRecord is a fault as it was played.
type FaultRecord struct {
	Fault
	Start time.Time `json:"start"`
	// Healed is when the fault ended: the process restarted, thawed, the
	// link healed, the last relay of a rolling restart started.
	Healed time.Time `json:"healed"`
	// RecoverS is from Healed until every Envoy held, for every change
	// published up to Healed, that change or a newer one (from the
	// checker's delivery times; 0 if they all held it already).
	RecoverS float64 `json:"recover_s"`
	// DuringP99S is the P99, over the changes published between Start and
	// Healed, of change → last Envoy ACK.
	DuringP99S float64 `json:"during_p99_s"`
	// Detail says how the fault was made on this machine (the cgroup or
	// the signals of a starvation, netem or a rate limit for a slow
	// link) and what it hit (who was the etcd leader, at what revision).
	Detail string `json:"detail,omitempty"`
	// During are those changes' change → last ACK, in seconds.
	During []float64 `json:"during_s"`
}

// ChaosSeedReport is one seed's run.
type ChaosSeedReport struct {
	Seed uint64 `json:"seed"`
	// The seed's protocols (ChaosProtocols): the Envoys' and the relays'
	// to the upstream.
	EnvoyProtocol    string        `json:"envoy_protocol"`
	UpstreamProtocol string        `json:"upstream_protocol"`
	Faults           []FaultRecord `json:"faults"`
	Changes          int           `json:"changes"`
	// ChangeP99S is change → last ACK over the whole run.
	ChangeP99S float64  `json:"change_p99_s"`
	Violations []string `json:"violations"`
	Dir        string   `json:"dir"`
	Err        string   `json:"error,omitempty"`
}

// ChaosKindFigures are one fault kind's figures over every seed.
type ChaosKindFigures struct {
	Kind       FaultKind `json:"kind"`
	Faults     int       `json:"faults"`
	RecoverP50 float64   `json:"recover_p50_s"`
	RecoverP99 float64   `json:"recover_p99_s"`
	DuringP99  float64   `json:"during_change_p99_s"`
	DuringN    int       `json:"during_changes"`
}

// ChaosReport is what RunChaos measured and found.
type ChaosReport struct {
	Date          string  `json:"date"`
	Machine       string  `json:"machine"`
	Relays        int     `json:"relays"`
	EtcdMembers   int     `json:"etcd_members"`
	Envoys        int     `json:"envoys"`
	Keys          int     `json:"keys"`
	ChurnRate     float64 `json:"churn_rate"`
	DeliveryBound float64 `json:"delivery_bound_s"`
	// SlowLink and Starve say how this machine makes a slow link and a
	// starved relay; Skipped, the kinds it could not play and why.
	SlowLink   string             `json:"slow_link"`
	Starve     string             `json:"starve"`
	Skipped    []string           `json:"skipped,omitempty"`
	Seeds      []ChaosSeedReport  `json:"seeds"`
	Kinds      []ChaosKindFigures `json:"kinds"`
	Violations int                `json:"violations"`
}

// Failed reports whether any seed found a violation or failed to run.
func (r *ChaosReport) Failed() bool {
	for _, s := range r.Seeds {
		if len(s.Violations) > 0 || s.Err != "" {
			return true
		}
	}
	return false
}

// Fixed addresses in the run's own network namespace.
const (
	chaosUpstreamAddr = "127.0.0.100:15010"
	chaosRelayUIDBase = 61000
)

func chaosRelayIP(i int) string { return fmt.Sprintf("127.0.0.%d", 10+i) }

// chaosKindsHere returns the kinds this machine can play, and for each it
// cannot a line that names it and says why.
func chaosKindsHere(kinds []FaultKind) (ok []FaultKind, skipped []string) {
	shapeErr := failpoints.CanShape()
	for _, k := range kinds {
		if k == FaultSlow && shapeErr != nil {
			skipped = append(skipped, fmt.Sprintf("%s: %v", k, shapeErr))
			continue
		}
		ok = append(ok, k)
	}
	return ok, skipped
}
func chaosEtcdIP(i int) string { return fmt.Sprintf("127.0.0.%d", 2+i) }

// RunChaos runs every seed and reports. It must run in a network
// namespace of its own (failpoints.ReexecInNetns). A seed that finds a violation
// prints the seed, its schedule, the first violating event and the relay
// logs around it to out; the run goes on with the next seed.
func RunChaos(ctx context.Context, cfg ChaosConfig, out io.Writer) (*ChaosReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	kinds, skipped := chaosKindsHere(cfg.Kinds)
	if len(skipped) > 0 && cfg.Strict {
		return nil, fmt.Errorf("loadtest: chaos cannot play %s", strings.Join(skipped, "; "))
	}
	for i, s := range skipped {
		skipped[i] = "left out " + s
		fmt.Fprintf(out, "chaos: %s\n", skipped[i])
	}
	if len(kinds) == 0 {
		return nil, errors.New("loadtest: chaos: no fault kind can be played here")
	}
	cfg.Kinds = kinds
	failpoints.SweepCPUGroups()
	uids := make([]uint32, cfg.Relays)
	for i := range uids {
		uids[i] = uint32(chaosRelayUIDBase + i)
	}
	net, err := failpoints.NewNet(uids)
	if err != nil {
		return nil, err
	}
	dir := cfg.Dir
	keep := dir != ""
	if dir == "" {
		if dir, err = os.MkdirTemp("", "meshrelay-chaos-"); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	// Relays run as other users: they need to reach the binary.
	for _, d := range []string{dir, filepath.Dir(cfg.Meshrelay)} {
		if err := os.Chmod(d, 0o755); err != nil {
			return nil, err
		}
	}
	rep := &ChaosReport{
		Date:    time.Now().UTC().Format(time.RFC3339),
		Machine: report.ThisMachine().Short(),
		Relays:  cfg.Relays, EtcdMembers: cfg.EtcdMembers, Envoys: cfg.Envoys, Keys: cfg.Keys,
		ChurnRate: cfg.ChurnRate, DeliveryBound: cfg.DeliveryBound.Seconds(),
		SlowLink: net.SlowHow(), Starve: failpoints.StarveHow(), Skipped: skipped,
	}
	if cfg.StarveSignals {
		rep.Starve = "SIGSTOP/SIGCONT bursts (asked for)"
	}
	fmt.Fprintf(out, "chaos: slow links by %s; relays starved by %s\n", rep.SlowLink, rep.Starve)
	for _, seed := range cfg.Seeds {
		if ctx.Err() != nil {
			break
		}
		sr := runChaosSeed(ctx, cfg, net, seed, filepath.Join(dir, fmt.Sprintf("seed-%d", seed)), out)
		rep.Seeds = append(rep.Seeds, sr)
		rep.Violations += len(sr.Violations)
	}
	rep.Kinds = chaosFigures(cfg.Kinds, rep.Seeds)
	if !keep && !rep.Failed() {
		os.RemoveAll(dir)
	}
	return rep, ctx.Err()
}

// chaosFigures gathers each kind's figures over the seeds.
func chaosFigures(kinds []FaultKind, seeds []ChaosSeedReport) []ChaosKindFigures {
	var out []ChaosKindFigures
	for _, k := range kinds {
		f := ChaosKindFigures{Kind: k}
		var rec, during []time.Duration
		for _, s := range seeds {
			for _, fr := range s.Faults {
				if fr.Kind != k || fr.Healed.IsZero() {
					continue
				}
				f.Faults++
				rec = append(rec, secs(fr.RecoverS))
				for _, d := range fr.During {
					during = append(during, secs(d))
				}
			}
		}
		r, d := report.Summarize(rec), report.Summarize(during)
		f.RecoverP50, f.RecoverP99 = r.P50.Seconds(), r.P99.Seconds()
		f.DuringP99, f.DuringN = d.P99.Seconds(), d.N
		out = append(out, f)
	}
	return out
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// PrintChaos prints the figures table.
func PrintChaos(w io.Writer, r *ChaosReport) {
	fmt.Fprintf(w, "\nloadtest chaos: %d seeds, %d relays, %d etcd members, %d Envoys over %d keys, churn %.1f/s; %s\n",
		len(r.Seeds), r.Relays, r.EtcdMembers, r.Envoys, r.Keys, r.ChurnRate, r.Machine)
	fmt.Fprintf(w, "slow links by %s; relays starved by %s\n", r.SlowLink, r.Starve)
	for _, s := range r.Skipped {
		fmt.Fprintf(w, "%s\n", s)
	}
	fmt.Fprintf(w, "%-16s %7s %12s %12s %22s\n", "fault", "faults", "recover P50", "recover P99", "change→all P99 during")
	for _, k := range r.Kinds {
		fmt.Fprintf(w, "%-16s %7d %11.2fs %11.2fs %14.2fs (%4d)\n", k.Kind, k.Faults, k.RecoverP50, k.RecoverP99, k.DuringP99, k.DuringN)
	}
	for _, s := range r.Seeds {
		verdict := "PASS"
		if len(s.Violations) > 0 || s.Err != "" {
			verdict = fmt.Sprintf("FAIL (%d violations) %s", len(s.Violations), s.Err)
		}
		fmt.Fprintf(w, "seed %d (%s Envoys, %s upstream): %d changes, change→all P99 %.2fs: %s\n",
			s.Seed, s.EnvoyProtocol, s.UpstreamProtocol, s.Changes, s.ChangeP99S, verdict)
	}
	fmt.Fprintf(w, "violations: %d (delivery bound %.0fs)\n", r.Violations, r.DeliveryBound)
}

// chaosRun is one seed's tier.
type chaosRun struct {
	cfg  ChaosConfig
	net  *failpoints.Net
	dir  string
	out  io.Writer
	seed uint64
	// upProto is the seed's upstream protocol.
	upProto relay.Protocol

	etcd   *EtcdCluster
	up     *chaosUpstream
	mirror *upstream.Upstream // what the upstream serves, stepped alike
	churn  *upstream.Churner
	relays *RelayProcs
	fleet  *traffic.Fleet

	files     []*os.File // every log file, closed at the end
	histories []envoyRecord
	churnMu   sync.Mutex // held by a churn step, and while the upstream is down

	mu        sync.Mutex
	published []validation.Published
	errs      []string // process failures seen during the run

	// stuck are the Envoys still behind when a recovery timed out: a
	// liveness violation already, they are not waited for after later
	// faults (each would time out again and tell nothing new), but the
	// end of the seed still wants them current.
	stuck map[int]bool
}

type envoyRecord struct {
	mu     sync.Mutex
	events []envoy.Event
}

func runChaosSeed(ctx context.Context, cfg ChaosConfig, net *failpoints.Net, seed uint64, dir string, out io.Writer) (sr ChaosSeedReport) {
	proto, upProto := ChaosProtocols(cfg, seed)
	sr = ChaosSeedReport{Seed: seed, EnvoyProtocol: proto.String(), UpstreamProtocol: string(upProto), Dir: dir}
	schedule := ChaosSchedule(cfg, seed)
	fmt.Fprintf(out, "seed %d: %s Envoys, %s upstream, logs in %s; schedule:\n", seed, proto, upProto, dir)
	for i, f := range schedule {
		fmt.Fprintf(out, "  %d. %s\n", i+1, f)
	}
	r := &chaosRun{cfg: cfg, net: net, dir: dir, out: out, seed: seed, upProto: upProto}
	defer r.stop()
	hist, faults, err := r.run(ctx, proto, schedule)
	sr.Faults = faults
	if err != nil {
		sr.Err = err.Error()
		fmt.Fprintf(out, "seed %d: %v\n", seed, err)
	}
	if hist == nil {
		return sr
	}
	res := validation.Check(*hist, validation.Config{DeliveryBound: cfg.DeliveryBound})
	sr.Changes = len(res.Changes)
	var all []time.Duration
	for _, c := range res.Changes {
		all = append(all, c.Last)
	}
	sr.ChangeP99S = report.Summarize(all).P99.Seconds()
	for i := range sr.Faults {
		fr := &sr.Faults[i]
		if fr.Healed.IsZero() {
			continue
		}
		var during []time.Duration
		var last time.Time
		for _, c := range res.Changes {
			if c.At.After(fr.Healed) {
				continue
			}
			if c.Done.After(last) {
				last = c.Done
			}
			if !c.At.Before(fr.Start) {
				during = append(during, c.Last)
				fr.During = append(fr.During, c.Last.Seconds())
			}
		}
		fr.RecoverS = max(last.Sub(fr.Healed), 0).Seconds()
		fr.DuringP99S = report.Summarize(during).P99.Seconds()
	}
	for _, v := range res.Violations {
		sr.Violations = append(sr.Violations, v.String())
	}
	for _, ev := range r.envoyViolations() {
		sr.Violations = append(sr.Violations, fmt.Sprintf("envoy: %s at %s: %v", ev.id, ev.v.At.Format("15:04:05.000"), ev.v))
	}
	sr.Violations = append(sr.Violations, r.errs...)
	if len(sr.Violations) > 0 {
		r.explain(hist, res.Violations, schedule, sr.Violations)
	}
	return sr
}

// run plays one seed and returns its history.
func (r *chaosRun) run(ctx context.Context, proto envoy.Protocol, schedule []Fault) (*validation.History, []FaultRecord, error) {
	if err := os.MkdirAll(r.dir, 0o755); err != nil {
		return nil, nil, err
	}
	// etcd: a real cluster, each member its own process.
	var hosts []string
	var etcdLogs []io.Writer
	for i := range r.cfg.EtcdMembers {
		hosts = append(hosts, chaosEtcdIP(i))
		f, err := r.logFile(fmt.Sprintf("etcd-%d", i))
		if err != nil {
			return nil, nil, err
		}
		etcdLogs = append(etcdLogs, f)
	}
	etcd, err := StartEtcdCluster(ctx, r.cfg.StartEtcdMember, hosts, filepath.Join(r.dir, "etcd"), etcdLogs)
	if err != nil {
		return nil, nil, err
	}
	r.etcd = etcd

	// The upstream and its mirror.
	upLog, err := r.logFile("upstream")
	if err != nil {
		return nil, nil, err
	}
	ucfg := ChaosUpstreamConfig{Listen: chaosUpstreamAddr, Scenario: r.cfg.Scenario, Seed: int64(r.seed), AddRemoveFraction: r.cfg.AddRemoveFraction}
	r.up = &chaosUpstream{start: r.cfg.StartUpstream, cfg: ucfg, log: upLog}
	if err := r.up.run(ctx, 0); err != nil {
		return nil, nil, err
	}
	mcfg := upstream.DefaultConfig()
	mcfg.Scenario = r.cfg.Scenario
	if r.mirror, err = upstream.New(mcfg); err != nil {
		return nil, nil, err
	}
	r.churn = r.mirror.NewChurner(int64(r.seed), r.cfg.AddRemoveFraction)

	// Relays, and the Service in front of them.
	relayLogs := make([]io.Writer, r.cfg.Relays)
	for i := range r.cfg.Relays {
		if relayLogs[i], err = r.logFile(fmt.Sprintf("relay-%d", i)); err != nil {
			return nil, nil, err
		}
	}
	r.relays, err = StartRelayProcs(ctx, RelayProcsConfig{
		Meshrelay: r.cfg.Meshrelay, Relays: r.cfg.Relays, Host: chaosRelayIP,
		Upstream: chaosUpstreamAddr, UpstreamProtocol: r.upProto, Etcd: r.etcd.Endpoints(),
		LogLevel: r.cfg.RelayLogLevel, Dir: r.dir,
		Log: func(i int) io.Writer { return relayLogs[i] },
		User: func(i int) *ChildUser {
			return &ChildUser{UID: uint32(chaosRelayUIDBase + i), GID: uint32(chaosRelayUIDBase + i)}
		},
		Exited: func(i int) { r.fail("relay-%d exited on its own", i) },
	})
	if err != nil {
		return nil, nil, err
	}
	if err := r.waitFor(ctx, 2*time.Minute, "every relay ready", func() bool { return r.relays.ReadyN() == r.cfg.Relays }); err != nil {
		return nil, nil, err
	}

	// The Envoys, every event recorded.
	r.histories = make([]envoyRecord, r.cfg.Envoys)
	fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{
		Scenario: r.cfg.Scenario, Envoys: r.cfg.Envoys, Keys: r.cfg.Keys, Protocol: proto, Target: r.relays.Addr(),
		OnEvent: func(i int, ev envoy.Event) {
			h := &r.histories[i]
			h.mu.Lock()
			h.events = append(h.events, ev)
			h.mu.Unlock()
		},
		Configure: func(_ int, c *envoy.Config) {
			// Retries as an Envoy's, capped lower than its 30 s so that
			// the figures measure the tier, not the client's backoff.
			c.Backoff = envoy.Backoff{Base: 500 * time.Millisecond, Max: 5 * time.Second}
		},
	})
	if err != nil {
		return nil, nil, err
	}
	r.fleet = fleet
	initial := map[string]map[traffic.ResourceKey]uint64{}
	for _, g := range r.mirror.Groups() {
		initial[g] = traffic.Generations(r.mirror.Snapshot(g))
	}
	if err := r.waitFor(ctx, 2*time.Minute, "initial sync", func() bool { return fleet.Synced(r.mirror) == r.cfg.Envoys }); err != nil {
		return nil, nil, err
	}
	start := time.Now()
	fmt.Fprintf(r.out, "seed %d: tier up, %d Envoys synced\n", r.seed, r.cfg.Envoys)

	// The churn, and the faults.
	churnCtx, stopChurn := context.WithCancel(ctx)
	churnDone := make(chan struct{})
	go func() {
		defer close(churnDone)
		r.runChurn(churnCtx)
	}()
	var records []FaultRecord
	var runErr error
	for i, f := range schedule {
		if ctx.Err() != nil {
			runErr = ctx.Err()
			break
		}
		rec := FaultRecord{Fault: f, Start: time.Now()}
		fmt.Fprintf(r.out, "seed %d: %6.1fs (%s) fault %d: %s\n", r.seed, time.Since(start).Seconds(), rec.Start.Format("15:04:05.000"), i+1, f)
		err := r.play(ctx, &rec, start)
		if err != nil {
			runErr = fmt.Errorf("fault %d (%s): %w", i+1, f, err)
			records = append(records, rec)
			break
		}
		rec.Healed = time.Now()
		if err := r.recover(ctx, rec.Healed, start); err != nil {
			r.fail("liveness: after fault %d (%s): %v", i+1, f, err)
		} else {
			fmt.Fprintf(r.out, "seed %d: %6.1fs   healed; every Envoy current %.1fs later\n", r.seed, time.Since(start).Seconds(), time.Since(rec.Healed).Seconds())
		}
		records = append(records, rec)
		traffic.SleepCtx(ctx, r.cfg.Settle)
	}
	stopChurn()
	<-churnDone

	// Steady state: everything delivered, one upstream stream per key.
	if runErr == nil {
		if err := r.waitFor(ctx, r.cfg.RecoverTimeout, "final sync", func() bool { return fleet.Synced(r.mirror) == r.cfg.Envoys }); err != nil {
			r.fail("liveness: %v", err)
		}
		var streams map[string]int
		err := r.waitFor(ctx, r.cfg.RecoverTimeout, "one upstream stream per key", func() bool {
			streams, _ = r.up.streams()
			return r.oneStreamPerKey(streams) == ""
		})
		if err != nil {
			r.fail("steady state: %s", r.oneStreamPerKey(streams))
		}
		traffic.SleepCtx(ctx, time.Second) // late events of the last pushes
	}
	end := time.Now()
	fleet.Stop(context.WithoutCancel(ctx))
	h := &validation.History{Initial: initial, End: end}
	r.mu.Lock()
	h.Published = slices.Clone(r.published)
	r.mu.Unlock()
	groups := fleet.Groups()
	for i, e := range fleet.Envoys() {
		rec := &r.histories[i]
		rec.mu.Lock()
		h.Envoys = append(h.Envoys, validation.EnvoyHistory{ID: e.ID(), Group: groups[i], Events: rec.events})
		rec.mu.Unlock()
	}
	return h, records, runErr
}

func (r *chaosRun) fail(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	fmt.Fprintf(r.out, "seed %d: %s\n", r.seed, msg)
	r.mu.Lock()
	r.errs = append(r.errs, msg)
	r.mu.Unlock()
}

func (r *chaosRun) logFile(name string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(r.dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err == nil {
		r.files = append(r.files, f)
	}
	return f, err
}

// waitFor polls cond every 100 ms for up to d.
func (r *chaosRun) waitFor(ctx context.Context, d time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not after %v", what, d)
		}
		if !traffic.SleepCtx(ctx, 100*time.Millisecond) {
			return ctx.Err()
		}
	}
	return nil
}

// runChurn steps the upstream and its mirror at ChurnRate, except while
// the upstream is down, and records what each step published.
func (r *chaosRun) runChurn(ctx context.Context) {
	t := time.NewTicker(time.Duration(float64(time.Second) / r.cfg.ChurnRate))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := r.step(); err != nil {
			r.fail("churn: %v", err)
			return
		}
	}
}

// step applies one churn step to the upstream and its mirror.
func (r *chaosRun) step() error {
	r.churnMu.Lock() // an upstream fault holds it while the upstream is down
	defer r.churnMu.Unlock()
	return r.stepLocked()
}

// stepLocked is step with churnMu held.
func (r *chaosRun) stepLocked() error {
	at := time.Now()
	changes, err := r.churn.Step()
	if err != nil {
		return err
	}
	n, err := r.up.step()
	if err != nil {
		return err
	}
	if n != r.churn.Steps() {
		return fmt.Errorf("upstream at step %d, its mirror at %d", n, r.churn.Steps())
	}
	snaps := map[string]map[traffic.ResourceKey]uint64{}
	var pubs []validation.Published
	for _, c := range changes {
		for _, g := range c.Groups {
			if snaps[g] == nil {
				snaps[g] = traffic.Generations(r.mirror.Snapshot(g))
			}
			key := traffic.ResourceKeyOf(c.TypeURL, c.Name)
			gen, ok := snaps[g][key]
			pubs = append(pubs, validation.Published{At: at, Group: g, Key: key, Generation: gen, Removed: !ok})
		}
	}
	r.mu.Lock()
	r.published = append(r.published, pubs...)
	r.mu.Unlock()
	return nil
}

// expectedNow is what the upstream serves each group now (clusters and
// endpoints), for covers.
func (r *chaosRun) expectedNow() map[string]map[string]uint64 {
	out := map[string]map[string]uint64{}
	for _, g := range r.mirror.Groups() {
		out[g] = traffic.Expected(r.mirror.Snapshot(g))
	}
	return out
}

// recover waits, RecoverTimeout at most, until every Envoy holds, of the
// clusters and endpoints served at healed, that generation or a newer one
// (or nothing, if the upstream removed it since). A recovery that takes
// more than 5 s explains itself: then and every 10 s it prints how many
// Envoys are behind and what the one behind the longest still waits for;
// on a timeout, also that Envoy's last events. Envoys stuck since an
// earlier timeout are not waited for.
func (r *chaosRun) recover(ctx context.Context, healed, start time.Time) error {
	snap := r.expectedNow()
	deadline := healed.Add(r.cfg.RecoverTimeout)
	note := healed.Add(5 * time.Second)
	since := map[int]time.Time{} // Envoy → behind without a break since
	if r.stuck == nil {
		r.stuck = map[int]bool{}
	}
	for {
		lags := slices.DeleteFunc(r.lagging(snap), func(l lag) bool { return r.stuck[l.envoy] })
		if len(lags) == 0 {
			return nil
		}
		now := time.Now()
		var worst lag
		for i, l := range lags {
			if _, ok := since[l.envoy]; !ok {
				since[l.envoy] = now
			}
			if i == 0 || since[l.envoy].Before(since[worst.envoy]) {
				worst = l
			}
		}
		for e := range since {
			if !slices.ContainsFunc(lags, func(l lag) bool { return l.envoy == e }) {
				delete(since, e)
			}
		}
		first := fmt.Sprintf("%s, behind for %.1fs", worst.why, now.Sub(since[worst.envoy]).Seconds())
		if now.After(deadline) {
			// What the Envoy last did: did it open a stream, and hear
			// from whom?
			h := &r.histories[worst.envoy]
			h.mu.Lock()
			evs := h.events[max(0, len(h.events)-8):]
			fmt.Fprintf(r.out, "seed %d: %6.1fs   recovery timed out; the last events of that Envoy (%d in all):\n", r.seed, now.Sub(start).Seconds(), len(h.events))
			for _, ev := range evs {
				fmt.Fprintf(r.out, "    %s\n", formatEvent(ev))
			}
			h.mu.Unlock()
			// Stuck: behind for half the wait or more (an Envoy caught
			// behind a change just published is not).
			n := 0
			for _, l := range lags {
				if now.Sub(since[l.envoy]) >= r.cfg.RecoverTimeout/2 {
					r.stuck[l.envoy] = true
					n++
				}
			}
			return fmt.Errorf("recovery: not after %v: %s behind, %s of them stuck (not waited for after later faults); %s",
				r.cfg.RecoverTimeout, envoysN(len(lags)), envoysN(n), first)
		}
		if !now.Before(note) {
			fmt.Fprintf(r.out, "seed %d: %6.1fs   recovering for %.1fs: %s behind; %s\n",
				r.seed, now.Sub(start).Seconds(), now.Sub(healed).Seconds(), envoysN(len(lags)), first)
			note = note.Add(10 * time.Second)
		}
		if !traffic.SleepCtx(ctx, 100*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// lag is an Envoy behind, and what it waits for.
type lag struct {
	envoy int
	why   string
}

func envoysN(n int) string {
	if n == 1 {
		return "1 Envoy"
	}
	return fmt.Sprintf("%d Envoys", n)
}

// lagging returns the Envoys that do not yet hold, of the clusters and
// endpoints snap had, that generation or a newer one (or nothing, if the
// upstream removed it since), or that hold something removed before snap,
// each with the first thing it waits for.
func (r *chaosRun) lagging(snap map[string]map[string]uint64) []lag {
	now := r.expectedNow()
	groups := r.fleet.Groups()
	var out []lag
	for i, e := range r.fleet.Envoys() {
		was, is := snap[groups[i]], now[groups[i]]
		held := map[string]uint64{}
		for _, typeURL := range []string{envoy.ClusterType, envoy.EndpointType} {
			for name, h := range e.Resources(typeURL) {
				held[typeURL+"|"+name] = h.Generation
			}
		}
		why := ""
		for _, key := range slices.Sorted(maps.Keys(was)) {
			gen := was[key]
			h, ok := held[key]
			_, served := is[key]
			if ok && h < gen {
				why = fmt.Sprintf("%s held at generation %d, expected %d or newer", describeKey(key), h, gen)
			} else if !ok && served {
				why = fmt.Sprintf("%s not held, expected generation %d or newer", describeKey(key), gen)
			}
			if why != "" {
				break
			}
		}
		if why == "" {
			for _, key := range slices.Sorted(maps.Keys(held)) {
				_, had := was[key]
				_, served := is[key]
				if !had && !served {
					why = fmt.Sprintf("%s held at generation %d, removed by the upstream", describeKey(key), held[key])
					break
				}
			}
		}
		if why == "" {
			continue
		}
		cp := e.ControlPlane()
		if cp == "" {
			cp = "none yet"
		}
		out = append(out, lag{envoy: i, why: fmt.Sprintf("%s (last answered by %s, %d relays ready): %s", e.ID(), cp, r.relays.ReadyN(), why)})
	}
	return out
}

// describeKey turns "type.googleapis.com/…Cluster|name" into "Cluster
// name".
func describeKey(key string) string {
	typeURL, name, _ := strings.Cut(key, "|")
	return typeURL[strings.LastIndexByte(typeURL, '.')+1:] + " " + name
}

// oneStreamPerKey returns "" if the upstream has exactly one stream per
// key, and what differs otherwise.
func (r *chaosRun) oneStreamPerKey(streams map[string]int) string {
	if streams == nil {
		return "no answer from the upstream"
	}
	perKey := map[int]int{}
	var stray []string
	nodeKey := map[string]int{}
	for i, e := range r.fleet.Envoys() {
		nodeKey[e.ID()] = i % r.cfg.Keys
	}
	for node, n := range streams {
		k, ok := nodeKey[node]
		if !ok {
			stray = append(stray, fmt.Sprintf("%s: %d", node, n))
			continue
		}
		perKey[k] += n
	}
	var bad []string
	for k := range r.cfg.Keys {
		if perKey[k] != 1 {
			bad = append(bad, fmt.Sprintf("key %d: %d streams", k, perKey[k]))
		}
	}
	if len(bad) == 0 && len(stray) == 0 {
		return ""
	}
	return fmt.Sprintf("want one upstream stream per key: %s %s", strings.Join(bad, ", "), strings.Join(stray, ", "))
}

// play applies the fault of rec and returns once it healed; it notes in
// rec how the fault was made and what it hit.
func (r *chaosRun) play(ctx context.Context, rec *FaultRecord, start time.Time) error {
	f := rec.Fault
	switch f.Kind {
	case FaultKill:
		r.relays.StopRelay(ctx, f.Target, false)
		traffic.SleepCtx(ctx, f.Hold)
		return r.relays.Start(ctx, f.Target)
	case FaultFreeze:
		c := r.relays.Child(f.Target)
		if c == nil {
			return fmt.Errorf("relay-%d is not running", f.Target)
		}
		if err := c.Signal(syscall.SIGSTOP); err != nil {
			return err
		}
		traffic.SleepCtx(ctx, f.Hold)
		return c.Signal(syscall.SIGCONT)
	case FaultCut:
		if err := r.net.Cut(f.Target, f.Peer, chaosRelayIP(f.Target), chaosRelayIP(f.Peer)); err != nil {
			return err
		}
		traffic.SleepCtx(ctx, f.Hold)
		return r.net.Heal()
	case FaultStarve:
		return r.starve(ctx, rec, start)
	case FaultSlow:
		how, err := r.net.Slow(f.Target, chaosRelayIP(f.Target), f.Delay, f.RateKbit, f.Loss)
		r.detail(rec, start, "relay-%d's link: %s", f.Target, how)
		if err == nil {
			traffic.SleepCtx(ctx, f.Hold)
		}
		return errors.Join(err, r.net.Fast())
	case FaultEtcdLeader:
		return r.killEtcdLeader(ctx, rec, start)
	case FaultEtcd:
		r.etcd.Kill(f.Target)
		traffic.SleepCtx(ctx, f.Hold)
		return r.etcd.Start(ctx, f.Target)
	case FaultUpstream:
		// istiod down publishes nothing: the churn waits.
		r.churnMu.Lock()
		defer r.churnMu.Unlock()
		r.up.kill()
		traffic.SleepCtx(ctx, f.Hold)
		return r.up.run(ctx, r.churn.Steps())
	case FaultRolling:
		return scenario.RollingRestart(ctx, r.relays, 2*time.Minute, func(err error) { r.fail("%v", err) })
	}
	return fmt.Errorf("unknown fault %q", f.Kind)
}

// detail prints a line of how a fault was made or what it hit, and adds it
// to the fault's record.
func (r *chaosRun) detail(rec *FaultRecord, start time.Time, format string, args ...any) {
	d := fmt.Sprintf(format, args...)
	fmt.Fprintf(r.out, "seed %d: %6.1fs   %s\n", r.seed, time.Since(start).Seconds(), d)
	if rec.Detail != "" {
		rec.Detail += "; "
	}
	rec.Detail += d
}

// starve holds relay rec.Target to rec.CPU of one CPU for rec.Hold: a
// cgroup CPU quota where a cpu controller is writable, else SIGSTOP and
// SIGCONT in turn, a second at a time, at the same duty cycle. Either is
// undone on every path.
func (r *chaosRun) starve(ctx context.Context, rec *FaultRecord, start time.Time) error {
	f := rec.Fault
	c := r.relays.Child(f.Target)
	if c == nil {
		return fmt.Errorf("relay-%d is not running", f.Target)
	}
	var cg *failpoints.CPUCap
	err := errors.New("SIGSTOP/SIGCONT bursts asked for")
	if !r.cfg.StarveSignals {
		cg, err = failpoints.CapCPU(c.Pid(), f.CPU)
	}
	if err == nil {
		defer cg.Release() // idempotent: undone on every path
		r.detail(rec, start, "relay-%d (pid %d) starved by %s", f.Target, c.Pid(), cg.How())
		traffic.SleepCtx(ctx, f.Hold)
		stat := cg.Throttled()
		if err := cg.Release(); err != nil {
			return err
		}
		r.detail(rec, start, "relay-%d thawed: %s", f.Target, stat)
		return nil
	}
	run := time.Duration(f.CPU * float64(time.Second))
	r.detail(rec, start, "relay-%d starved by SIGSTOP/SIGCONT bursts, running %v of every second (no cgroup: %v)", f.Target, run.Round(time.Millisecond), err)
	defer c.Signal(syscall.SIGCONT)
	for end := time.Now().Add(f.Hold); time.Now().Before(end); {
		if err := c.Signal(syscall.SIGSTOP); err != nil {
			return err
		}
		if !traffic.SleepCtx(ctx, min(time.Second-run, time.Until(end))) {
			break
		}
		if err := c.Signal(syscall.SIGCONT); err != nil {
			return err
		}
		if !traffic.SleepCtx(ctx, run) {
			break
		}
	}
	return nil
}

// killEtcdLeader finds the etcd leader, makes the owners write (a burst of
// two seconds' churn at once, each owner flushing its keys' snapshots a
// FlushInterval later), waits until the leader's revision moves (the
// first flush landed, the others under way), kills the leader, and
// restarts it on its data rec.Hold later. rec says who was leader.
func (r *chaosRun) killEtcdLeader(ctx context.Context, rec *FaultRecord, start time.Time) error {
	var leader int
	var st EtcdStatus
	err := r.waitFor(ctx, 10*time.Second, "an etcd leader", func() bool {
		var err error
		leader, st, err = r.etcd.Leader(ctx)
		return err == nil
	})
	if err != nil {
		return err
	}
	rec.Target = leader
	burst := max(10, int(2*r.cfg.ChurnRate))
	r.churnMu.Lock()
	t0 := time.Now()
	for range burst {
		if err := r.stepLocked(); err != nil {
			r.churnMu.Unlock()
			return fmt.Errorf("burst: %w", err)
		}
	}
	r.churnMu.Unlock()
	// Owners gather changes for a FlushInterval (1 s) before they write.
	rev := st.Revision
	var moved time.Duration
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		if now, err := r.etcd.Status(ctx, leader); err == nil && now.Revision > st.Revision {
			rev, moved = now.Revision, time.Since(t0)
			break
		}
		if !traffic.SleepCtx(ctx, 20*time.Millisecond) {
			return ctx.Err()
		}
	}
	r.etcd.Kill(leader)
	flush := fmt.Sprintf("its revision went from %d to %d %v after a burst of %d changes began", st.Revision, rev, moved.Round(time.Millisecond), burst)
	if moved == 0 {
		flush = fmt.Sprintf("no write landed within 5 s of a burst of %d changes (revision %d)", burst, rev)
	}
	r.detail(rec, start, "etcd-%d was the leader (member %x, raft term %d), killed: %s", leader, st.ID, st.Term, flush)
	traffic.SleepCtx(ctx, rec.Hold)
	return r.etcd.Start(ctx, leader)
}

// stop ends every process of the run; safe on a half-started run.
func (r *chaosRun) stop() {
	if r.fleet != nil {
		r.fleet.Stop(context.Background())
	}
	if r.relays != nil {
		r.relays.Stop(context.Background())
	}
	if r.up != nil {
		r.up.kill()
	}
	if r.etcd != nil {
		r.etcd.Stop()
	}
	if r.net != nil {
		_ = r.net.Heal()
		_ = r.net.Fast()
	}
	for _, f := range r.files {
		f.Close()
	}
}
