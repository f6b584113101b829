package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
)

// DemoConfig configures RunDemo: a whole tier in one process.
type DemoConfig struct {
	Scenario         upstream.Scenario
	Envoys           int
	Keys             int
	Protocol         envoy.Protocol // the Envoys'
	UpstreamProtocol relay.Protocol // the relay's, to the upstream
	// ChurnRate is upstream changes per second (endpoint moves, and now and
	// then a service added or removed). 0: no churn.
	ChurnRate float64
	// Duration bounds the run; 0 runs until ctx ends.
	Duration time.Duration
	// Interval between table rows. Default 1s.
	Interval time.Duration
	// Logger for the relay. Default: discard.
	Logger *slog.Logger
}

// DefaultDemoConfig is what `meshrelay demo` runs with no flags.
func DefaultDemoConfig() DemoConfig {
	sc := upstream.DefaultScenario()
	sc.Services, sc.Endpoints, sc.Namespaces, sc.LocalFraction = 200, 400, 5, 0.2
	return DemoConfig{
		Scenario:         sc,
		Envoys:           200,
		Keys:             20,
		Protocol:         envoy.Delta,
		UpstreamProtocol: relay.ProtocolDelta,
		ChurnRate:        5,
		Duration:         20 * time.Second,
		Interval:         time.Second,
	}
}

// RunDemo starts a synthetic upstream, a relay in front of it and a fleet of
// simulated Envoys, churns the upstream, and prints a live table of the
// tier's convergence to out until Duration passes or ctx ends.
func RunDemo(ctx context.Context, cfg DemoConfig, out io.Writer) error {
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.Duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, cfg.Duration)
		defer cancel()
	}
	stopCtx := context.WithoutCancel(ctx)

	tracker := NewTracker()
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

	rcfg := relay.DefaultConfig()
	rcfg.ID = "relay-demo"
	rcfg.XDSListen = "127.0.0.1:0"
	rcfg.Upstream = up.Addr()
	rcfg.UpstreamProtocol = cfg.UpstreamProtocol
	if cfg.Logger != nil {
		rcfg.Logger = cfg.Logger
	}
	r, err := relay.New(rcfg)
	if err != nil {
		return err
	}
	if err := r.Start(ctx); err != nil {
		return err
	}
	defer r.Stop(stopCtx)

	sc := cfg.Scenario
	fmt.Fprintf(out, "meshrelay demo\n")
	fmt.Fprintf(out, "  upstream  %s: synthetic istiod, %d ServiceEntries, %d WorkloadEntries, %d namespaces\n",
		up.Addr(), sc.Services, sc.Endpoints, sc.Namespaces)
	fmt.Fprintf(out, "  relay     %s: upstream protocol %s, key profile istio\n", r.Addr(), cfg.UpstreamProtocol)
	fmt.Fprintf(out, "  envoys    %d simulated (%s) over %d keys; churn %.1f changes/s\n\n", cfg.Envoys, cfg.Protocol, cfg.Keys, cfg.ChurnRate)

	start := time.Now()
	// The Envoys live until the deferred Stop, so the last row still shows
	// them connected.
	fleet, err := StartFleet(stopCtx, FleetConfig{
		Scenario: sc, Envoys: cfg.Envoys, Keys: cfg.Keys, Protocol: cfg.Protocol,
		Target: r.Addr().String(), Tracker: tracker,
	})
	if err != nil {
		return err
	}
	defer fleet.Stop(stopCtx)

	churnDone := make(chan error, 1)
	if cfg.ChurnRate > 0 {
		go func() {
			// Churn is always bounded; ctx ends it sooner.
			churnDone <- up.Churn(ctx, upstream.ChurnConfig{Rate: cfg.ChurnRate, AddRemoveFraction: 0.05, Seed: 1, Duration: 24 * time.Hour},
				nil)
		}()
	} else {
		churnDone <- nil
	}

	header := "%6s %9s %7s %5s %9s %8s %11s %11s %11s %11s %9s %5s\n"
	row := "%6s %9s %7d %5d %9d %8d %11s %11s %11s %11s %9.1f %5d\n"
	fmt.Fprintf(out, header, "time", "envoys", "synced", "keys", "upstream", "pushes",
		"push→ACK50", "push→ACK99", "change→all50", "change→all99", "sent MB", "viol")
	tick := time.NewTicker(cfg.Interval)
	defer tick.Stop()
	print := func() {
		st := r.Stats()
		_, complete, _ := tracker.Results()
		fmt.Fprintf(out, row,
			time.Since(start).Round(time.Second), fmt.Sprintf("%d/%d", fleet.Connected(), cfg.Envoys),
			fleet.Synced(up), st.Keys, st.UpstreamStreams, st.Pushes,
			ms(st.PushACKP50), ms(st.PushACKP99), ms(complete.P50), ms(complete.P99),
			float64(st.BytesSent)/1e6, len(fleet.Violations()))
	}
	for {
		select {
		case <-tick.C:
			print()
		case <-ctx.Done():
			print()
			perEnvoy, complete, _ := tracker.Results()
			fmt.Fprintf(out, "\n%d changes reached all their Envoys: P50 %s, P99 %s, max %s (per Envoy ACK P99 %s)\n",
				complete.N, ms(complete.P50), ms(complete.P99), ms(complete.Max), ms(perEnvoy.P99))
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

func ms(d time.Duration) string {
	if d == 0 {
		return "-"
	}
	if d < time.Millisecond {
		return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond))
	}
	return d.Round(100 * time.Microsecond).String()
}
