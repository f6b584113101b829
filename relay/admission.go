package relay

// Admission and readiness: whether a new downstream stream may start, and
// whether the relay has config to serve.

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/auth"
)

// caller is what a new stream proved about who opened it: another relay
// of the tier, or, on the TLS port, a workload identity.
type caller struct {
	relay    *peerIdentity
	identity *auth.Identity
	cred     *credential // kept to present upstream (ForwardCredentials)
}

// admit decides whether a new downstream stream may start: not while the
// relay is draining or has never reached its upstream, and, for Envoys, at
// most AdmitRate a second and, on the TLS port, once they proved who they
// are (after the token bucket: a flood of bad credentials costs a token
// each, not a verification each).
func (r *Relay) admit(ctx context.Context, p port) (caller, error) {
	if r.draining.Load() {
		return caller{}, status.Error(codes.Unavailable, "relay is draining: reconnect to another")
	}
	pi, err := r.identifyPeer(ctx, p)
	if err != nil {
		return caller{}, err
	}
	if err := r.checkPort(p, pi != nil); err != nil {
		return caller{}, err
	}
	if !r.waitWarm(ctx) {
		return caller{}, status.Error(codes.Unavailable, "relay has no config to serve yet (upstream not reached)")
	}
	if pi != nil {
		return caller{relay: pi, cred: r.forwardable(ctx, true, nil)}, nil
	}
	if p == portTLS && r.cfg.XDS.Authenticator != nil && !r.failures.allows(sourceIP(ctx)) {
		r.metrics.authFailures.WithLabelValues("throttled").Inc()
		return caller{}, status.Error(codes.Unauthenticated, "too many failed authentications from this address: retry later")
	}
	if r.admission != nil && !r.admission.Allow() {
		r.metrics.refused.WithLabelValues("rate").Inc()
		return caller{}, status.Errorf(codes.ResourceExhausted, "relay admits %v new streams a second: retry", r.cfg.XDS.AdmitRate)
	}
	id, err := r.authenticate(ctx, p)
	if err != nil {
		return caller{}, err
	}
	return caller{identity: id, cred: r.forwardable(ctx, false, id)}, nil
}

// waitWarm waits up to WarmWait for the relay to be warm.
func (r *Relay) waitWarm(ctx context.Context) bool {
	if r.cfg.XDS.WarmWait < 0 {
		return true
	}
	select {
	case <-r.warm:
		return true
	default:
	}
	t := time.NewTimer(r.cfg.XDS.WarmWait)
	defer t.Stop()
	select {
	case <-r.warm:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	r.metrics.refused.WithLabelValues("cold").Inc()
	return false
}

// watchWarm closes r.warm once the upstream connection is first ready: from
// then on the relay has a source of config (and its cache) to serve from.
func (r *Relay) watchWarm(ctx context.Context) {
	r.upConn.Connect()
	for {
		s := r.upConn.GetState()
		if s == connectivity.Ready {
			// A relay that loads snapshots takes streams once they are
			// in place: a stream that came first would find its key cold.
			select {
			case <-r.loaded:
			case <-ctx.Done():
				return
			}
			r.markWarm("upstream reached")
			return
		}
		if s == connectivity.Idle {
			r.upConn.Connect()
		}
		if !r.upConn.WaitForStateChange(ctx, s) {
			return
		}
	}
}

// markWarm lets streams in: the relay has config to serve.
func (r *Relay) markWarm(why string) {
	r.warmOnce.Do(func() {
		close(r.warm)
		r.log.Info("relay warm: " + why)
	})
}

// Ready reports whether the relay takes new streams: warm and not draining.
func (r *Relay) Ready() bool {
	select {
	case <-r.warm:
		return !r.draining.Load()
	default:
		return false
	}
}
