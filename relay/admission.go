package relay

// Admission and readiness: whether a new downstream stream may start, and
// whether the relay has config to serve.

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc/codes"
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
func (srv *server) admit(ctx context.Context, p port) (caller, error) {
	if srv.draining.Load() {
		return caller{}, status.Error(codes.Unavailable, "relay is draining: reconnect to another")
	}
	pi, err := srv.host.identifyPeer(ctx, p)
	if err != nil {
		return caller{}, err
	}
	if err := srv.host.checkPort(p, pi != nil); err != nil {
		return caller{}, err
	}
	if !srv.waitWarm(ctx) {
		return caller{}, status.Error(codes.Unavailable, "relay has no config to serve yet (upstream not reached)")
	}
	if pi != nil {
		return caller{relay: pi, cred: srv.forwardable(ctx, true, nil)}, nil
	}
	id, err := srv.authenticate(ctx, p)
	if err != nil {
		return caller{}, err
	}
	if srv.admission != nil {
		if err := srv.admission.Admit(ctx, admissionID(ctx, id)); err != nil {
			if !errors.Is(err, admission.ErrLater) {
				return caller{}, status.FromContextError(err).Err()
			}
			srv.metrics.Refused.WithLabelValues("rate").Inc()
			return caller{}, status.Errorf(codes.ResourceExhausted, "relay admits %v new streams a second, shared by identity, and this one's turn did not come: retry", srv.cfg.XDS.AdmitRate)
		}
	}
	return caller{identity: id, cred: srv.forwardable(ctx, false, id), share: admissionID(ctx, id)}, nil
}

// openStream admits a new stream on port p (admit) and starts it,
// counted, for an Envoy, in its identity's share of XDS.MaxStreams
// (admission.Shares); a stream evicted to make room ends. A refusal is
// counted by its code.
func (srv *server) openStream(ctx context.Context, delta bool, p port) (*stream, error) {
	s, err := srv.startStream(ctx, delta, p)
	if err != nil {
		srv.metrics.StreamErrors.WithLabelValues(status.Code(err).String()).Inc()
	}
	return s, err
}

func (srv *server) startStream(ctx context.Context, delta bool, p port) (*stream, error) {
	who, err := srv.admit(ctx, p)
	if err != nil {
		return nil, err
	}
	s := srv.newStream(ctx, delta, p)
	s.peerRelay, s.identity, s.cred = who.relay, who.identity, who.cred
	if who.relay != nil {
		return s, nil
	}
	evicted, ok, err := srv.shares.Join(s, who.share)
	if err != nil {
		srv.metrics.Refused.WithLabelValues("share").Inc()
		return nil, status.Errorf(codes.ResourceExhausted, "relay serves %d streams at most, and this identity holds its share of them: retry", srv.cfg.XDS.MaxStreams)
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
func (srv *server) waitWarm(ctx context.Context) bool {
	if srv.cfg.XDS.WarmWait < 0 {
		return true
	}
	select {
	case <-srv.warm:
		return true
	default:
	}
	t := time.NewTimer(srv.cfg.XDS.WarmWait)
	defer t.Stop()
	select {
	case <-srv.warm:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	srv.metrics.Refused.WithLabelValues("cold").Inc()
	return false
}

// markWarm lets streams in: the relay has config to serve.
func (srv *server) markWarm(why string) {
	srv.warmOnce.Do(func() {
		close(srv.warm)
		srv.log.Info("relay warm: " + why)
	})
}

// ready reports whether the server takes new streams: warm and not
// draining.
func (srv *server) ready() bool {
	select {
	case <-srv.warm:
		return !srv.draining.Load()
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
func (srv *server) forwardable(ctx context.Context, peer bool, id *auth.Identity) *credential {
	if !srv.cfg.ForwardCredentials {
		return nil
	}
	if peer {
		tok, err := auth.BearerToken(ctx)
		if err != nil || tok == "" {
			return nil
		}
		return &credential{token: tok, expires: auth.UnverifiedExpiry(tok)}
	}
	if id == nil || srv.cfg.XDS.Authenticator == nil {
		return nil
	}
	tok, expires, ok := srv.cfg.XDS.Authenticator.Token(ctx, *id)
	if !ok {
		return nil
	}
	return &credential{token: tok, expires: expires}
}
