package relay

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
)

// credential is a bearer token a stream came with, kept in memory so that
// its key's upstream stream can present it (Config.Upstream.ForwardCredentials). It
// prints as a placeholder, so that no log line can hold it.
type credential struct {
	token   string
	expires time.Time // zero: unknown
	// refused is set once the upstream refused a stream presenting the
	// token (Unauthenticated or PermissionDenied: revoked, or bound to a
	// pod that is gone): it is not presented again.
	refused atomic.Bool
}

func (c *credential) String() string { return "[token]" }

// LogValue implements slog.LogValuer.
func (c *credential) LogValue() slog.Value { return slog.StringValue("[token]") }

// usableAt reports whether c may still be presented at t.
func (c *credential) usableAt(t time.Time) bool {
	return c != nil && !c.refused.Load() && (c.expires.IsZero() || t.Before(c.expires))
}

// noteRefused marks the credential m presents as refused when err is the
// upstream refusing the stream's credentials: the key's next stream then
// presents another member (presentable), instead of retrying a token
// istiod will not take.
func noteRefused(m member, err error) bool {
	if m == nil {
		return false
	}
	switch status.Code(err) {
	case codes.Unauthenticated, codes.PermissionDenied:
	default:
		return false
	}
	_, c := m.presents()
	if c == nil {
		return false
	}
	c.refused.Store(true)
	return true
}

// withCredential adds c to an outgoing stream's metadata (nothing if nil).
func withCredential(ctx context.Context, c *credential) context.Context {
	if c == nil {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.token)
}

// presentable picks the member whose node (and, in forward mode, token) a
// key's upstream stream presents: the first to join, but in forward mode
// the first whose token lives past refresh from now, else the first whose
// token is still valid, else the first. members is in join order.
func presentable(members []member, forward bool, now time.Time, refresh time.Duration) member {
	if len(members) == 0 {
		return nil
	}
	if !forward {
		return members[0]
	}
	var valid member
	for _, m := range members {
		_, cred := m.presents()
		switch {
		case cred.usableAt(now.Add(refresh)):
			return m
		case valid == nil && cred.usableAt(now):
			valid = m
		}
	}
	if valid != nil {
		return valid
	}
	return members[0]
}

// presentsToken reports whether m, in forward mode, has a token the
// upstream may still take.
func presentsToken(m member) bool {
	if m == nil {
		return false
	}
	_, cred := m.presents()
	return cred.usableAt(time.Now())
}

// waitForToken waits, in forward mode, until a member has a token to
// present (a member joins: upWake) or the key's source becomes its owner,
// or gives up when the key stays idle.
// The key's views are not confirmed meanwhile.
func (u *feed) waitForToken(ctx context.Context, node *core.Node) bool {
	u.setStale(true)
	u.c.metrics.AwaitingToken.Inc()
	defer u.c.metrics.AwaitingToken.Dec()
	u.c.log.Warn("forward mode: no member of the key holds a token the upstream would take; serving the cache until an Envoy brings one", "key", u.k.key, "node", node.GetId())
	return u.waitUntil(ctx, func() bool {
		first, _ := u.k.presenter()
		return presentsToken(first) || u.choose().kind == sourcePeer // a token, or a source that needs none (the owner)
	})
}

// refreshTimer fires TokenRefreshBefore ahead of the expiry of the token
// the stream presents (forward mode): then a member whose token lives
// longer takes over. Nil if there is nothing to refresh.
func (u *feed) refreshTimer(presenter member) *time.Timer {
	if !u.c.cfg.Upstream.ForwardCredentials || presenter == nil {
		return nil
	}
	_, cred := presenter.presents()
	if cred == nil || cred.expires.IsZero() {
		return nil
	}
	return time.NewTimer(time.Until(cred.expires.Add(-u.c.cfg.Upstream.TokenRefreshBefore)))
}

// tokenExpiring reports whether, in forward mode, the presented token is
// within TokenRefreshBefore of its expiry while next's lives past it: the
// stream should move to next before istiod would refuse a reconnect.
func (u *feed) tokenExpiring(next member) bool {
	if !u.c.cfg.Upstream.ForwardCredentials || u.presented == nil {
		return false
	}
	horizon := time.Now().Add(u.c.cfg.Upstream.TokenRefreshBefore)
	_, cur := u.presented.presents()
	_, nextCred := next.presents()
	return !cur.usableAt(horizon) && nextCred.usableAt(horizon)
}

// presentsSame reports whether next presents what a stream that presents
// node does: the same node, and no token (outside forward mode). A peer
// relay's renewed stream, or an Envoy's new stream beside its old one,
// presents the same node as the one it replaces.
func (u *feed) presentsSame(next member, node *core.Node) bool {
	return !u.c.cfg.Upstream.ForwardCredentials && proto.Equal(memberNode(next), node)
}
