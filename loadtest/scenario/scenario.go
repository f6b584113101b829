// Package scenario holds what happens to a tier of relays, written once
// against cluster.Cluster: the same scenario runs in process in the tests
// (cluster.Tier) and drives the `meshrelay serve` binaries end to end
// (loadtest.RelayProcs) and in the chaos suite, as etcd's robustness
// tests drive their clusters.
package scenario

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// WaitReady waits until relay i of c is ready, for at most d.
func WaitReady(ctx context.Context, c cluster.Cluster, i int, d time.Duration) error {
	deadline := time.Now().Add(d)
	for !c.Ready(i) {
		if time.Now().After(deadline) {
			return fmt.Errorf("relay-%d not ready after %v", i, d)
		}
		if !traffic.SleepCtx(ctx, 50*time.Millisecond) {
			return ctx.Err()
		}
	}
	return nil
}

// RollingRestart restarts every relay of c in turn, as a Deployment's
// rolling update does: relay i stops gracefully (it leaves the ring and
// drains its streams), starts again, and the next one stops once it is
// ready. A relay that does not stop cleanly is reported to stopFailed (if
// not nil) and the roll goes on; one that does not start, or is not ready
// within ready, ends it.
func RollingRestart(ctx context.Context, c cluster.Cluster, ready time.Duration, stopFailed func(error)) error {
	for i := range c.Slots() {
		if err := c.StopRelay(ctx, i, true); err != nil && stopFailed != nil {
			stopFailed(err)
		}
		if err := c.Start(ctx, i); err != nil {
			return err
		}
		if err := WaitReady(ctx, c, i, ready); err != nil {
			return err
		}
	}
	return nil
}

// RollUnderChurn is an operator's upgrade of a live tier: Envoys of
// several keys connect to c, whose relays are fed by up; once they hold
// up's config, up changes churnRate times a second while every relay is
// restarted in turn (RollingRestart), and then stops changing. It returns
// nil when no Envoy saw a protocol violation (a version rolled back, a
// resource it did not ask for, …) and every one holds up's final config
// within settle; else an error naming what went wrong.
func RollUnderChurn(ctx context.Context, c cluster.Cluster, up *upstream.Upstream, fleet traffic.FleetConfig, churnRate float64, settle time.Duration) (err error) {
	fleet.Target, fleet.Targets = c.Addr(), nil
	for i := range c.Slots() {
		if err := WaitReady(ctx, c, i, settle); err != nil {
			return err
		}
	}
	f, err := traffic.StartFleet(ctx, fleet)
	if err != nil {
		return err
	}
	defer f.Stop(context.WithoutCancel(ctx))
	defer func() { err = errors.Join(err, violations(f)) }()
	wctx, cancel := context.WithTimeout(ctx, settle)
	err = f.WaitSynced(wctx, up)
	cancel()
	if err != nil {
		return fmt.Errorf("before the roll: %w", err)
	}

	churnCtx, stopChurn := context.WithCancel(ctx)
	churned := make(chan error, 1)
	go func() { churned <- churn(churnCtx, up, churnRate) }()
	var stopErrs []error // a relay that does not stop cleanly fails the scenario, after the roll
	rollErr := RollingRestart(ctx, c, settle, func(err error) { stopErrs = append(stopErrs, err) })
	stopChurn()
	if err := errors.Join(rollErr, <-churned, errors.Join(stopErrs...)); err != nil {
		return err
	}
	wctx, cancel = context.WithTimeout(ctx, settle)
	defer cancel()
	if err := f.WaitSynced(wctx, up); err != nil {
		return fmt.Errorf("after the roll: %w", err)
	}
	return nil
}

// churn steps up's churner at rate until ctx ends. A roll that saw no
// change proves nothing of ordering under churn: that is an error.
func churn(ctx context.Context, up *upstream.Upstream, rate float64) error {
	ch := up.NewChurner(1, 0.2)
	for traffic.SleepCtx(ctx, time.Duration(float64(time.Second)/rate)) {
		if _, err := ch.Step(); err != nil {
			return fmt.Errorf("churn: %w", err)
		}
	}
	if ch.Steps() == 0 {
		return errors.New("churn: no change during the roll")
	}
	return nil
}

// violations joins the protocol violations the fleet's Envoys recorded.
func violations(f *traffic.Fleet) error {
	v := f.Violations()
	n := len(v)
	if n == 0 {
		return nil
	}
	if n > 10 {
		v = append(v[:10], fmt.Errorf("… and %d more", n-10))
	}
	return fmt.Errorf("%d protocol violations: %w", n, errors.Join(v...))
}
