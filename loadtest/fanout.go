// Package loadtest holds meshrelay's benchmark drivers (Run… behind
// cmd/loadtest): fanout, scale, warmstart, ledger, proxystatus, keys,
// ctrip and the TLS admission storm; their child processes; the process
// meter; the chaos suite of real relay processes (its faults made by
// loadtest/failpoints, its runs judged by loadtest/validation); and the
// end-to-end tests with real Envoys. The parts they are built from are the
// packages below it.
package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/shard"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/snapshot"
)

// FanoutMode says how the simulated Envoys reach the upstream.
type FanoutMode string

const (
	// Direct connects every Envoy to the synthetic upstream, as Envoys
	// connect to istiod today.
	Direct FanoutMode = "direct"
	// Relayed connects every Envoy to one relay, in a process of its own,
	// which subscribes to the upstream once per aggregation key.
	Relayed FanoutMode = "relayed"
)

// ParseFanoutMode parses "direct" or "relayed".
func ParseFanoutMode(s string) (FanoutMode, error) {
	switch FanoutMode(s) {
	case Direct, Relayed:
		return FanoutMode(s), nil
	}
	return "", fmt.Errorf("loadtest: unknown mode %q (want direct or relayed)", s)
}

// RelayChildConfig is how a relay child process is started: the relay
// listens on XDSListen and subscribes to Upstream.
type RelayChildConfig struct {
	// Upstream is the upstream's gRPC target. Required.
	Upstream string `json:"upstream"`
	// UpstreamProtocol is the ADS variant the relay speaks upstream.
	// Default delta.
	UpstreamProtocol relay.Protocol `json:"upstream_protocol"`
	// XDSListen is the relay's listen address. Default "127.0.0.1:0" (the
	// child prints the port it got).
	XDSListen string `json:"xds_listen"`
	// CPUProfile, if set, is a file the child writes a CPU profile to,
	// covering the time between a "profile start" and a "profile stop" line
	// on its stdin.
	CPUProfile string `json:"cpuprofile,omitempty"`
	// HeapProfile, if set, is a file the child writes a heap profile to
	// when it reads "profile stop", and beside it (.mem.txt for .pprof)
	// what the profile leaves out: goroutines, stacks, the runtime's own.
	HeapProfile string `json:"heapprofile,omitempty"`
	// Etcd, if set, gives the relay a snapshot store on these etcd
	// endpoints: it persists its keys and starts warm from them, and it
	// reports its address only once it is ready to serve (warm).
	Etcd []string `json:"etcd,omitempty"`
	// TLS, if set, makes the relay serve its TLS port alone, on
	// XDSListen, authenticating every stream by its service-account token;
	// the address the child reports is that port's.
	TLS *RelayChildTLS `json:"tls,omitempty"`
	// MemoryLimit, if set, is the memory limit of the container the
	// child runs as if in, in bytes: GOMEMLIMIT becomes 0.9 of it, as
	// `meshrelay serve` sets it from its cgroup (--memory-limit-ratio).
	MemoryLimit int64 `json:"memory_limit,omitempty"`
	// KeyProfile and KeyFields are the relay's --key-profile and
	// --key-fields (default: the istio profile).
	KeyProfile string `json:"key_profile,omitempty"`
	KeyFields  string `json:"key_fields,omitempty"`
	// CPUs, if set, pins the child to these CPUs (ChildConfig.CPUs). It
	// is how the parent starts the child, not an argument the child reads.
	CPUs CPUSet `json:"-"`
}

// childMemoryLimitRatio is meshrelay serve's default --memory-limit-ratio.
const childMemoryLimitRatio = 0.9

// Args returns cfg as the flags of `loadtest relay-child`.
func (c RelayChildConfig) Args() []string {
	args := []string{"--upstream", c.Upstream}
	if c.UpstreamProtocol != "" {
		args = append(args, "--upstream-protocol", string(c.UpstreamProtocol))
	}
	if c.XDSListen != "" {
		args = append(args, "--xds-listen", c.XDSListen)
	}
	if c.CPUProfile != "" {
		args = append(args, "--cpuprofile", c.CPUProfile)
	}
	if c.HeapProfile != "" {
		args = append(args, "--heapprofile", c.HeapProfile)
	}
	if len(c.Etcd) > 0 {
		args = append(args, "--etcd", strings.Join(c.Etcd, ","))
	}
	if c.TLS != nil {
		args = append(args, c.TLS.args()...)
	}
	if c.MemoryLimit > 0 {
		args = append(args, "--memory-limit", strconv.FormatInt(c.MemoryLimit, 10))
	}
	if c.KeyProfile != "" {
		args = append(args, "--key-profile", c.KeyProfile)
	}
	if c.KeyFields != "" {
		args = append(args, "--key-fields", c.KeyFields)
	}
	return args
}

// Commands a parent sends a relay child on its stdin. "profile start"
// profiles to RelayChildConfig.CPUProfile, and the "profile stop" after it
// also writes the heap profile; "profile start PATH" profiles to PATH
// alone.
const (
	childProfileStart = "profile start"
	childProfileStop  = "profile stop"
)

// RunRelayChild is the main of a relay child process: it starts a relay for
// cfg, prints "xds <addr>" on out once it listens, obeys the commands read
// from in ("profile start [PATH]", "profile stop"), and stops the relay when ctx
// ends (SIGTERM) or in reaches EOF (the parent is gone). Relay warnings go
// to logw. It returns once the relay has stopped; a goroutine reading in may
// remain until in is closed, so call it only as a process's main.
func RunRelayChild(ctx context.Context, cfg RelayChildConfig, in io.Reader, out, logw io.Writer) error {
	if cfg.MemoryLimit > 0 {
		debug.SetMemoryLimit(int64(childMemoryLimitRatio * float64(cfg.MemoryLimit)))
	}
	rcfg := relay.DefaultConfig()
	rcfg.ID = "meshrelay-loadtest"
	rcfg.Upstream.Addr = cfg.Upstream
	rcfg.XDS.Listen = cfg.XDSListen
	if rcfg.XDS.Listen == "" {
		rcfg.XDS.Listen = "127.0.0.1:0"
	}
	if cfg.UpstreamProtocol != "" {
		rcfg.Upstream.Protocol = cfg.UpstreamProtocol
	}
	switch {
	case cfg.KeyFields != "":
		p, err := aggkey.ParseKeyFields(cfg.KeyFields)
		if err != nil {
			return err
		}
		rcfg.Keys.Profile = p
	case cfg.KeyProfile != "":
		p, err := aggkey.ParseProfile(cfg.KeyProfile, nil)
		if err != nil {
			return err
		}
		rcfg.Keys.Profile = p
	}
	rcfg.Logger = slog.New(slog.NewTextHandler(logw, &slog.HandlerOptions{Level: slog.LevelWarn}))
	reg := prometheus.NewRegistry()
	rcfg.Registerer, rcfg.Gatherer = reg, reg
	// The benchmark times pushes, not admission: the fleet connects at
	// --start-rate, as it does to the upstream in direct mode, which has
	// no admission limit either.
	rcfg.XDS.AdmitRate = 0
	if cfg.TLS != nil {
		if err := cfg.TLS.Apply(ctx, &rcfg); err != nil {
			return err
		}
		rcfg.XDS.TLSListen, rcfg.XDS.Listen = rcfg.XDS.Listen, ""
	}
	nc := shard.NodeConfig{Relay: rcfg}
	if len(cfg.Etcd) > 0 {
		scfg := snapshot.DefaultConfig()
		scfg.Endpoints, scfg.Member, scfg.Logger = cfg.Etcd, rcfg.ID+"-"+strconv.Itoa(os.Getpid()), rcfg.Logger
		var err error
		if nc.Store, err = snapshot.New(scfg); err != nil {
			return err
		}
	}
	node, err := shard.NewNode(nc)
	if err != nil {
		return err
	}
	if err := node.Start(ctx); err != nil {
		return err
	}
	r := node.Relay()
	if nc.Store != nil {
		// The parent times the start: report once the relay can serve.
		for deadline := time.Now().Add(5 * time.Minute); !r.Ready() && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
	}
	addr := r.Addr()
	if cfg.TLS != nil {
		addr = r.TLSAddr()
	}
	if _, err := fmt.Fprintf(out, "%s%s\n", readyPrefix, addr); err != nil {
		_ = node.Stop(context.Background())
		return fmt.Errorf("loadtest: report address: %w", err)
	}

	cmds, eof := readCommands(ctx, in)
	var stopProf func() error // of the CPU profile running, if one is
	heapOnStop := false       // the profile was started without a path
	stopProfile := func() {
		if stopProf != nil {
			if err := stopProf(); err != nil {
				fmt.Fprintf(logw, "relay-child: cpuprofile: %v\n", err)
			}
			stopProf = nil
		}
	}
	defer stopProfile()
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case <-eof:
			break loop
		case c := <-cmds:
			path, named := strings.CutPrefix(c, childProfileStart+" ")
			if !named {
				path = cfg.CPUProfile
			}
			switch {
			case (c == childProfileStart || named) && path != "" && stopProf == nil:
				stop, err := ProfileCPU(path)
				if err != nil {
					fmt.Fprintf(logw, "relay-child: cpuprofile: %v\n", err)
					continue
				}
				stopProf, heapOnStop = stop, !named
			case c == childProfileStop:
				// A heap profile ends only the CPU profile it was started
				// with: a stop with none running writes nothing.
				heap := heapOnStop && stopProf != nil
				stopProfile()
				heapOnStop = false
				if heap && cfg.HeapProfile != "" {
					if err := writeHeapProfile(cfg.HeapProfile, reg); err != nil {
						fmt.Fprintf(logw, "relay-child: heapprofile: %v\n", err)
					}
				}
			}
		}
	}
	stopProfile()
	// Stop writes what the snapshot store holds: 30 s for a big view.
	stopCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return node.Stop(stopCtx)
}

