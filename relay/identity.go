package relay

import (
	"context"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"golang.org/x/time/rate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/admission"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/auth"
)

// authMode names how the TLS port authenticates, for logs.
func (srv *server) authMode() string {
	type moded interface{ Mode() auth.Mode }
	switch a := srv.cfg.XDS.Authenticator.(type) {
	case nil:
		return string(auth.ModeNone)
	case moded:
		return string(a.Mode())
	}
	return "custom"
}

// authenticate proves the identity of a new Envoy stream on the TLS port
// (nil, nil elsewhere, or with no Authenticator). A refusal is
// Unauthenticated (Unavailable when the verifier could not ask the
// Kubernetes API) and counted by reason; it is logged at most a few times
// a second, naming the peer's address, never the credential. Streams that
// present the same credential at once share one verification, and the
// failure gate bounds what failing ones cost (admission.FailureGate).
func (srv *server) authenticate(ctx context.Context, p port) (*auth.Identity, error) {
	if srv.cfg.XDS.Authenticator == nil || p != portTLS {
		return nil, nil
	}
	ip, cred := admission.SourceIP(ctx), admission.PrintOf(ctx)
	ok, lately := srv.failures.Allows(ip, cred)
	if lately != nil {
		// Refused as it was a moment ago, unverified.
		srv.metrics.AuthFailures.WithLabelValues(string(auth.ReasonOf(lately))).Inc()
		return nil, srv.refuseAuth(ctx, "stream", "authentication failed", lately)
	}
	if !ok {
		srv.metrics.AuthFailures.WithLabelValues("throttled").Inc()
		return nil, status.Error(codes.Unauthenticated, "too many failed authentications from this address: retry later")
	}
	v, err, _ := srv.verifying.Do(string(cred[:]), func() (any, error) {
		// Shared: the first stream going away must not fail the others.
		vctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), verifyTimeout)
		defer cancel()
		return srv.cfg.XDS.Authenticator.Authenticate(vctx)
	})
	if err != nil {
		reason := auth.ReasonOf(err)
		srv.metrics.AuthFailures.WithLabelValues(string(reason)).Inc()
		if reason != auth.ReviewFailed {
			srv.failures.Failed(ip, cred, err)
		}
		return nil, srv.refuseAuth(ctx, "stream", "authentication failed", err)
	}
	id := v.(auth.Identity)
	srv.failures.Succeeded(cred, id.Expires)
	return &id, nil
}

// verifyTimeout bounds one verification, which the streams presenting
// the same credential at once share.
const verifyTimeout = 30 * time.Second

// refuseAuth logs a failed authentication of what (at most a few a
// second, naming the peer's address, never the credential) and returns
// its status: Unavailable when the verifier could not reach what it asks
// (the Kubernetes API: the client is not at fault and should retry), else
// Unauthenticated with msg.
func (srv *server) refuseAuth(ctx context.Context, what, msg string, err error) error {
	reason := auth.ReasonOf(err)
	if srv.authLogs.Allow() {
		srv.log.Warn(what+" refused: authentication failed", "peer", peerAddr(ctx), "reason", reason, "err", err)
	}
	if reason == auth.ReviewFailed {
		return status.Errorf(codes.Unavailable, "authentication unavailable: %v", err)
	}
	return status.Errorf(codes.Unauthenticated, "%s: %v", msg, err)
}

// checkIdentity applies istiod's rule to the node an authenticated stream
// presents: PermissionDenied, counted and logged (rate-limited) with the
// node id, if it is another namespace's or service account's.
func (s *stream) checkIdentity(node *core.Node) error {
	if s.identity == nil {
		return nil
	}
	if err := auth.CheckNode(*s.identity, node); err != nil {
		s.srv.metrics.AuthFailures.WithLabelValues(string(auth.ReasonOf(err))).Inc()
		s.srv.failures.FailedFrom(admission.SourceIP(s.ctx))
		if s.srv.authLogs.Allow() {
			s.log.Warn("stream refused: node does not match its identity", "node", node.GetId(), "peer", s.peer, "identity", s.identity.SPIFFEID(), "err", err)
		}
		return status.Errorf(codes.PermissionDenied, "authorization failed: %v", err)
	}
	return nil
}

func peerAddr(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return ""
}

// newAuthLogLimiter bounds authentication warnings: a flood of failures
// costs a counter each, not a log line each.
func newAuthLogLimiter() *rate.Limiter { return rate.NewLimiter(rate.Every(200*time.Millisecond), 10) }

// peerIdentity is what a stream's metadata proves about a calling relay.
type peerIdentity struct {
	id  string
	key aggkey.Key
	// demand is MDDemand's Stamp (zero if none).
	demand ledger.Stamp
	// splits are the key's splits the calling relay knows (MDSplits).
	splits []aggkey.Split
}
