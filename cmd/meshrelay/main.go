// Command meshrelay runs an xDS relay between istiod and Envoys (serve), or a
// whole tier in one process with a synthetic upstream and simulated Envoys
// (demo).
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/KimMachineGun/automemlimit/memlimit"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/meshrelay/meshrelay/loadtest/demo"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/realenvoy"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/shard"

	// Every Envoy and Istio type, for config dumps and reflection.
	_ "github.com/meshrelay/meshrelay/relay/xdstypes"
)

const usage = `meshrelay: a sharded xDS relay tier between istiod and Envoys.

Usage:
  meshrelay serve --upstream istiod.istio-system.svc:15010 [flags]
  meshrelay demo [flags]

Run "meshrelay <command> --help" for a command's flags.
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
	case "serve":
		err = serve(ctx, os.Args[2:])
	case "demo":
		err = runDemo(ctx, os.Args[2:])
	case "-h", "--help", "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "meshrelay: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err != nil && !errors.Is(err, pflag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "meshrelay:", err)
		os.Exit(1)
	}
}

func serve(ctx context.Context, args []string) error {
	cfg := relay.DefaultConfig()
	ring := shard.DefaultConfig()
	fs := newFlagSet("serve")
	fs.StringVar(&cfg.XDS.Listen, "xds-listen", cfg.XDS.Listen, "address of the plaintext ADS server (istiod's 15010): it authenticates no one; with --xds-tls-cert, off unless set")
	fs.StringVar(&cfg.Upstream.Addr, "upstream", "", "gRPC target of the upstream control plane (istiod), e.g. istiod.istio-system.svc:15010 (required)")
	upProto := fs.String("upstream-protocol", string(cfg.Upstream.Protocol), "ADS variant spoken to the upstream: sotw or delta")
	fs.IntVar(&cfg.Upstream.Syncs, "upstream-syncs", cfg.Upstream.Syncs, "keys whose stream to istiod may be waiting for its first full answer at once, and as many again whose stream to the key's owner (another relay) may; others wait their turn, so a cold start does not hold every key's whole config at once. 0: no bound")
	fs.Float64Var(&cfg.Upstream.StreamRate, "upstream-stream-rate", cfg.Upstream.StreamRate, "streams per second this relay opens to istiod at most (one second's worth at once), so a cold relay of many keys, or every key after istiod restarts, reaches istiod at a pace it can take; streams to other relays are not counted. 0: no bound")
	profile := fs.String("key-profile", aggkey.ProfileIstio, "aggregation key profile: istio, fields (with --key-fields or --key-config) or per-node; every relay of a tier must use the same")
	keyMeta := fs.String("key-metadata", "", "comma-separated extra node metadata fields for the istio key profile")
	keyFields := fs.String("key-fields", "", "for --key-profile fields: the node fields every key is made of, comma-separated: id, id~REGEX, cluster, user_agent_name, user_agent_version, locality[.region|.zone|.sub_zone], namespace, metadata.PATH (e.g. cluster,metadata.LABELS.app)")
	keyConfig := fs.String("key-config", "", "for --key-profile fields: a YAML file of rules, matched in order by node fields, each naming the fields of its keys (see docs/architecture.md, Aggregation keys)")
	fs.DurationVar(&cfg.Keys.DivergenceInterval, "divergence-interval", cfg.Keys.DivergenceInterval, "how often each aggregated key is checked: a second stream to istiod presents another member's node, and if istiod gives it other config the key splits (that member and its look-alikes get keys of their own); also, by the relay holding the key's stream to istiod, as soon as a key gets its second member. One check per key at a time, two per relay. 0: never")
	fs.StringVar(&cfg.Admin.Listen, "admin-listen", ":15014", "address of the admin server: HTTP (/healthz, /readyz, /metrics, /debug/pprof) and gRPC (health, reflection) on one port; empty: none")
	hostID := cfg.ID
	fs.StringVar(&cfg.ID, "id", "", "relay name, sent as control_plane.identifier (default: meshrelay-HOSTNAME, the pod's name in Kubernetes)")
	fs.IntVar(&cfg.MaxMsgSize, "max-msg-size", cfg.MaxMsgSize, "largest gRPC message sent, or received from istiod and the tier's relays, in bytes")
	fs.IntVar(&cfg.XDS.MaxRequestBytes, "max-request-bytes", cfg.XDS.MaxRequestBytes, "largest request an Envoy may send on the xDS ports, in bytes: the default takes a Delta reconnect of a mesh of about 100,000 clusters (30,000 take 4.7 MB); past it the stream is refused with ResourceExhausted")
	fs.Int64Var(&cfg.XDS.RequestBudgetBytes, "request-budget-bytes", cfg.XDS.RequestBudgetBytes, "bytes of large requests (64 KiB and more: reconnects, not ACKs) the relay decodes and applies at once; others wait their turn. At least --max-request-bytes. 0: --max-request-bytes times half the cores (GOMAXPROCS), at least once, so large requests take half the relay's CPU at most")
	fs.IntVar(&cfg.XDS.MaxSubscribedNames, "max-subscribed-names", cfg.XDS.MaxSubscribedNames, "names one stream may subscribe to, or declare, for one type; past it the request is refused with InvalidArgument")
	fs.DurationVar(&cfg.Keys.IdleTimeout, "key-idle-timeout", cfg.Keys.IdleTimeout, "how long a key without Envoys keeps its upstream stream and cache")
	fs.DurationVar(&cfg.XDS.ResourceWaitTimeout, "resource-wait-timeout", cfg.XDS.ResourceWaitTimeout, "how long a requested resource may stay missing before Delta clients holding it are told it was removed")
	fs.Float64Var(&cfg.XDS.AdmitRate, "admit-rate", cfg.XDS.AdmitRate, "new Envoy streams admitted per second (token bucket), shared by identity: past it a stream waits its identity's turn (its service account, or its address where it proves none), then ResourceExhausted. 0: no limit")
	fs.IntVar(&cfg.XDS.AdmitBurst, "admit-burst", cfg.XDS.AdmitBurst, "token bucket size for --admit-rate")
	fs.IntVar(&cfg.XDS.MaxStreams, "max-streams", cfg.XDS.MaxStreams, "Envoy streams this relay serves at once, shared by identity: at the bound a stream of an identity under its share evicts the newest of the identity most over its share (it reconnects), one at its share is refused with ResourceExhausted; relays' streams are not counted. 0: no bound")
	fs.DurationVar(&cfg.XDS.AdmitWait, "admit-wait", cfg.XDS.AdmitWait, "how long a new stream may wait for its turn under --admit-rate before it is refused with ResourceExhausted (and its client retries)")
	fs.Uint32Var(&cfg.XDS.MaxStreamsPerConnection, "max-streams-per-connection", cfg.XDS.MaxStreamsPerConnection, "streams one client connection may have open at once on the xDS ports (HTTP/2 max concurrent streams; also bounds rapid resets)")
	fs.DurationVar(&cfg.XDS.MaxConnectionAge, "max-connection-age", cfg.XDS.MaxConnectionAge, "a client connection on the xDS ports ends (GOAWAY) after about this long, ±10 %, and its client reconnects through the Service, as istiod's; 0: never")
	fs.DurationVar(&cfg.XDS.MaxConnectionAgeGrace, "max-connection-age-grace", cfg.XDS.MaxConnectionAgeGrace, "how long a connection's streams may go on after --max-connection-age")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	var admin adminFlags
	admin.register(fs)
	var xdsTLS xdsTLSFlags
	xdsTLS.register(fs, &cfg)
	var peer peerFlags
	peer.register(fs, &cfg)
	var upAuth upstreamAuthFlags
	upAuth.register(fs)

	var tier tierFlags
	tier.register(fs, &ring)
	drain := fs.Duration("drain-period", 10*time.Second, "on SIGTERM (or an admin Drain), how long the closing of streams is spread over after leaving the ring")
	memRatio := fs.Float64("memory-limit-ratio", 0.9, "set GOMEMLIMIT to this fraction of the container's memory limit (cgroup), unless GOMEMLIMIT is set; 0: leave the Go runtime's default")
	debugNS := fs.String("debug-namespaces", "istio-system", "comma-separated namespaces whose proven identities read the whole tier's istio.io/debug types on the TLS xDS port (istioctl presents istio-system's default account), as istiod answers its root namespace; any other identity reads its own namespace's; empty: none")
	var etcd etcdFlags
	etcd.register(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if cfg.ID == "" {
		cfg.ID = hostID
	}
	if *debugNS != "" {
		cfg.Admin.DebugNamespaces = strings.Split(*debugNS, ",")
	}
	var err error
	if cfg.Upstream.Protocol, err = relay.ParseProtocol(*upProto); err != nil {
		return err
	}
	var extra []string
	if *keyMeta != "" {
		extra = strings.Split(*keyMeta, ",")
	}
	if cfg.Keys.Profile, err = keyProfile(*profile, extra, *keyFields, *keyConfig); err != nil {
		return err
	}
	if err := admin.apply(&cfg); err != nil {
		return err
	}
	if err := xdsTLS.apply(ctx, &cfg); err != nil {
		return err
	}
	adminAuthn, err := xdsTLS.adminAuthenticator()
	if err != nil {
		return err
	}
	if err := admin.applyIdentities(&cfg, adminAuthn); err != nil {
		return err
	}
	if err := peer.apply(&cfg, xdsTLS.trustDomain); err != nil {
		return err
	}
	if err := upAuth.apply(&cfg, xdsTLS.tokens != nil); err != nil {
		return err
	}
	if xdsTLS.enabled() && !fs.Changed("xds-listen") {
		// With TLS the plaintext port is opt-in: it authenticates no one.
		cfg.XDS.Listen = ""
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	cfg.Logger = slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if err := setMemoryLimit(*memRatio, memlimit.FromCgroup, cfg.Logger); err != nil {
		return err
	}
	if admin.allowMutations && cfg.Admin.Token == "" && cfg.Admin.Authenticator == nil && cfg.XDS.Authenticator == nil && admin.clientCA == "" {
		cfg.Logger.Warn("the admin API allows mutating calls (Drain) to anyone who reaches its port: set --admin-token-file or --admin-client-ca")
	}
	if cfg.Registerer == nil {
		reg := prometheus.NewRegistry()
		// The process's CPU, memory and file descriptors and the Go
		// runtime's heap, GC and GOMEMLIMIT, as istiod exports them: the
		// dashboard's resource panels read them. Registered here, by the
		// binary, so relays sharing a test process do not each report it.
		reg.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), collectors.NewGoCollector())
		cfg.Registerer, cfg.Gatherer = reg, reg
	}
	if err := tier.apply(&ring, cfg, peer.advertise); err != nil {
		return err
	}
	cfg.Tier.InsecureForDevelopment = tier.insecureDev
	store, closeEtcd, err := etcd.open(ctx, cfg.ID, ring.Cluster, cfg.Logger, cfg.Registerer)
	if err != nil {
		return err
	}
	defer closeEtcd()

	nc := shard.NodeConfig{Relay: cfg, DrainPeriod: *drain, Store: store, AllowMutations: admin.allowMutations}
	if tier.enabled() {
		ring.Logger = cfg.Logger
		nc.Ring = &ring
	}
	node, err := shard.NewNode(nc)
	if err != nil {
		if store != nil {
			store.Stop(context.WithoutCancel(ctx))
		}
		return err
	}
	if err := node.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	// Kubernetes waits terminationGracePeriodSeconds (30 s by default)
	// after SIGTERM: drain within it.
	stopCtx, cancel := context.WithTimeout(context.Background(), *drain+15*time.Second)
	defer cancel()
	return node.Stop(stopCtx)
}

// podAddr is the address to advertise for a listener: the flag's if set,
// else $POD_IP with the listener's port, else "" (derived from the
// listener once it listens).
func podAddr(flagged, listen string) (string, error) {
	ip := os.Getenv("POD_IP")
	if flagged != "" || ip == "" || listen == "" {
		return flagged, nil
	}
	_, port, err := net.SplitHostPort(listen)
	if err != nil {
		return "", err
	}
	return net.JoinHostPort(ip, port), nil
}

func splitHostPort(addr string) (string, int, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p > 65535 {
		return "", 0, fmt.Errorf("bad port in %q", addr)
	}
	if host == "" {
		host = "0.0.0.0"
	}
	return host, p, nil
}

func runDemo(ctx context.Context, args []string) error {
	cfg := demo.DefaultConfig()
	fs := newFlagSet("demo")
	fs.IntVar(&cfg.Envoys, "envoys", cfg.Envoys, "simulated Envoys")
	fs.IntVar(&cfg.Keys, "keys", cfg.Keys, "aggregation keys the Envoys spread over")
	fs.IntVar(&cfg.Scenario.Services, "services", cfg.Scenario.Services, "ServiceEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Endpoints, "endpoints", cfg.Scenario.Endpoints, "WorkloadEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Namespaces, "namespaces", cfg.Scenario.Namespaces, "namespaces (config is scoped by namespace)")
	proto := fs.String("protocol", "delta", "the Envoys' ADS variant: sotw or delta")
	upProto := fs.String("upstream-protocol", string(cfg.UpstreamProtocol), "the relay's ADS variant to the upstream: sotw or delta")
	fs.Float64Var(&cfg.ChurnRate, "churn-rate", cfg.ChurnRate, "upstream changes per second")
	fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "how long to run; 0: until Ctrl-C")
	fs.DurationVar(&cfg.Interval, "interval", cfg.Interval, "time between table rows")
	fs.IntVar(&cfg.Relays, "relays", cfg.Relays, "relays in the tier")
	schedule := fs.String("schedule", "8s:kill:1,13s:start:1", "tier events, AT:ACTION[:RELAY] comma-separated; actions kill (crash), stop (graceful), start, add; empty: none")
	fs.BoolVar(&cfg.NoEtcd, "no-etcd", false, "run without the embedded etcd: no snapshots, relays start cold")
	fs.IntVar(&cfg.RealEnvoys, "real-envoys", 0, "also start this many real Envoys found as the tests find them (install one once with: go run ./cmd/loadtest envoy), each with a listener routing to a backend the demo runs")
	interactive := fs.Bool("interactive", true, "read kill N, stop N, start N and add from the terminal while running (only if stdin is a terminal)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var err error
	if cfg.Schedule, err = demo.ParseSchedule(*schedule); err != nil {
		return err
	}
	if fi, err := os.Stdin.Stat(); *interactive && err == nil && fi.Mode()&os.ModeCharDevice != 0 {
		cfg.Input = os.Stdin
	}
	switch *proto {
	case "sotw":
		cfg.Protocol = envoy.SotW
	case "delta":
		cfg.Protocol = envoy.Delta
	default:
		return fmt.Errorf("--protocol %q: want sotw or delta", *proto)
	}
	if cfg.UpstreamProtocol, err = relay.ParseProtocol(*upProto); err != nil {
		return err
	}
	if cfg.RealEnvoys < 0 {
		return fmt.Errorf("--real-envoys %d: want 0 or more", cfg.RealEnvoys)
	}
	if cfg.RealEnvoys > 0 {
		if cfg.EnvoyBinary, err = realenvoy.Find(ctx); err != nil {
			return fmt.Errorf("--real-envoys: %w", err)
		}
	}
	return demo.Run(ctx, cfg, os.Stdout)
}

// keyProfile returns the aggregation key profile the key flags name.
func keyProfile(name string, extraMeta []string, fields, configFile string) (aggkey.Profile, error) {
	switch {
	case fields != "" && configFile != "":
		return nil, errors.New("--key-fields and --key-config: give one")
	case (fields != "" || configFile != "") && name != aggkey.ProfileFields:
		return nil, fmt.Errorf("--key-fields and --key-config are for --key-profile %s, not %q", aggkey.ProfileFields, name)
	case name == aggkey.ProfileFields && len(extraMeta) > 0:
		return nil, errors.New("--key-metadata is for the istio profile: with fields, list them in --key-fields or --key-config")
	case fields != "":
		return aggkey.ParseKeyFields(fields)
	case configFile != "":
		b, err := os.ReadFile(configFile)
		if err != nil {
			return nil, fmt.Errorf("--key-config: %w", err)
		}
		p, err := aggkey.ParseKeyConfig(b)
		if err != nil {
			return nil, fmt.Errorf("--key-config %s: %w", configFile, err)
		}
		return p, nil
	}
	return aggkey.ParseProfile(name, extraMeta)
}

// newFlagSet returns the flags of the command "meshrelay name", printing its
// usage as relayctl (cobra) does: every flag as --flag.
func newFlagSet(name string) *pflag.FlagSet {
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	fs.Usage = func() {
		if !fs.HasFlags() {
			fmt.Fprintf(fs.Output(), "Usage:\n  meshrelay %s\n", name)
			return
		}
		fmt.Fprintf(fs.Output(), "Usage:\n  meshrelay %s [flags]\n\nFlags:\n%s", name, fs.FlagUsages())
	}
	return fs
}