func writeHeapProfile(path string, metrics prometheus.Gatherer) error {
	runtime.GC() // profile what is live, not what awaits collection
	// What the heap profile does not show of the process's RSS: stacks,
	// the heap's free spans not yet returned, the runtime's own. Read
	// first: the harness stops the fleet soon after it asks for these.
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	goroutines := runtime.NumGoroutine()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	mib := func(b uint64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
	summary := fmt.Sprintf("goroutines %d\nheap live %s\nheap in use %s\nheap idle, not returned %s\nstacks %s\nruntime (spans, GC, other) %s\nfrom the OS %s\n",
		goroutines, mib(m.HeapAlloc), mib(m.HeapInuse), mib(m.HeapIdle-m.HeapReleased), mib(m.StackSys),
		mib(m.MSpanSys+m.MCacheSys+m.GCSys+m.OtherSys+m.BuckHashSys), mib(m.Sys-m.HeapReleased))
	// And why Envoys' streams ended, if the relay ended them.
	var ends strings.Builder
	if mfs, err := metrics.Gather(); err == nil {
		for _, mf := range mfs {
			switch mf.GetName() {
			case "meshrelay_xds_stream_errors_total", "meshrelay_xds_streams_refused_total", "meshrelay_xds_streams_moved_total":
				for _, m := range mf.GetMetric() {
					var labels []string
					for _, l := range m.GetLabel() {
						labels = append(labels, l.GetName()+"="+l.GetValue())
					}
					fmt.Fprintf(&ends, "%s{%s} %.0f\n", mf.GetName(), strings.Join(labels, ","), m.GetCounter().GetValue())
				}
			}
		}
	}
	return os.WriteFile(strings.TrimSuffix(path, ".pprof")+".mem.txt", []byte(summary+ends.String()), 0o644)
}

// waitForFile waits until path exists, for at most d.
func waitForFile(ctx context.Context, path string, d time.Duration) {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if !traffic.SleepCtx(ctx, 50*time.Millisecond) {
			return
		}
	}
}

// StartRelayFunc starts a relay for cfg in a process of its own and
// returns it once it accepts connections. The caller must Stop it.
type StartRelayFunc func(ctx context.Context, cfg RelayChildConfig) (*Child, error)

// ExecRelay returns a StartRelayFunc that runs path with args followed by
// cfg.Args(); cmd/loadtest passes its own executable and "relay-child".
// The child's stderr goes to stderr (nil: discarded).
func ExecRelay(path string, stderr io.Writer, args ...string) StartRelayFunc {
	return func(ctx context.Context, cfg RelayChildConfig) (*Child, error) {
		return StartChild(ctx, ChildConfig{
			Path:   path,
			Args:   append(append([]string(nil), args...), cfg.Args()...),
			Stderr: stderr,
			CPUs:   cfg.CPUs,
			// A relay with snapshots reports ready once it restored them.
			ReadyTimeout: 5 * time.Minute,
		})
	}
}

// FanoutTargets are the goals a fanout run is judged against.
type FanoutTargets struct {
	// ChangeP99 bounds the relayed P99, over changes, of the time until
	// every Envoy has ACKed a change. Default 300ms.
	ChangeP99 time.Duration
	// RelayPeakRSS bounds the relay process's peak RSS, in bytes. Default
	// 1 GiB.
	RelayPeakRSS uint64
}

// FanoutConfig configures RunFanout. Start from DefaultFanoutConfig.
type FanoutConfig struct {
	// Scenario is the upstream's configuration.
	Scenario upstream.Scenario
	// Envoys is the number of simulated Envoys. Default 5,000.
	Envoys int
	// Keys is the number of aggregation keys they spread over. Default 50.
	Keys int
	// Changes is the number of endpoint changes timed, one after another,
	// each after the previous one reached every Envoy (or timed out).
	// Default 20.
	Changes int
	// Protocols are the Envoys' ADS variants, each run in every mode.
	// Default delta, sotw.
	Protocols []envoy.Protocol
	// Modes are run in order for each protocol. Default direct, relayed.
	Modes []FanoutMode
	// UpstreamProtocol is the relay's ADS variant to the upstream. Empty
	// means the same as the Envoys'.
	UpstreamProtocol relay.Protocol
	// EnvoysPerConn is how many Envoys share a gRPC connection. Default 1:
	// real Envoys each have their own, and a shared connection would
	// serialise their pushes behind one HTTP/2 flow-control window and
	// hide the relay's per-connection memory.
	EnvoysPerConn int
	// StartRate is Envoys connecting per second. Default 1,000: a 5 s ramp
	// for 5,000 Envoys. istiod admits about 25/s on 2 cores, which would
	// make each run's start 200 s; the targets are measured on changes
	// after every Envoy has synced, so the ramp only shapes the initial
	// sync figure. 0 connects all at once (a reconnect storm).
	StartRate float64
	// SyncTimeout bounds the initial sync. Default 30m (5,000 Envoys on 2
	// cores take about 10).
	SyncTimeout time.Duration
	// ChangeTimeout bounds the wait for one change to reach every Envoy;
	// past it the change counts as timed out and the next one starts.
	// Default 2m: go-control-plane's SotW server takes tens of seconds per
	// change at 5,000 direct Envoys on 2 cores.
	ChangeTimeout time.Duration
	// ChangeGap is the pause between one change completing and the next,
	// so that the trailing work of one (ACK bookkeeping) does not delay
	// the next. Default 100ms.
	ChangeGap time.Duration
	// Settle is the pause after stopping one run (and collecting garbage)
	// before the next starts, and after the initial sync before the first
	// change. Default 2s.
	Settle time.Duration
	// Seed picks the endpoints that move; every run of a protocol moves the
	// same ones in the same order.
	Seed int64
	// StartRelay starts the relay child. Required if Modes has Relayed.
	StartRelay StartRelayFunc
	// FleetCommand, if set, runs each run's fleet in a child process of
	// its own (StartFleetProcess), so that the Envoys' CPU is neither the
	// relay's nor this process's and can be pinned apart; nil runs the
	// fleet in this process. cmd/loadtest sets it unless
	// --fleet-process=false.
	FleetCommand FleetCommand
	// FleetStderr receives the fleet child's stderr. Nil: discarded.
	FleetStderr io.Writer
	// RelayCPUs and FleetCPUs, if set, pin the relay child and the fleet
	// child to these CPUs from their start (Linux); this process, with
	// the synthetic upstream and the Tracker, is not pinned. FleetCPUs
	// needs FleetCommand. Default: not pinned.
	RelayCPUs, FleetCPUs CPUSet
	// RelayProfile, if set, is a path prefix: each relayed run's child
	// writes a CPU profile of its change phase to
	// <prefix>-<protocol>.cpu.pprof and a heap profile at its end to
	// <prefix>-<protocol>.heap.pprof, with <prefix>-<protocol>.heap.mem.txt.
	RelayProfile string
	// CPUProfile, if set, is a path prefix: this process's CPU profile of
	// each run's change phase goes to <prefix>-<protocol>-<mode>.cpu.pprof.
	CPUProfile string
	// Targets are printed next to the results. Defaults as documented on
	// FanoutTargets.
	Targets FanoutTargets
	// TLS says how relayed runs reach the relay: off (its plaintext port;
	// the default), on (its TLS port: each Envoy on a TLS connection of
	// its own, presenting the token of its namespace and service account,
	// one token per key), or compare (each relayed run on plaintext, then
	// on TLS). Direct runs are always plaintext (the synthetic upstream
	// has no TLS port).
	TLS TLSMode
	// TLSVerifiers are the relay's token verifiers, one TLS run each.
	// Default local.
	TLSVerifiers []Verifier
	// TokenReviewLatency is how long the fake Kubernetes API takes to
	// answer a TokenReview (tokenreview verifier). Default 2ms.
	TokenReviewLatency time.Duration
	// AdmitStreams is the size of the connect storm (RunAdmission) every
	// relayed run ends with when TLS is not off: new Envoys, each on a
	// connection of its own, timed until each is admitted and answered.
	// Default 1,000; 0: none.
	AdmitStreams int
	// AdmitConcurrency is how many of them connect at once. Default 32.
	AdmitConcurrency int
}

