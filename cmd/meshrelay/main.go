// Command meshrelay runs an xDS relay between istiod and Envoys (serve), or a
// whole tier in one process with a synthetic upstream and simulated Envoys
// (demo).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/meshrelay/meshrelay/loadtest"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/relay"
)

const usage = `meshrelay: a sharded xDS relay tier between istiod and Envoys.

Usage:
  meshrelay serve --upstream istiod.istio-system.svc:15010 [flags]
  meshrelay demo [flags]

Run "meshrelay <command> -h" for a command's flags.
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
		err = demo(ctx, os.Args[2:])
	case "-h", "--help", "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "meshrelay: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "meshrelay:", err)
		os.Exit(1)
	}
}

func serve(ctx context.Context, args []string) error {
	cfg := relay.DefaultConfig()
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.StringVar(&cfg.XDSListen, "xds-listen", cfg.XDSListen, "address of the ADS server for Envoys")
	fs.StringVar(&cfg.Upstream, "upstream", "", "gRPC target of the upstream control plane (istiod), e.g. istiod.istio-system.svc:15010 (required)")
	upProto := fs.String("upstream-protocol", string(cfg.UpstreamProtocol), "ADS variant spoken to the upstream: sotw or delta")
	profile := fs.String("key-profile", relay.ProfileIstio, "aggregation key profile: istio or per-node")
	keyMeta := fs.String("key-metadata", "", "comma-separated extra node metadata fields for the istio key profile")
	fs.StringVar(&cfg.AdminListen, "admin-listen", ":15014", "address of the admin HTTP server (/healthz, /readyz, /metrics, /debug/pprof); empty: none")
	fs.StringVar(&cfg.ID, "id", cfg.ID, "relay name, sent as control_plane.identifier")
	fs.IntVar(&cfg.MaxMsgSize, "max-msg-size", cfg.MaxMsgSize, "largest gRPC message sent or received, in bytes")
	fs.DurationVar(&cfg.KeyIdleTimeout, "key-idle-timeout", cfg.KeyIdleTimeout, "how long a key without Envoys keeps its upstream stream and cache")
	fs.DurationVar(&cfg.ResourceWaitTimeout, "resource-wait-timeout", cfg.ResourceWaitTimeout, "how long a requested resource may stay missing before Delta clients holding it are told it was removed")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var err error
	if cfg.UpstreamProtocol, err = relay.ParseProtocol(*upProto); err != nil {
		return err
	}
	var extra []string
	if *keyMeta != "" {
		extra = strings.Split(*keyMeta, ",")
	}
	if cfg.KeyProfile, err = relay.ParseKeyProfile(*profile, extra); err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	cfg.Logger = slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	r, err := relay.New(cfg)
	if err != nil {
		return err
	}
	if err := r.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	stopCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return r.Stop(stopCtx)
}

func demo(ctx context.Context, args []string) error {
	cfg := loadtest.DefaultDemoConfig()
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
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
	if err := fs.Parse(args); err != nil {
		return err
	}
	switch *proto {
	case "sotw":
		cfg.Protocol = envoy.SotW
	case "delta":
		cfg.Protocol = envoy.Delta
	default:
		return fmt.Errorf("--protocol %q: want sotw or delta", *proto)
	}
	var err error
	if cfg.UpstreamProtocol, err = relay.ParseProtocol(*upProto); err != nil {
		return err
	}
	return loadtest.RunDemo(ctx, cfg, os.Stdout)
}
