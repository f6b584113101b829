package relay

import (
	"context"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"golang.org/x/time/rate"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/passthrough"
)

// A stream's requests for types the relay does not cache go to the
// upstream on a stream of the client's own (relay/passthrough), opened
// on the first such request. Each is opened at the upstream's pace
// (Config.Upstream.StreamRate), at most a fifth of it for passthrough
// streams together (Relay.passRate), so that clients asking for such
// types cannot hold back the keys' own streams.

// passOut returns the channel of upstream answers to forward, nil if the
// stream has no passthrough.
func (s *stream) passOut() <-chan proto.Message {
	if s.pass == nil {
		return nil
	}
	return s.pass.Out()
}

// passRefused returns the channel of the upstream's refusal of the
// client's credentials, nil if the stream has no passthrough.
func (s *stream) passRefused() <-chan error {
	if s.pass == nil {
		return nil
	}
	return s.pass.Refused()
}

func (s *stream) passthroughSotW(req *discovery.DiscoveryRequest) error {
	return s.passthroughFor().SotW(req)
}

func (s *stream) passthroughDelta(req *discovery.DeltaDiscoveryRequest) error {
	return s.passthroughFor().Delta(req)
}

// passthroughFor returns the stream's passthrough, started on first use.
func (s *stream) passthroughFor() *passthrough.Passthrough {
	if s.pass != nil {
		return s.pass
	}
	r := s.srv
	cfg := passthrough.Config{
		Conn: r.upConn, Node: s.node, Delta: s.delta, Log: s.log,
		Paces:   []*rate.Limiter{r.passRate, r.cache.upstreamRate},
		Backoff: r.cache.newBackoff().next,
	}
	if r.cfg.ForwardCredentials {
		// The content is this client's: it presents its own token, as it
		// would to istiod. Without one istiod refuses, and so does this.
		cfg.StreamContext = func(ctx context.Context) context.Context { return withCredential(ctx, s.cred) }
	}
	p := passthrough.New(r.ctx, cfg)
	s.pass = p
	r.metrics.PassthroughStreams.Inc()
	r.host.goRun(func(context.Context) { p.Run() }) // refused while stopping: Stop does not wait for it
	return p
}

// stopPassthrough ends the stream's passthrough, if it has one.
func (s *stream) stopPassthrough() {
	if s.pass != nil {
		s.pass.Stop()
		s.srv.metrics.PassthroughStreams.Dec()
	}
}

// forward sends an upstream answer to the client under a relay nonce.
func (s *stream) forward(m proto.Message) error {
	s.pass.Relabel(m, s.nextNonce(), s.srv.controlPlane)
	s.srv.metrics.Passthrough.WithLabelValues(protocolName(s.delta)).Inc()
	return s.sendRaw(m)
}