// DefaultFanoutConfig is the scenario of issue 2: 1,000 services and 1,000
// endpoints over 10 namespaces, 5,000 Envoys over 50 keys, Delta and SotW,
// direct and relayed.
func DefaultFanoutConfig() FanoutConfig {
	sc := upstream.DefaultScenario()
	sc.Services, sc.Endpoints, sc.Namespaces = 1000, 1000, 10
	return FanoutConfig{
		Scenario:      sc,
		Envoys:        5000,
		Keys:          50,
		Changes:       20,
		Protocols:     []envoy.Protocol{envoy.Delta, envoy.SotW},
		Modes:         []FanoutMode{Direct, Relayed},
		EnvoysPerConn: 1,
		StartRate:     1000,
		SyncTimeout:   30 * time.Minute,
		ChangeTimeout: 2 * time.Minute,
		ChangeGap:     100 * time.Millisecond,
		Settle:        2 * time.Second,
		Seed:          1,
		Targets:       FanoutTargets{ChangeP99: 300 * time.Millisecond, RelayPeakRSS: 1 << 30},
		TLS:           TLSOff,
		TLSVerifiers:  []Verifier{VerifierLocal},

		TokenReviewLatency: 2 * time.Millisecond,
		AdmitStreams:       1000,
		AdmitConcurrency:   32,
	}
}

func (c *FanoutConfig) validate() error {
	d := DefaultFanoutConfig()
	if len(c.Protocols) == 0 {
		c.Protocols = d.Protocols
	}
	if len(c.Modes) == 0 {
		c.Modes = d.Modes
	}
	if c.EnvoysPerConn == 0 {
		c.EnvoysPerConn = 1
	}
	if c.SyncTimeout == 0 {
		c.SyncTimeout = d.SyncTimeout
	}
	if c.ChangeTimeout == 0 {
		c.ChangeTimeout = d.ChangeTimeout
	}
	if c.Targets.ChangeP99 == 0 {
		c.Targets.ChangeP99 = d.Targets.ChangeP99
	}
	if c.Targets.RelayPeakRSS == 0 {
		c.Targets.RelayPeakRSS = d.Targets.RelayPeakRSS
	}
	if c.TLS == "" {
		c.TLS = TLSOff
	}
	if len(c.TLSVerifiers) == 0 {
		c.TLSVerifiers = d.TLSVerifiers
	}
	if c.AdmitConcurrency == 0 {
		c.AdmitConcurrency = d.AdmitConcurrency
	}
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf("loadtest: "+format, args...)) }
	if c.Envoys <= 0 || c.Keys <= 0 || c.Changes <= 0 {
		bad("fields Envoys, Keys and Changes must be > 0, got %d, %d, %d", c.Envoys, c.Keys, c.Changes)
	}
	if c.EnvoysPerConn < 0 || c.StartRate < 0 || c.ChangeGap < 0 || c.Settle < 0 || c.SyncTimeout < 0 || c.ChangeTimeout < 0 {
		bad("fields EnvoysPerConn, StartRate, ChangeGap, Settle and the timeouts must not be negative")
	}
	if c.TokenReviewLatency < 0 || c.AdmitStreams < 0 || c.AdmitConcurrency < 0 {
		bad("fields TokenReviewLatency, AdmitStreams and AdmitConcurrency must not be negative")
	}
	if _, err := ParseTLSMode(string(c.TLS)); err != nil {
		errs = append(errs, err)
	}
	for _, v := range c.TLSVerifiers {
		if _, err := ParseVerifier(string(v)); err != nil {
			errs = append(errs, err)
		}
	}
	for _, m := range c.Modes {
		if _, err := ParseFanoutMode(string(m)); err != nil {
			errs = append(errs, err)
		}
		if m == Relayed && c.StartRelay == nil {
			bad("field StartRelay is nil but Modes has relayed")
		}
	}
	if c.UpstreamProtocol != "" {
		if _, err := relay.ParseProtocol(string(c.UpstreamProtocol)); err != nil {
			errs = append(errs, err)
		}
	}
	if len(c.FleetCPUs) > 0 && c.FleetCommand == nil {
		bad("field FleetCPUs needs a fleet in a child process (FleetCommand)")
	}
	for _, err := range []error{CheckCPUs("field RelayCPUs", c.RelayCPUs), CheckCPUs("field FleetCPUs", c.FleetCPUs)} {
		if err != nil {
			bad("%w", err)
		}
	}
	if c.Scenario.Namespaces <= 0 || c.Scenario.Services <= 0 {
		bad("the scenario needs services and namespaces")
	} else if len(movable(c.Scenario)) == 0 {
		bad("no endpoint backs a service every namespace sees (raise Endpoints or lower LocalFraction)")
	}
	return errors.Join(errs...)
}

// runTransport is how one run's Envoys reach the relay.
type runTransport struct {
	tls      bool
	verifier Verifier
}

func (t runTransport) String() string { return transportName(t.tls, t.verifier) }

// transports lists the relayed runs of one protocol, in order.
func (c *FanoutConfig) transports() []runTransport {
	var out []runTransport
	if c.TLS != TLSOn {
		out = append(out, runTransport{})
	}
	if c.TLS != TLSOff {
		for _, v := range c.TLSVerifiers {
			out = append(out, runTransport{tls: true, verifier: v})
		}
	}
	return out
}

// movable lists the endpoints whose service every namespace sees: moving
// one changes the config of every Envoy.
func movable(sc upstream.Scenario) []int {
	var out []int
	for j := range sc.Endpoints {
		if !sc.IsLocal(j % sc.Services) {
			out = append(out, j)
		}
	}
	return out
}

// FanoutReport is what RunFanout measured. Durations are in milliseconds or
// seconds, sizes in bytes, as the JSON names say.
type FanoutReport struct {
	Date     string           `json:"date"`
	Machine  report.Machine   `json:"machine"`
	Scenario FanoutSummary    `json:"scenario"`
	Pinning  report.Pinning   `json:"pinning"`
	Runs     []FanoutRun      `json:"runs"`
	Verdicts []report.Verdict `json:"verdicts"`
}

// FanoutSummary is the configuration a report was measured with.
type FanoutSummary struct {
	Services      int     `json:"services"`
	Endpoints     int     `json:"endpoints"`
	Namespaces    int     `json:"namespaces"`
	LocalFraction float64 `json:"local_fraction"`
	Envoys        int     `json:"envoys"`
	Keys          int     `json:"keys"`
	Changes       int     `json:"changes"`
	EnvoysPerConn int     `json:"envoys_per_conn"`
	StartRate     float64 `json:"start_rate"`
	ChangeGapMs   float64 `json:"change_gap_ms"`
	TargetP99Ms   float64 `json:"target_change_p99_ms"`
	TargetRSS     uint64  `json:"target_relay_peak_rss_bytes"`
	// TLS is the --tls mode; TokenReviewLatencyMs the fake Kubernetes
	// API's answer time (tokenreview runs).
	TLS                  TLSMode `json:"tls"`
	TokenReviewLatencyMs float64 `json:"tokenreview_latency_ms,omitempty"`
}

