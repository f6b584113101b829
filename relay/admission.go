package relay

// Admission and readiness: whether a new downstream stream may start, and
// whether the relay has config to serve.

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/admission"
	"github.com/meshrelay/meshrelay/relay/auth"
)

// caller is what a new stream proved about who opened it: another relay
// of the tier, or, on the TLS port, a workload identity.
type caller struct {
	relay    *peerIdentity
	identity *auth.Identity
	cred     *credential // kept to present upstream (ForwardCredentials)
	share    string      // whom its admission and its share of streams count to (admissionID); "" for a relay
}

// admit decides whether a new downstream stream may start: not while the
// relay is draining or has never reached its upstream, and, for Envoys,
// once they proved who they are (on the TLS port), at their identity's
// share of AdmitRate (admission.Fair). Authentication comes first: a
// flood of bad or missing credentials costs what the failure gate lets it
// (identity.go) and takes no one's turn.
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
	id, err := r.authenticate(ctx, p)
	if err != nil {
		return caller{}, err
	}
	if r.admission != nil {
		if err := r.admission.Admit(ctx, admissionID(ctx, id)); err != nil {
			if !errors.Is(err, admission.ErrLater) {
				return caller{}, status.FromContextError(err).Err()
			}
			r.metrics.Refused.WithLabelValues("rate").Inc()
			return caller{}, status.Errorf(codes.ResourceExhausted, "relay admits %v new streams a second, shared by identity, and this one's turn did not come: retry", r.cfg.XDS.AdmitRate)
		}
	}
	return caller{identity: id, cred: r.forwardable(ctx, false, id), share: admissionID(ctx, id)}, nil
}

// openStream admits a new stream on port p (admit) and starts it,
// counted, for an Envoy, in its identity's share of XDS.MaxStreams
// (admission.Shares); a stream evicted to make room ends. A refusal is
// counted by its code.
func (r *Relay) openStream(ctx context.Context, delta bool, p port) (*stream, error) {
	s, err := r.startStream(ctx, delta, p)
	if err != nil {
		r.metrics.StreamErrors.WithLabelValues(status.Code(err).String()).Inc()
	}
	return s, err
}

func (r *Relay) startStream(ctx context.Context, delta bool, p port) (*stream, error) {
	who, err := r.admit(ctx, p)
	if err != nil {
		return nil, err
	}
	s := r.newStream(ctx, delta, p)
	s.peerRelay, s.identity, s.cred = who.relay, who.identity, who.cred
	if who.relay != nil {
		return s, nil
	}
	evicted, ok, err := r.shares.Join(s, who.share)
	if err != nil {
		r.metrics.Refused.WithLabelValues("share").Inc()
		return nil, status.Errorf(codes.ResourceExhausted, "relay serves %d streams at most, and this identity holds its share of them: retry", r.cfg.XDS.MaxStreams)
	}
	if ok {
		// It reconnects, here or to another relay, which finds the
		// version it holds in the tier (this relay still serves its key).
		close(evicted.evict)
	}
	return s, nil
}

// admissionID is whom a stream's admission is shared by: its proven
// identity, or, where none is proven, its address.
func admissionID(ctx context.Context, id *auth.Identity) string {
	if id != nil {
		return id.SPIFFEID()
	}
	return "address " + admission.SourceIP(ctx).String()
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
	r.metrics.Refused.WithLabelValues("cold").Inc()
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
			case <-r.cache.loaded:
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

// forwardable returns the credential of a new stream to keep, in forward
// mode: the token an Envoy brought to the TLS port, if it proves the
// stream's identity (Authenticator.Token: the token that proved it, or one
// beside the certificate that did), or the token another relay presents on
// its stream to a key this relay owns (the peer port proved that relay; it
// verified the token). Nil otherwise.
func (r *Relay) forwardable(ctx context.Context, peer bool, id *auth.Identity) *credential {
	if !r.cfg.Upstream.ForwardCredentials {
		return nil
	}
	if peer {
		tok, err := auth.BearerToken(ctx)
		if err != nil || tok == "" {
			return nil
		}
		return &credential{token: tok, expires: auth.UnverifiedExpiry(tok)}
	}
	if id == nil || r.cfg.XDS.Authenticator == nil {
		return nil
	}
	tok, expires, ok := r.cfg.XDS.Authenticator.Token(ctx, *id)
	if !ok {
		return nil
	}
	return &credential{token: tok, expires: expires}
}
