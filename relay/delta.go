package relay

import (
	"slices"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/istiodebug"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// serveDelta serves one Delta (incremental) ADS stream that came in on
// port p.
func (srv *server) serveDelta(ds discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer, p port) error {
	s, err := srv.openStream(ds.Context(), true, p)
	if err != nil {
		return err
	}
	s.send = func(o *wire.Response) error {
		w := srv.bodies.Delta(o, srv.controlPlaneWire)
		srv.metrics.Sent(o.TypeURL, len(o.Updated), len(o.Removed), w.Size())
		return ds.SendMsg(w)
	}
	s.sendRaw = func(m proto.Message) error { return ds.Send(m.(*discovery.DeltaDiscoveryResponse)) }
	recv := func() (*wire.DeltaRequest, error) {
		r := new(wire.DeltaRequest)
		return r, ds.RecvMsg(r)
	}
	// Decoded once its bytes of the relay's budget are taken.
	return serve(s, recv, (*wire.DeltaRequest).Size, func(r *wire.DeltaRequest) error {
		if err := s.checkNames("one request", r.Names()); err != nil {
			r.Release() // refused before a name is decoded
			return err
		}
		req, err := r.Decode()
		if err != nil {
			return status.Errorf(codes.InvalidArgument, "bad request: %v", err)
		}
		return s.onDelta(req)
	}, (*wire.DeltaRequest).Release)
}

// onDelta handles one Delta request.
func (s *stream) onDelta(req *discovery.DeltaDiscoveryRequest) error {
	if istiodebug.IsDebugType(req.GetTypeUrl()) && s.key == nil {
		return s.srv.host.answerDebugDelta(s, req)
	}
	if s.key == nil {
		if err := s.attach(req.GetNode()); err != nil {
			return err
		}
	}
	typeURL := req.GetTypeUrl()
	if typeURL == "" {
		return status.Error(codes.InvalidArgument, "type_url is required on an ADS stream")
	}
	if !xds.Cached(typeURL) {
		return s.passthroughDelta(req)
	}
	subscribe, unsubscribe := req.GetResourceNamesSubscribe(), req.GetResourceNamesUnsubscribe()
	if err := s.checkNames(typeURL, len(subscribe)+len(unsubscribe)+len(req.GetInitialResourceVersions())); err != nil {
		return err
	}

	sub := s.subs[typeURL]
	if sub == nil {
		legacy := len(subscribe) == 0 && xds.LegacyWildcard(typeURL)
		wildcard := (legacy || slices.Contains(subscribe, xds.WildcardName)) && !slices.Contains(unsubscribe, xds.WildcardName)
		names := xds.NewNameSet(subscribe).With(nil, unsubscribe)
		sub = s.newSub(typeURL, wildcard, legacy, names)
		// A peer relay is answered on every type, even with nothing new:
		// the answers tell it its source confirms its views.
		sub.awaitFirst = wildcard || s.peerRelay != nil
		sub.known, sub.orders = s.declared(sub, req.GetInitialResourceVersions())
		sub.declared = sub.known.Len() > 0
		return nil
	}

	// ACK or NACK of an earlier response, matched by nonce.
	if n := req.GetResponseNonce(); n != "" {
		if i := slices.IndexFunc(sub.inflight, func(r sentResponse) bool { return r.nonce == n }); i >= 0 {
			sent := sub.inflight[i]
			sub.inflight = slices.Delete(sub.inflight, 0, i+1)
			s.ack(sub, sent, nackDetail(req.GetErrorDetail()), len(sub.inflight) == 0)
		}
	}

	// Subscription changes are honoured whatever the nonce (xDS protocol).
	if len(subscribe) == 0 && len(unsubscribe) == 0 {
		return nil
	}
	if err := s.checkNames(typeURL, len(sub.names)+len(subscribe)); err != nil {
		return err
	}
	wildcard := sub.wildcard
	if slices.Contains(subscribe, xds.WildcardName) {
		wildcard = true
	}
	if slices.Contains(unsubscribe, xds.WildcardName) {
		wildcard = false
	}
	add, drop := xds.NewNameSet(subscribe), xds.NewNameSet(unsubscribe)
	// A name subscribed again is sent again even if the client declared it:
	// the client may have forgotten it (Envoy #22418).
	s.resubscribe(sub, wildcard, sub.names.With(add, drop), add)
	return nil
}

// unknownContent is the hash recorded for a resource a client declares
// with a version the relay did not issue: it matches no content.
var unknownContent = ledger.Hash{}

// declared builds what a reconnecting client says it holds
// (initial_resource_versions), limited to what it subscribes to, and the
// Orders of the versions it holds them at (see orderSet). A version that is
// not one of the relay's content versions stands for unknown content: the
// resource is sent again if it exists, and removed if not; like a version
// without an Order, it is bounded by now (Relay.placed). Another
// relay's Orders move this relay's clock (ledger.Clock); an Envoy's are its
// own word and move nothing.
func (s *stream) declared(sub *typeSub, versions map[string]string) (known ledger.Tree[*xds.Resource], orders orderSet) {
	if len(versions) == 0 {
		return ledger.Tree[*xds.Resource]{}, nil
	}
	fromPeer := s.peerRelay != nil
	b := ledger.Tree[*xds.Resource]{}.Edit()
	unplaced := false // some content has no Order the relay can place
	for name, v := range versions {
		if !sub.wildcard && !sub.names.Has(name) {
			continue
		}
		h, o, err := wire.ParseVersion(v)
		if err != nil {
			b.Set(name, unknownContent, nil)
			unplaced = true
			continue
		}
		if s.srv.cache.placed(o, fromPeer) {
			orders = orders.add(o)
		} else {
			unplaced = true
		}
		b.Set(name, h, s.srv.store.Lookup(h))
	}
	if fromPeer {
		for _, o := range orders {
			s.srv.cache.observe(o, "peer", s.peerRelay.id)
		}
	}
	if unplaced {
		orders = orders.add(s.srv.cache.declaredBound())
	}
	return b.Tree(), orders
}