// FanoutRun is one protocol in one mode.
type FanoutRun struct {
	Protocol         string     `json:"protocol"`
	Mode             FanoutMode `json:"mode"`
	UpstreamProtocol string     `json:"upstream_protocol,omitempty"`
	// Transport is how the Envoys reached the relay: plaintext,
	// tls-local or tls-tokenreview ("" direct).
	Transport string `json:"transport,omitempty"`

	// FleetStartS is how long StartFleet took (the paced ramp);
	// InitialSyncS is from its call until every Envoy held its full config
	// (checked every 200 ms).
	FleetStartS  float64 `json:"fleet_start_s"`
	InitialSyncS float64 `json:"initial_sync_s"`
	Synced       bool    `json:"synced"`

	// ACK is the latency from the upstream publishing a change to each
	// Envoy's ACK of it, over every (change, Envoy) pair; Complete is, per
	// change, until the last Envoy ACKed.
	ACK             report.LatencyMs `json:"ack"`
	Complete        report.LatencyMs `json:"complete"`
	ChangesTimedOut int              `json:"changes_timed_out"`
	ChangesDone     int              `json:"changes_done"`

	// UpstreamStreams: once every Envoy synced (settled) and at the end.
	report.UpstreamStreams

	UpstreamBytesSync    uint64 `json:"upstream_bytes_sync"`
	UpstreamBytesChanges uint64 `json:"upstream_bytes_changes"`
	EnvoyBytesSync       uint64 `json:"envoy_bytes_sync"`
	EnvoyBytesChanges    uint64 `json:"envoy_bytes_changes"`

	// Loadtest is this process: the upstream, the Tracker and, unless
	// the fleet runs in a child (Fleet), every Envoy.
	Loadtest report.Process `json:"loadtest_process"`
	// Relay is the relay child process (relayed mode only).
	Relay *report.Process `json:"relay_process,omitempty"`
	// Fleet is the fleet child process, when the fleet runs in one.
	Fleet *report.Process `json:"fleet_process,omitempty"`

	// RelayCPUPerChangeEnvoyUs is the relay's CPU over the changes per
	// change made per Envoy, in µs; RelayCPUPerMBSyncMs and
	// RelayCPUPerMBChangesMs its CPU per MB (10^6 bytes) the Envoys
	// received, in ms, over the sync and over the changes. They compare
	// runs of different sizes, and on machines of different loads better
	// than latencies do. Relayed runs only.
	RelayCPUPerChangeEnvoyUs float64 `json:"relay_cpu_per_change_per_envoy_us,omitempty"`
	RelayCPUPerMBSyncMs      float64 `json:"relay_cpu_ms_per_mb_sync,omitempty"`
	RelayCPUPerMBChangesMs   float64 `json:"relay_cpu_ms_per_mb_changes,omitempty"`

	// Health: the Envoys' stream reconnects and protocol violations.
	report.Health
	Error string `json:"error,omitempty"`

	// Refused counts Envoys whose last stream the relay refused
	// (Unauthenticated, PermissionDenied) when the run ended.
	Refused int `json:"envoys_refused,omitempty"`
	// Tokens is the distinct service-account tokens the fleet presented
	// (TLS runs); TokenReviews the reviews the fake Kubernetes API
	// answered (tls-tokenreview runs).
	Tokens       int `json:"tokens,omitempty"`
	TokenReviews int `json:"token_reviews,omitempty"`
	// Admission is the connect storm the run ended with (relayed runs,
	// when TLS is not off).
	Admission *AdmissionFigures `json:"admission,omitempty"`
}

// childCPUs reads what report.Process.CPUs says of pid, or why it could not.
func childCPUs(pid int) string {
	s, err := ProcessCPUs(pid)
	if err != nil {
		return "unknown: " + err.Error()
	}
	return s.String()
}

// RunFanout runs, for each protocol, the same scenario in each mode, one
// after the other: start a synthetic upstream (and, relayed, a relay child
// process in front of it), connect the fleet, wait until every Envoy is
// synced, then move cfg.Changes endpoints one at a time and time each until
// every Envoy ACKed it. Between runs everything is stopped and garbage
// collected. It prints progress and then the results table to out, and
// returns the report. A run that fails (a sync timeout) is recorded with
// its error and the next run goes on; the error returned then names it.
// ctx ends the whole benchmark (everything is stopped before it returns).
func RunFanout(ctx context.Context, cfg FanoutConfig, out io.Writer) (*FanoutReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	rep := &FanoutReport{
		Date:    time.Now().UTC().Format(time.RFC3339),
		Machine: report.ThisMachine(),
		Scenario: FanoutSummary{
			Services: cfg.Scenario.Services, Endpoints: cfg.Scenario.Endpoints,
			Namespaces: cfg.Scenario.Namespaces, LocalFraction: cfg.Scenario.LocalFraction,
			Envoys: cfg.Envoys, Keys: cfg.Keys, Changes: cfg.Changes,
			EnvoysPerConn: cfg.EnvoysPerConn, StartRate: cfg.StartRate,
			ChangeGapMs: float64(cfg.ChangeGap) / float64(time.Millisecond),
			TargetP99Ms: float64(cfg.Targets.ChangeP99) / float64(time.Millisecond),
			TargetRSS:   cfg.Targets.RelayPeakRSS,
			TLS:         cfg.TLS,
		},
		Pinning: report.Pinning{
			FleetProcess: cfg.FleetCommand != nil,
			RelayCPUs:    cfg.RelayCPUs.String(), FleetCPUs: cfg.FleetCPUs.String(),
		},
	}
	if all, err := AllowedCPUs(); err == nil {
		rep.Pinning.LoadtestCPUs = all.String()
	}
	var creds *MeshCredentials
	if cfg.TLS != TLSOff && slices.Contains(cfg.Modes, Relayed) {
		dir, err := os.MkdirTemp("", "loadtest-tls-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
		if creds, err = NewMeshCredentials(dir); err != nil {
			return nil, err
		}
		if slices.Contains(cfg.TLSVerifiers, VerifierTokenReview) {
			rep.Scenario.TokenReviewLatencyMs = float64(cfg.TokenReviewLatency) / float64(time.Millisecond)
		}
	}
	var errs []error
	first := true
	for _, p := range cfg.Protocols {
		for _, m := range cfg.Modes {
			transports := []runTransport{{}}
			if m == Relayed {
				transports = cfg.transports()
			}
			for _, tr := range transports {
				if ctx.Err() != nil {
					break
				}
				if !first && !traffic.SleepCtx(ctx, cfg.Settle) {
					break
				}
				first = false
				run := runFanoutOnce(ctx, cfg, p, m, tr, creds, out)
				rep.Runs = append(rep.Runs, run)
				if run.Error != "" {
					errs = append(errs, fmt.Errorf("%s %s: %s", p, runLabel(&run), run.Error))
				}
				// Let this run's memory go before the next one measures.
				runtime.GC()
				debug.FreeOSMemory()
			}
		}
	}
	rep.Verdicts = verdicts(cfg, rep.Runs)
	PrintFanout(out, rep)
	if ctx.Err() != nil {
		errs = append(errs, ctx.Err())
	}
	return rep, errors.Join(errs...)
}

// stopTimeout bounds each Stop at the end of a run: a child still there
// then is killed. A variable so that a test of a hung child need not wait
// this long.
var stopTimeout = 30 * time.Second

// stopContext is the context of a Stop at the end of a run: it outlives
// ctx (an interrupted run still stops what it started, in order) and ends
// stopTimeout from now.
func stopContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
}

// runLabel names a run's column: its mode, and its transport if not
// plaintext.
func runLabel(r *FanoutRun) string {
	if r.Transport == "" || r.Transport == "plaintext" {
		return string(r.Mode)
	}
	return string(r.Mode) + " " + r.Transport
}

