package loadtest

import (
	"context"
	"io"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/traffic"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// benchFleet is the fleet a benchmark drives: in this process (localFleet)
// or in a child process of its own (*FleetProcess).
type benchFleet interface {
	WaitSynced(ctx context.Context, up *upstream.Upstream) error
	Figures(ctx context.Context) (traffic.FleetFigures, error)
	Counters(ctx context.Context) (traffic.EnvoyCounters, error)
	// Track says changes are about to be timed from generations above
	// floor (see FleetProcess.Track).
	Track(ctx context.Context, floor uint64) error
	Stop(ctx context.Context) error
}

var (
	_ benchFleet = localFleet{}
	_ benchFleet = (*FleetProcess)(nil)
)

// localFleet is a Fleet in this process, whose Envoys report to the
// Tracker themselves.
type localFleet struct {
	fleet *traffic.Fleet
	tls   *tlsTransport // nil: plaintext
}

func (f localFleet) WaitSynced(ctx context.Context, up *upstream.Upstream) error {
	return f.fleet.WaitSynced(ctx, up)
}

func (f localFleet) Figures(context.Context) (traffic.FleetFigures, error) {
	fig := f.fleet.Figures(traffic.MaxViolationSamples)
	if f.tls != nil {
		fig.Tokens = f.tls.Tokens()
	}
	return fig, nil
}

func (f localFleet) Counters(context.Context) (traffic.EnvoyCounters, error) {
	return f.fleet.Counters(), nil
}

func (localFleet) Track(context.Context, uint64) error { return nil }

func (f localFleet) Stop(ctx context.Context) error {
	f.fleet.Stop(ctx)
	if f.tls != nil {
		f.tls.Close() // after the fleet stopped
	}
	return nil
}

// fleetSpec is the fleet a benchmark starts with startBenchFleet.
type fleetSpec struct {
	// fleet is what to run; its TLS is filled in from creds.
	fleet FleetChildConfig
	// creds, if set, has every Envoy dial TLS and present its node's
	// token.
	creds *MeshCredentials
	// command, if set, runs the fleet in a child process, pinned to cpus
	// if set, its stderr to stderr; nil runs it in this process.
	command FleetCommand
	cpus    CPUSet
	stderr  io.Writer
	// tracker, if set, sees every Envoy's ACKs (a child's once Track is
	// called).
	tracker *traffic.Tracker
	// started, if set, is called with a fleet child once it runs, before
	// its Envoys start (to meter it from there).
	started func(*FleetProcess)
}

// startBenchFleet starts spec's fleet and returns it with the time its
// Envoys started connecting; it returns once every Envoy has started. A
// fleet it returns, even with an error, must be stopped.
func startBenchFleet(ctx context.Context, spec fleetSpec) (benchFleet, time.Time, error) {
	fc := spec.fleet
	if spec.command == nil {
		p, err := fc.validate()
		if err != nil {
			return nil, time.Now(), err
		}
		fcfg := traffic.FleetConfig{
			Scenario: fc.Scenario, Envoys: fc.Envoys, Keys: fc.Keys, Protocol: p, Target: fc.Target, Targets: fc.Targets,
			EnvoysPerConn: fc.EnvoysPerConn, StartRate: fc.StartRate, MaxMsgSize: fc.MaxMsgSize, Tracker: spec.tracker,
			Light: fc.Light, MaxSyncing: fc.MaxSyncing,
		}
		var lf localFleet
		if spec.creds != nil {
			lf.tls = newTLSTransport(spec.creds, fc.Target, fc.EnvoysPerConn, fc.MaxMsgSize)
			fcfg.Configure = lf.tls.configure
		}
		start := time.Now()
		f, err := traffic.StartFleet(ctx, fcfg)
		if err != nil {
			if lf.tls != nil {
				lf.tls.Close()
			}
			return nil, start, err
		}
		lf.fleet = f
		if lf.tls != nil {
			if err := lf.tls.Err(); err != nil {
				return lf, start, err
			}
		}
		return lf, start, nil
	}
	if spec.creds != nil {
		var err error
		if fc.TLS, err = spec.creds.FleetTLS(fc.Scenario, fc.Keys); err != nil {
			return nil, time.Now(), err
		}
	}
	fp, err := StartFleetProcess(ctx, FleetProcessConfig{
		Fleet: fc, Command: spec.command, CPUs: spec.cpus, Tracker: spec.tracker, Stderr: spec.stderr,
	})
	if err != nil {
		return nil, time.Now(), err
	}
	if spec.started != nil {
		spec.started(fp)
	}
	start := time.Now()
	return fp, start, fp.Start(ctx)
}