// runFanoutOnce runs one protocol in one mode over one transport and stops
// everything it started before it returns.
func runFanoutOnce(ctx context.Context, cfg FanoutConfig, p envoy.Protocol, mode FanoutMode, tr runTransport, creds *MeshCredentials, out io.Writer) (run FanoutRun) {
	run = FanoutRun{Protocol: p.String(), Mode: mode}
	if mode == Relayed {
		run.Transport = tr.String()
	}
	tag := fmt.Sprintf("%s %s", p, runLabel(&run))
	fail := func(err error) FanoutRun {
		run.Error = err.Error()
		fmt.Fprintf(out, "%s: %v\n", tag, err)
		return run
	}
	self := os.Getpid()
	resetPeakRSS(self)

	// The upstream hands each change to the tracker before any Envoy can
	// see it, so no early ACK is missed.
	tracker := traffic.NewTracker()
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = cfg.Scenario
	ucfg.OnPublish = func(c upstream.Change) { tracker.Track(c) }
	up, err := upstream.Start(ctx, ucfg)
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
	var kube *FakeKubeAPI
	// profilePrefix names this run's relay profiles.
	profilePrefix := fmt.Sprintf("%s-%s", cfg.RelayProfile, p)
	if tr.tls {
		profilePrefix += "-" + tr.String()
	}
	if mode == Relayed {
		rc := RelayChildConfig{Upstream: up.Addr(), UpstreamProtocol: cfg.UpstreamProtocol, CPUs: cfg.RelayCPUs}
		if rc.UpstreamProtocol == "" {
			rc.UpstreamProtocol = relay.Protocol(p.String())
		}
		if cfg.RelayProfile != "" {
			rc.CPUProfile = profilePrefix + ".cpu.pprof"
			rc.HeapProfile = profilePrefix + ".heap.pprof"
		}
		if tr.tls {
			reviewURL := ""
			if tr.verifier == VerifierTokenReview {
				if kube, err = creds.StartTokenReview(cfg.TokenReviewLatency); err != nil {
					return fail(fmt.Errorf("start the fake Kubernetes API: %w", err))
				}
				defer kube.Stop()
				reviewURL = kube.URL()
			}
			rc.TLS = creds.RelayTLS(tr.verifier, reviewURL)
		}
		run.UpstreamProtocol = string(rc.UpstreamProtocol)
		child, err = cfg.StartRelay(ctx, rc)
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
		run.Relay = &report.Process{CPUProfile: rc.CPUProfile, Pid: child.Pid(), CPUs: childCPUs(child.Pid())}
		fmt.Fprintf(out, "%s: relay pid %d at %s (upstream protocol %s), CPUs %s\n", tag, child.Pid(), target, rc.UpstreamProtocol, run.Relay.CPUs)
	}
	procs := &procMeter{}
	procs.add(func() (ProcStat, error) { return ReadProcStat(self) }, &run.Loadtest)
	if child != nil {
		procs.add(child.Stat, run.Relay)
	}
	// profile has the relay child profile a phase of this run, if asked.
	profile := func(phase string) (stop func()) {
		if child == nil || cfg.RelayProfile == "" {
			return func() {}
		}
		_ = child.Send(childProfileStart + " " + profilePrefix + "." + phase + ".cpu.pprof")
		return func() { _ = child.Send(childProfileStop) }
	}

	fmt.Fprintf(out, "%s: starting %d Envoys at %s (%.0f/s, %d per connection)\n", tag, cfg.Envoys, target, cfg.StartRate, cfg.EnvoysPerConn)
	stopConnectProfile := profile("connect")
	spec := fleetSpec{
		fleet: FleetChildConfig{
			Scenario: cfg.Scenario, Envoys: cfg.Envoys, Keys: cfg.Keys, Protocol: p.String(),
			Target: target, EnvoysPerConn: cfg.EnvoysPerConn, StartRate: cfg.StartRate,
		},
		command: cfg.FleetCommand, cpus: cfg.FleetCPUs, stderr: cfg.FleetStderr, tracker: tracker,
		started: func(fp *FleetProcess) {
			run.Fleet = &report.Process{Pid: fp.Pid(), CPUs: childCPUs(fp.Pid())}
			procs.add(fp.Stat, run.Fleet)
		},
	}
	if tr.tls {
		spec.creds = creds
	}
	fleet, start, err := startBenchFleet(ctx, spec)
	if fleet != nil {
		defer func() {
			sctx, cancel := stopContext(ctx)
			defer cancel()
			if err := fleet.Stop(sctx); err != nil {
				fmt.Fprintf(out, "%s: stop fleet: %v\n", tag, err)
			}
		}()
	}
	if err != nil {
		stopConnectProfile()
		return fail(fmt.Errorf("start fleet: %w", err))
	}
	run.FleetStartS = time.Since(start).Seconds()
	if run.Fleet != nil {
		fmt.Fprintf(out, "%s: fleet pid %d, CPUs %s\n", tag, fleet.(*FleetProcess).Pid(), run.Fleet.CPUs)
	}

	syncCtx, cancel := context.WithTimeout(ctx, cfg.SyncTimeout)
	err = waitSyncedReporting(syncCtx, fleet, up, start, out, tag)
	cancel()
	stopConnectProfile()
	run.InitialSyncS = time.Since(start).Seconds()
	run.UpstreamStreams.AfterSync = settledStreams(ctx, up)
	run.UpstreamBytesSync = up.Stats().BytesSent
	fig, figErr := fleet.Figures(ctx)
	run.EnvoyBytesSync = fig.BytesReceived
	procs.mark(phaseSync)
	if err == nil {
		err = figErr
	}
	if err != nil {
		run.UpstreamStreams.AtEnd = run.UpstreamStreams.AfterSync
		run.recordFleet(fig)
		procs.mark(phaseEnd)
		return fail(fmt.Errorf("initial sync: %w", err))
	}
	run.Synced = true
	fmt.Fprintf(out, "%s: %d Envoys synced in %.1fs; upstream streams %d\n", tag, cfg.Envoys, run.InitialSyncS, run.UpstreamStreams.AfterSync)

	// The initial sync leaves garbage in this process; collect it before
	// timing, so both modes start the changes from the same footing.
	runtime.GC()
	if !traffic.SleepCtx(ctx, cfg.Settle) {
		return fail(ctx.Err())
	}
	tracker.Reset()
	// From here a fleet child streams every ACK that can time a change.
	if err := fleet.Track(ctx, up.Generation()); err != nil {
		return fail(err)
	}
	if fig, err = fleet.Figures(ctx); err != nil {
		return fail(err)
	}
	upBytes, envoyBytes := up.Stats().BytesSent, fig.BytesReceived
	procs.mark(phaseChangesStart)
	memFile := profilePrefix + ".heap.mem.txt" // the child's, written last
	if child != nil && cfg.RelayProfile != "" {
		_ = os.Remove(memFile)
		_ = child.Send(childProfileStart)
	}
	stopProfile := startCPUProfile(cfg.CPUProfile, p, mode, out)
	stopFleetProfile := profileFleet(ctx, fleet, cfg.CPUProfile, p, mode, out)

	err = moveEndpoints(ctx, cfg, up, tracker, out, tag, &run)

	stopFleetProfile()
	stopProfile()
	procs.mark(phaseEnd) // before the child writes its profiles
	if child != nil && cfg.RelayProfile != "" {
		_ = child.Send(childProfileStop)
		// Its memory figures count the Envoys' streams: the fleet stops
		// only once they are written.
		waitForFile(ctx, memFile, time.Minute)
	}
	run.UpstreamBytesChanges = up.Stats().BytesSent - upBytes
	fig, figErr = fleet.Figures(ctx)
	run.EnvoyBytesChanges = fig.BytesReceived - envoyBytes
	run.UpstreamStreams.AtEnd = up.Stats().OpenStreams
	perEnvoy, complete, timedOut := tracker.Results()
	run.ACK, run.Complete = perEnvoy.Ms(), complete.Ms()
	run.ChangesTimedOut = timedOut
	run.recordFleet(fig)
	run.relayCPUPer(cfg.Envoys)
	if fp, ok := fleet.(*FleetProcess); ok && err == nil {
		err = fp.Err()
	}
	if err == nil {
		err = figErr
	}
	if err != nil {
		return fail(err)
	}
	fmt.Fprintf(out, "%s: %d changes, %d timed out; change→all P99 %s\n", tag, cfg.Changes, timedOut, report.MS(complete.P99))

	if mode == Relayed && cfg.TLS != TLSOff && cfg.AdmitStreams > 0 {
		acfg := AdmissionConfig{
			Target: target, Scenario: cfg.Scenario, Keys: cfg.Keys,
			FirstPod: cfg.Envoys/cfg.Keys + 1, Names: firstClusters(up),
			Streams: cfg.AdmitStreams, Concurrency: cfg.AdmitConcurrency, Stat: child.Stat,
		}
		if tr.tls {
			acfg.Creds = creds
		}
		runtime.GC()
		stopProfile := profile("admission")
		a := RunAdmission(ctx, acfg)
		stopProfile()
		run.Admission = &a
		fmt.Fprintf(out, "%s: connect storm: %d of %d streams admitted in %.2fs (%.0f/s, %d at once); relay CPU %.2fs (%.2fs per 1,000); dial → answer P50 %s P99 %s\n",
			tag, a.Admitted, a.Streams, a.WallS, a.RatePerS, a.Concurrency, a.RelayCPUS, a.RelayCPUPer1000S, fmtMs(a.Latency.P50), fmtMs(a.Latency.P99))
		if a.Err != "" {
			return fail(fmt.Errorf("connect storm: %s", a.Err))
		}
	}
	if kube != nil {
		run.TokenReviews = kube.Requests()
		if err := kube.Err(); err != nil {
			return fail(err)
		}
	}
	return run
}

// startCPUProfile profiles this process to <prefix>-<p>-<mode>.cpu.pprof
// until the returned func is called; a no-op without a prefix.
func startCPUProfile(prefix string, p envoy.Protocol, mode FanoutMode, out io.Writer) func() {
	if prefix == "" {
		return func() {}
	}
	stop, err := ProfileCPU(fmt.Sprintf("%s-%s-%s.cpu.pprof", prefix, p, mode))
	if err != nil {
		fmt.Fprintf(out, "cpuprofile: %v\n", err)
		return func() {}
	}
	return func() {
		if err := stop(); err != nil {
			fmt.Fprintf(out, "cpuprofile: %v\n", err)
		}
	}
}

func (run *FanoutRun) recordFleet(fig traffic.FleetFigures) {
	run.Health, run.Refused = fig.Health(), fig.Refused
	if fig.Tokens > 0 {
		run.Tokens = fig.Tokens
	}
}

// relayCPUPer derives the relay's CPU per change per Envoy and per MB
// sent from the figures of a relayed run.
func (run *FanoutRun) relayCPUPer(envoys int) {
	r := run.Relay
	if r == nil || r.Err != "" {
		return
	}
	if changes := run.ChangesDone + run.ChangesTimedOut; changes > 0 && envoys > 0 {
		run.RelayCPUPerChangeEnvoyUs = r.CPUChangesS / float64(changes) / float64(envoys) * 1e6
	}
	if run.EnvoyBytesSync > 0 {
		run.RelayCPUPerMBSyncMs = r.CPUSyncS * 1e3 / (float64(run.EnvoyBytesSync) / 1e6)
	}
	if run.EnvoyBytesChanges > 0 {
		run.RelayCPUPerMBChangesMs = r.CPUChangesS * 1e3 / (float64(run.EnvoyBytesChanges) / 1e6)
	}
}

// profileFleet has a fleet child profile the change phase into
// <prefix>-<p>-<mode>-fleet.cpu.pprof until the returned func is called; a
// no-op without a prefix or a child.
func profileFleet(ctx context.Context, f benchFleet, prefix string, p envoy.Protocol, mode FanoutMode, out io.Writer) func() {
	fp, ok := f.(*FleetProcess)
	if !ok || prefix == "" {
		return func() {}
	}
	if err := fp.Profile(ctx, fmt.Sprintf("%s-%s-%s-fleet.cpu.pprof", prefix, p, mode)); err != nil {
		fmt.Fprintf(out, "cpuprofile: %v\n", err)
		return func() {}
	}
	return func() {
		if err := fp.StopProfile(ctx); err != nil {
			fmt.Fprintf(out, "cpuprofile: %v\n", err)
		}
	}
}

// waitSyncedReporting waits for the fleet to sync, printing progress every
// 10 s.
func waitSyncedReporting(ctx context.Context, f benchFleet, up *upstream.Upstream, start time.Time, out io.Writer, tag string) error {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(10 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				fig, err := f.Figures(ctx)
				if err != nil {
					continue
				}
				fmt.Fprintf(out, "%s: %s: %d Envoys connected, upstream streams %d, waiting for sync\n",
					tag, time.Since(start).Round(time.Second), fig.Connected, up.Stats().OpenStreams)
			}
		}
	}()
	err := f.WaitSynced(ctx, up)
	close(done)
	wg.Wait()
	return err
}

// moveEndpoints moves cfg.Changes endpoints of services every namespace
// sees, one at a time, each after the previous one reached every Envoy or
// timed out.
func moveEndpoints(ctx context.Context, cfg FanoutConfig, up *upstream.Upstream, tracker *traffic.Tracker, out io.Writer, tag string, run *FanoutRun) error {
	cands := movable(cfg.Scenario)
	rng := rand.New(rand.NewPCG(uint64(cfg.Seed), 0x66616e6f7574)) // same sequence in every mode
	timer := time.NewTimer(cfg.ChangeTimeout)
	defer timer.Stop()
	for i := range cfg.Changes {
		c, err := up.MoveEndpoint(cands[rng.IntN(len(cands))])
		if err != nil {
			return fmt.Errorf("change %d: %w", i, err)
		}
		done := tracker.Track(c) // the channel OnPublish's Track made
		timer.Reset(cfg.ChangeTimeout)
		select {
		case <-done:
			run.ChangesDone++
		case <-timer.C:
			tracker.Forget(time.Now())
			fmt.Fprintf(out, "%s: change %d (%s) did not reach every Envoy in %v\n", tag, i, c.Name, cfg.ChangeTimeout)
		case <-ctx.Done():
			tracker.Forget(time.Now())
			return ctx.Err()
		}
		timer.Stop()
		if !traffic.SleepCtx(ctx, cfg.ChangeGap) {
			return ctx.Err()
		}
	}
	return nil
}

type phase int

const (
	phaseSync phase = iota
	phaseChangesStart
	phaseEnd
)

// procMeter reads the CPU and memory of the processes of a run (this one,
// the relay child, the fleet child) at phase boundaries.
type procMeter struct{ procs []*meteredProc }

type meteredProc struct {
	stat func() (ProcStat, error)
	fig  *report.Process
	last ProcStat
	err  error
}

// add starts metering a process: its CPU time from now goes into fig.
func (m *procMeter) add(stat func() (ProcStat, error), fig *report.Process) {
	p := &meteredProc{stat: stat, fig: fig}
	p.last, p.err = stat()
	m.procs = append(m.procs, p)
}

func (m *procMeter) mark(ph phase) {
	for _, p := range m.procs {
		if p.err != nil {
			p.fig.Err = p.err.Error()
			continue
		}
		st, err := p.stat()
		if err != nil {
			p.err = err
			p.fig.Err = err.Error()
			continue
		}
		switch ph {
		case phaseSync:
			p.fig.CPUSyncS = (st.CPU - p.last.CPU).Seconds()
		case phaseEnd:
			p.fig.CPUChangesS = (st.CPU - p.last.CPU).Seconds()
		}
		p.fig.RSSEnd, p.fig.RSSPeak = st.RSS, st.PeakRSS
		p.last = st
	}
}

// resetPeakRSS resets the kernel's VmHWM of pid (Linux; best effort), so a
// run's peak is its own, not an earlier run's.
func resetPeakRSS(pid int) {
	_ = os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0)
}

// verdicts checks the relayed runs against the targets.
func verdicts(cfg FanoutConfig, runs []FanoutRun) []report.Verdict {
	var out []report.Verdict
	for _, r := range runs {
		if r.Mode != Relayed {
			continue
		}
		first := len(out)
		if !r.Synced {
			out = append(out, report.Verdict{Protocol: r.Protocol, Transport: r.Transport, Target: "run completed", Measured: r.Error})
			continue
		}

		out = append(out, report.Verdict{
			Protocol: r.Protocol,
			Target:   fmt.Sprintf("P99 change→all %d Envoys ≤ %s", cfg.Envoys, cfg.Targets.ChangeP99),
			Measured: fmt.Sprintf("%s (%d of %d changes reached all, per-Envoy ACK P99 %s)",
				fmtMs(r.Complete.P99), r.ChangesDone, cfg.Changes, fmtMs(r.ACK.P99)),
			Pass: r.ChangesTimedOut == 0 && r.ChangesDone == cfg.Changes &&
				r.Complete.P99 <= float64(cfg.Targets.ChangeP99)/float64(time.Millisecond),
		})
		out = append(out, report.Verdict{
			Protocol: r.Protocol,
			Target:   fmt.Sprintf("upstream streams = %d keys", cfg.Keys),
			Measured: fmt.Sprintf("%d after sync, %d at end", r.UpstreamStreams.AfterSync, r.UpstreamStreams.AtEnd),
			Pass:     r.UpstreamStreams.Are(cfg.Keys),
		})
		if r.Relay != nil {
			out = append(out, report.Verdict{
				Protocol: r.Protocol,
				Target:   fmt.Sprintf("relay peak RSS ≤ %s", fmtBytes(cfg.Targets.RelayPeakRSS)),
				Measured: fmtBytes(r.Relay.RSSPeak),
				Pass:     r.Relay.Err == "" && r.Relay.RSSPeak > 0 && r.Relay.RSSPeak <= cfg.Targets.RelayPeakRSS,
			})
		}
		out = append(out, report.Verdict{
			Protocol: r.Protocol,
			Target:   "no protocol violation",
			Measured: fmt.Sprintf("%d", r.Violations),
			Pass:     r.Violations == 0,
		})
		for i := first; i < len(out); i++ {
			out[i].Transport = r.Transport
		}
	}
	return out
}

// PrintFanout writes rep as a table per protocol (modes side by side, with
// relayed/direct ratios) and a verdict line per target.
func PrintFanout(out io.Writer, rep *FanoutReport) {
	sc := rep.Scenario
	fmt.Fprintf(out, "\nfanout: %d Envoys over %d keys; %d services, %d endpoints, %d namespaces (%.0f%% namespace-local); %d changes\n",
		sc.Envoys, sc.Keys, sc.Services, sc.Endpoints, sc.Namespaces, 100*sc.LocalFraction, sc.Changes)
	fmt.Fprintf(out, "machine: %s; %s\n", rep.Machine, rep.Date)
	fmt.Fprintf(out, "pinning: %s\n", rep.Pinning)
	var protos []string
	for _, r := range rep.Runs {
		if !slices.Contains(protos, r.Protocol) {
			protos = append(protos, r.Protocol)
		}
	}
	for _, p := range protos {
		t := newFanoutTable(rep.Runs, p)
		fmt.Fprintf(out, "\n%s\n", strings.ToUpper(p))
		t.line(out, "", runLabel, func(q fanoutRatio) string { return q.name })
		for _, row := range fanoutRows(t, sc.Envoys) {
			if !row.omit && (row.need == nil || t.any(row.need)) {
				t.line(out, row.label, row.cell, row.ratio)
			}
		}
		for _, r := range t.runs {
			if r.Admission != nil && len(r.Admission.Refused) > 0 {
				fmt.Fprintf(out, "  %s connect storm refused: %v\n", runLabel(r), r.Admission.Refused)
			}
		}
		for _, r := range t.runs {
			if r.Error != "" {
				fmt.Fprintf(out, "  %s error: %s\n", runLabel(r), r.Error)
			}
			for _, v := range r.ViolationSamples {
				fmt.Fprintf(out, "  %s violation: %s\n", runLabel(r), v)
			}
			for _, v := range r.ReconnectReasons {
				fmt.Fprintf(out, "  %s reconnected after: %s\n", runLabel(r), v)
			}
		}
	}
	if rep.Pinning.FleetProcess {
		fmt.Fprintf(out, "\n  loadtest process = the synthetic upstream and the tracker; fleet process = every simulated Envoy;\n")
	} else {
		fmt.Fprintf(out, "\n  loadtest process = the synthetic upstream and every simulated Envoy (in both modes);\n")
	}
	fmt.Fprintf(out, "  relay process = the relay alone. Latencies run from the upstream publishing a change.\n")
	fmt.Fprintf(out, "  Relay CPU per change per Envoy = its CPU over the changes / changes / Envoys; per MB = per 10^6 bytes the Envoys received.\n")
	if sc.TLS != "" && sc.TLS != TLSOff {
		fmt.Fprintf(out, "  tls-*: each Envoy on a TLS connection of its own (full handshake, ECDSA P-256 certificate) with its\n")
		fmt.Fprintf(out, "  service account's RS256 token, checked by the relay's local verifier or by TokenReview (a fake\n")
		fmt.Fprintf(out, "  Kubernetes API in the loadtest process answering in %.1f ms, verdicts cached). Connect storm: new\n", sc.TokenReviewLatencyMs)
		fmt.Fprintf(out, "  streams after the changes (keys warm), each asking for one cluster; its loadtest CPU is the client side.\n")
	}
	if len(rep.Verdicts) > 0 {
		fmt.Fprintf(out, "\ntargets (relayed):\n")
	}
	for _, v := range rep.Verdicts {
		run := v.Protocol
		if v.Transport != "" && v.Transport != "plaintext" {
			run += " " + v.Transport
		}
		fmt.Fprintf(out, "  %s  %-21s %-36s measured %s\n", report.Judge(v.Pass), run, v.Target, v.Measured)
	}
}

// fanoutTable is one protocol's table in PrintFanout: its runs in order,
// one column each, and the ratios after them: relayed (plaintext, else
// the first) over direct, and each TLS run over the plaintext relayed one.
type fanoutTable struct {
	runs    []*FanoutRun
	relayed *FanoutRun
	ratios  []fanoutRatio
}

// fanoutRatio is a ratio column: num's value over den's.
type fanoutRatio struct {
	name     string
	num, den *FanoutRun
}

func newFanoutTable(runs []FanoutRun, protocol string) *fanoutTable {
	t := &fanoutTable{}
	var direct *FanoutRun
	for i := range runs {
		r := &runs[i]
		if r.Protocol != protocol {
			continue
		}
		t.runs = append(t.runs, r)
		switch {
		case r.Mode == Direct:
			direct = r
		case t.relayed == nil || (r.Transport == "plaintext" && t.relayed.Transport != "plaintext"):
			t.relayed = r
		}
	}
	if direct != nil && t.relayed != nil {
		t.ratios = append(t.ratios, fanoutRatio{"rel/direct", t.relayed, direct})
	}
	if t.relayed != nil && t.relayed.Transport == "plaintext" {
		for _, r := range t.runs {
			if r.tls() {
				t.ratios = append(t.ratios, fanoutRatio{strings.TrimPrefix(r.Transport, "tls-") + "/plain", r, t.relayed})
			}
		}
	}
	return t
}

// any reports whether has holds for one of the table's runs.
func (t *fanoutTable) any(has func(*FanoutRun) bool) bool { return slices.ContainsFunc(t.runs, has) }

// tls reports whether the run's Envoys reached the relay over TLS.
func (r *FanoutRun) tls() bool { return strings.HasPrefix(r.Transport, "tls") }

// fanoutRow is a row of PrintFanout's tables: a run's cell and, if value
// is set, the ratios of its values. A row with need is shown only if a
// run of the table has need; omit leaves it out.
type fanoutRow struct {
	label string
	cell  func(*FanoutRun) string
	value func(*FanoutRun) float64
	need  func(*FanoutRun) bool
	omit  bool
}

// ratio is the row's cell of ratio q: "" without a value to compare or
// a denominator of 0.
func (row fanoutRow) ratio(q fanoutRatio) string {
	if row.value == nil || row.value(q.den) <= 0 {
		return ""
	}
	return fmt.Sprintf("%.3g×", row.value(q.num)/row.value(q.den))
}

// line writes a line of t: its label, each run's cell, each ratio's.
func (t *fanoutTable) line(out io.Writer, label string, cell func(*FanoutRun) string, ratio func(fanoutRatio) string) {
	fmt.Fprintf(out, "  %-40s", label)
	for _, r := range t.runs {
		fmt.Fprintf(out, " %24s", cell(r))
	}
	for _, q := range t.ratios {
		fmt.Fprintf(out, " %16s", ratio(q))
	}
	fmt.Fprintln(out)
}

// fanoutRows are the rows of t, a fanout of envoys Envoys, in order.
func fanoutRows(t *fanoutTable, envoys int) []fanoutRow {
	sec := func(v float64) string { return fmt.Sprintf("%.2fs", v) }
	relay := func(r *FanoutRun) *report.Process { return r.Relay }
	fleet := func(r *FanoutRun) *report.Process { return r.Fleet }
	relayPer := func(label, format string, v func(*FanoutRun) float64) fanoutRow {
		return fanoutRow{label: label, cell: func(r *FanoutRun) string {
			if r.Relay == nil || r.Relay.Err != "" || v(r) == 0 {
				return "-"
			}
			return fmt.Sprintf(format, v(r))
		}}
	}
	bytes := func(label string, v func(*FanoutRun) uint64) fanoutRow {
		return fanoutRow{label: label, cell: func(r *FanoutRun) string { return fmtBytes(v(r)) }, value: func(r *FanoutRun) float64 { return float64(v(r)) }}
	}
	hasFleet := func(r *FanoutRun) bool { return r.Fleet != nil }
	plainStorm := t.relayed != nil && t.relayed.Transport == "plaintext" && t.relayed.Admission != nil
	return slices.Concat(
		[]fanoutRow{
			{label: "fleet start (paced ramp)", cell: func(r *FanoutRun) string { return sec(r.FleetStartS) }},
			{label: "initial sync (start → all synced)", cell: func(r *FanoutRun) string {
				if !r.Synced {
					return "not synced"
				}
				return sec(r.InitialSyncS)
			}, value: func(r *FanoutRun) float64 { return r.InitialSyncS }},
		},
		latencyRows("change → each Envoy's ACK", func(r *FanoutRun) report.LatencyMs { return r.ACK }),
		latencyRows("change → last Envoy's ACK", func(r *FanoutRun) report.LatencyMs { return r.Complete }),
		[]fanoutRow{
			relayPer("relay CPU per change per Envoy", "%.1fµs", func(r *FanoutRun) float64 { return r.RelayCPUPerChangeEnvoyUs }),
			relayPer("relay CPU per MB sent: sync", "%.1fms/MB", func(r *FanoutRun) float64 { return r.RelayCPUPerMBSyncMs }),
			relayPer("relay CPU per MB sent: changes", "%.1fms/MB", func(r *FanoutRun) float64 { return r.RelayCPUPerMBChangesMs }),
			{label: "changes reached all / timed out", cell: func(r *FanoutRun) string { return fmt.Sprintf("%d / %d", r.ChangesDone, r.ChangesTimedOut) }},
			{label: "upstream streams (after sync / end)",
				cell: func(r *FanoutRun) string {
					return fmt.Sprintf("%d / %d", r.UpstreamStreams.AfterSync, r.UpstreamStreams.AtEnd)
				},
				value: func(r *FanoutRun) float64 { return float64(r.UpstreamStreams.AfterSync) }},
			bytes("upstream bytes sent: sync", func(r *FanoutRun) uint64 { return r.UpstreamBytesSync }),
			bytes("upstream bytes sent: changes", func(r *FanoutRun) uint64 { return r.UpstreamBytesChanges }),
			bytes("Envoys' bytes received: sync", func(r *FanoutRun) uint64 { return r.EnvoyBytesSync }),
			bytes("Envoys' bytes received: changes", func(r *FanoutRun) uint64 { return r.EnvoyBytesChanges }),
			{label: "relay process CPU: sync / changes", cell: procCell(relay, procCPU)},
			{label: "relay CPU per 1,000 Envoys: sync",
				cell: procCell(relay, func(p *report.Process) string { return sec(p.CPUSyncS / float64(max(envoys, 1)) * 1000) }),
				value: func(r *FanoutRun) float64 {
					if r.Relay == nil || r.Relay.Err != "" {
						return 0
					}
					return r.Relay.CPUSyncS
				}},
			{label: "relay process RSS: peak / end", cell: procCell(relay, procRSS)},
			{label: "fleet process CPU: sync / changes", cell: procCell(fleet, procCPU), need: hasFleet, value: func(r *FanoutRun) float64 {
				if r.Fleet == nil {
					return 0
				}
				return r.Fleet.CPUSyncS + r.Fleet.CPUChangesS
			}},
			{label: "fleet process RSS: peak / end", cell: procCell(fleet, procRSS), need: hasFleet},
			{label: "loadtest process CPU: sync / changes", cell: func(r *FanoutRun) string { return procCPU(&r.Loadtest) },
				value: func(r *FanoutRun) float64 { return r.Loadtest.CPUSyncS + r.Loadtest.CPUChangesS }},
			{label: "loadtest process RSS: peak", cell: func(r *FanoutRun) string { return fmtBytes(r.Loadtest.RSSPeak) }},
			{label: "CPUs: relay / fleet", cell: func(r *FanoutRun) string { return procCPUs(r.Relay) + " / " + procCPUs(r.Fleet) },
				need: func(r *FanoutRun) bool { return r.Relay != nil || r.Fleet != nil }},
			{label: "Envoy stream reconnects", cell: func(r *FanoutRun) string { return fmt.Sprint(r.Reconnects) }},
			{label: "protocol violations", cell: func(r *FanoutRun) string { return fmt.Sprint(r.Violations) }},
			{label: "Envoys refused (at the end)", cell: func(r *FanoutRun) string { return fmt.Sprint(r.Refused) }, need: (*FanoutRun).tls},
			{label: "tokens presented / token reviews", need: (*FanoutRun).tls, cell: func(r *FanoutRun) string {
				if !r.tls() {
					return "-"
				}
				return fmt.Sprintf("%d / %d", r.Tokens, r.TokenReviews)
			}},
			stormRow("connect storm: admitted / streams", func(a *AdmissionFigures) string { return fmt.Sprintf("%d / %d", a.Admitted, a.Streams) }, nil),
			stormRow("connect storm: streams/s admitted", func(a *AdmissionFigures) string {
				return fmt.Sprintf("%.0f/s (%d at once)", a.RatePerS, a.Concurrency)
			}, func(a *AdmissionFigures) float64 { return a.RatePerS }),
			stormRow("connect storm: dial → answer P50", func(a *AdmissionFigures) string { return fmtMs(a.Latency.P50) },
				func(a *AdmissionFigures) float64 { return a.Latency.P50 }),
			stormRow("connect storm: dial → answer P99", func(a *AdmissionFigures) string { return fmtMs(a.Latency.P99) },
				func(a *AdmissionFigures) float64 { return a.Latency.P99 }),
			stormRow("connect storm: relay CPU per 1,000", func(a *AdmissionFigures) string { return fmt.Sprintf("%.3fs", a.RelayCPUPer1000S) },
				func(a *AdmissionFigures) float64 { return a.RelayCPUPer1000S }),
			{label: "  TLS+JWT alone (this − plaintext's)", need: (*FanoutRun).tls, omit: !plainStorm, cell: func(r *FanoutRun) string {
				if r.Admission == nil || !r.tls() {
					return "-"
				}
				return fmt.Sprintf("%.3fs", r.Admission.RelayCPUPer1000S-t.relayed.Admission.RelayCPUPer1000S)
			}},
			stormRow("  relay CPU-bound rate, per core", func(a *AdmissionFigures) string {
				if a.RelayCPUPer1000S <= 0 {
					return "-"
				}
				return fmt.Sprintf("%.0f/s", 1000/a.RelayCPUPer1000S)
			}, nil),
			stormRow("connect storm: loadtest CPU per 1,000", func(a *AdmissionFigures) string {
				return fmt.Sprintf("%.3fs", a.LoadtestCPUS/float64(max(a.Admitted, 1))*1000)
			}, func(a *AdmissionFigures) float64 { return a.LoadtestCPUS / float64(max(a.Admitted, 1)) }),
		},
	)
}

// latencyRows are a latency's P50, P95, P99 and max rows.
func latencyRows(label string, get func(*FanoutRun) report.LatencyMs) []fanoutRow {
	var rows []fanoutRow
	for _, q := range []struct {
		name string
		v    func(report.LatencyMs) float64
	}{{"P50", func(l report.LatencyMs) float64 { return l.P50 }}, {"P95", func(l report.LatencyMs) float64 { return l.P95 }},
		{"P99", func(l report.LatencyMs) float64 { return l.P99 }}, {"max", func(l report.LatencyMs) float64 { return l.Max }}} {
		value := func(r *FanoutRun) float64 { return q.v(get(r)) }
		rows = append(rows, fanoutRow{label: label + " " + q.name, cell: func(r *FanoutRun) string { return fmtMs(value(r)) }, value: value})
	}
	return rows
}

// procCell prints a process of a run with f: "-" without one, "error"
// if its figures could not be read.
func procCell(get func(*FanoutRun) *report.Process, f func(*report.Process) string) func(*FanoutRun) string {
	return func(r *FanoutRun) string {
		switch p := get(r); {
		case p == nil:
			return "-"
		case p.Err != "":
			return "error"
		default:
			return f(p)
		}
	}
}

func procCPU(p *report.Process) string {
	return fmt.Sprintf("%.2fs / %.2fs", p.CPUSyncS, p.CPUChangesS)
}

func procRSS(p *report.Process) string { return fmtBytes(p.RSSPeak) + " / " + fmtBytes(p.RSSEnd) }

func procCPUs(p *report.Process) string {
	if p == nil {
		return "-"
	}
	return p.CPUs
}

// stormRow is a row of the runs' connect storms, shown if a run had one
// ("-" for the others); value, if set, compares storms.
func stormRow(label string, cell func(*AdmissionFigures) string, value func(*AdmissionFigures) float64) fanoutRow {
	row := fanoutRow{label: label, cell: func(r *FanoutRun) string { return ofStorm(r, "-", cell) },
		need: func(r *FanoutRun) bool { return r.Admission != nil }}
	if value != nil {
		row.value = func(r *FanoutRun) float64 { return ofStorm(r, 0, value) }
	}
	return row
}

// ofStorm is f of r's connect storm, or none without one.
func ofStorm[T any](r *FanoutRun, none T, f func(*AdmissionFigures) T) T {
	if r.Admission == nil {
		return none
	}
	return f(r.Admission)
}

func fmtMs(v float64) string {
	switch {
	case v == 0:
		return "-"
	case v < 10:
		return fmt.Sprintf("%.2fms", v)
	case v < 10000:
		return fmt.Sprintf("%.0fms", v)
	default:
		return fmt.Sprintf("%.1fs", v/1000)
	}
}

func fmtBytes(b uint64) string {
	switch {
	case b >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(b)/(1<<30))
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(b)/(1<<10))
	default:
		return fmt.Sprintf("%d B", b)
	}
}

// settledStreams returns the upstream's open streams once they hold still
// (the same count twice, half a second apart, within ten seconds): a relay
// checks each node that joins a key against the key's stream (a divergence
// check, one upstream stream for a moment), and on a loaded machine those
// may still be open when the last Envoy synced. Streams that stay are
// counted.
func settledStreams(ctx context.Context, up *upstream.Upstream) int64 {
	n := up.Stats().OpenStreams
	for range 20 {
		select {
		case <-ctx.Done():
			return n
		case <-time.After(500 * time.Millisecond):
		}
		m := up.Stats().OpenStreams
		if m == n {
			return n
		}
		n = m
	}
	return n
}
