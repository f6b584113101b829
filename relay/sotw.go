package relay

import (
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/admission"
	"github.com/meshrelay/meshrelay/relay/istiodebug"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// serveSotW serves one SotW ADS stream that came in on port p.
func (srv *server) serveSotW(ss discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer, p port) error {
	s, err := srv.openStream(ss.Context(), false, p)
	if err != nil {
		return err
	}
	s.send = func(o *wire.Response) error {
		w := srv.bodies.SotW(o, srv.controlPlaneWire)
		n := len(o.Updated)
		if o.Full {
			n = o.Held.Len()
		}
		srv.metrics.Sent(o.TypeURL, n, 0, w.Size())
		return ss.SendMsg(w)
	}
	s.sendRaw = func(m proto.Message) error { return ss.Send(m.(*discovery.DiscoveryResponse)) }
	recv := func() (*wire.SotWRequest, error) {
		r := new(wire.SotWRequest)
		return r, ss.RecvMsg(r)
	}
	size := func(r *wire.SotWRequest) int { return r.Names.Size() }
	return serve(s, recv, size, func(r *wire.SotWRequest) error {
		defer r.Release() // the names are decoded, if at all, by now
		return s.handleSotW(r.Req, &r.Names)
	}, (*wire.SotWRequest).Release)
}

// onSotW handles one SotW request.
func (s *stream) onSotW(req *discovery.DiscoveryRequest) error {
	nl := wire.NamesOf(req.GetResourceNames())
	return s.handleSotW(req, &nl)
}

// handleSotW handles one SotW request whose resource_names are in names
// (req.ResourceNames is not read): they are decoded only if the stream's
// subscription changed.
func (s *stream) handleSotW(req *discovery.DiscoveryRequest, names *wire.NameList) error {
	if s.key == nil && istiodebug.IsDebugType(req.GetTypeUrl()) {
		list, err := names.Decode()
		if err != nil {
			return status.Error(codes.InvalidArgument, err.Error())
		}
		return s.srv.host.answerDebugSotW(s, req, list)
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
	if err := s.checkNames(typeURL, names.Len()); err != nil {
		return err
	}
	decoded := func() (xds.NameSet, error) {
		list, err := names.Decode()
		if err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
		return xds.NewNameSet(list), nil
	}
	if !xds.Cached(typeURL) {
		list, err := names.Decode()
		if err != nil {
			return status.Error(codes.InvalidArgument, err.Error())
		}
		req.ResourceNames = list
		return s.passthroughSotW(req)
	}
	explicit := names.Wildcard()

	sub := s.subs[typeURL]
	if sub == nil {
		set, err := decoded()
		if err != nil {
			return err
		}
		legacy := names.Len() == 0 && xds.LegacyWildcard(typeURL)
		sub = s.newSub(typeURL, explicit || legacy, legacy, set)
		sub.listID = names.ID()
		if v := req.GetVersionInfo(); v != "" {
			// What the client holds, from another relay or an earlier
			// stream: settled against the view in sync. A version that is
			// not the relay's stands for nothing held (the view is sent).
			var o ledger.Order
			sub.claimed, o, _ = wire.ParseVersion(v)
			if !s.srv.cache.placed(o, s.peerRelay != nil) {
				o = s.srv.cache.declaredBound()
			}
			sub.orders = sub.orders.add(o)
			sub.declared = !sub.claimed.IsZero()
		}
		return nil
	}
	if req.GetResponseNonce() != sub.nonce {
		// A SotW request is answered only if it refers to the latest
		// response of its type (xDS protocol); older ones are stale.
		s.log.Debug("stale nonce", "type", xds.ShortType(typeURL), "nonce", req.GetResponseNonce(), "want", sub.nonce)
		return nil
	}
	if sub.nonce != "" {
		s.ack(sub, sub.sent, nackDetail(req.GetErrorDetail()), true)
	}
	wildcard := explicit || (sub.legacy && names.Len() == 0)
	if wildcard == sub.wildcard && names.Same(&sub.listID) {
		return nil // the same subscription again: an ACK or a NACK
	}
	set, err := decoded()
	if err != nil {
		return err
	}
	sub.listID = names.ID()
	s.resubscribe(sub, wildcard, set, nil)
	return nil
}

// maxQueuedRequests bounds the requests a client may have waiting while the
// relay is busy writing to it. An Envoy sends about one request per response
// it reads, so this is far more than flow control lets an honest client have.
const maxQueuedRequests = 4096

// maxQueuedBytes bounds the same in bytes: a few thousand large requests
// would otherwise hold gigabytes for one client.
const maxQueuedBytes = 64 << 20

// expiryFloor is the least time a stream whose credential expires is
// served: enough to take its config once.
const expiryFloor = 5 * time.Second

// serve runs a stream's handler loop: requests, wake-ups from the key, and
// passthrough responses, then a sync. It returns when the client goes away
// or a request is refused. Requests are read on a goroutine of their own
// into a mailbox, so that the relay keeps reading a client while it is
// blocked writing to it.
func serve[Req any](s *stream, recv func() (Req, error), sizeOf func(Req) int, handle func(Req) error, release func(Req)) (err error) {
	defer s.close()
	defer func() {
		if err != nil {
			code := status.Code(err)
			s.srv.metrics.StreamErrors.WithLabelValues(code.String()).Inc()
			s.log.Debug("stream ended", "code", code, "err", err)
		}
	}()
	if sizeOf == nil {
		sizeOf = func(Req) int { return 0 }
	}
	reqs := newMailbox(maxQueuedRequests, maxQueuedBytes, sizeOf)
	if release == nil {
		release = func(Req) {}
	}
	// Requests never handled give their buffers back; once the mailbox is
	// closed, the reader releases what it reads itself.
	defer func() {
		reqs.close()
		for _, req := range reqs.take() {
			release(req)
		}
	}()
	// A large request (admission.Floor and more) is handled under the relay's
	// budget: the handler takes its bytes, decodes and applies it, and
	// gives them back before it writes to anyone, so a client that does
	// not read holds none of it. Meanwhile the reader reads nothing more
	// from the client, so it has one large request in hand at most.
	largeDone := make(chan struct{}, 1)
	// A stream lasts as long as the credential it was admitted with: at
	// its expiry the client reconnects with the one it has refreshed
	// (nothing is sent again: versions are content). One admitted inside
	// the verifier's leeway for clock skew gets expiryFloor.
	var expired <-chan time.Time
	if s.identity != nil && !s.identity.Expires.IsZero() {
		t := time.NewTimer(max(time.Until(s.identity.Expires), expiryFloor))
		defer t.Stop()
		expired = t.C
	}
	errc := make(chan error, 1)
	go func() {
		for {
			req, err := recv()
			if err != nil {
				errc <- err
				return
			}
			large := sizeOf(req) >= admission.Floor
			if !reqs.put(req) {
				release(req)
				if reqs.isClosed() {
					return
				}
				errc <- status.Errorf(codes.ResourceExhausted, "more than %d requests or %d MiB sent without reading the responses",
					maxQueuedRequests, maxQueuedBytes>>20)
				return
			}
			if large {
				select {
				case <-largeDone:
				case <-s.ctx.Done():
					return
				}
			}
		}
	}()
	for {
		select {
		case <-reqs.ready:
			batch := reqs.take()
			for i, req := range batch {
				n, err := s.srv.budget.Take(s.ctx, sizeOf(req))
				if err == nil {
					err = handle(req)
					s.srv.budget.Put(n)
				} else {
					release(req)
				}
				if n > 0 {
					largeDone <- struct{}{}
				}
				if err != nil {
					for _, rest := range batch[i+1:] {
						release(rest)
					}
					return err
				}
			}
		case <-s.wake:
			s.dirty = true
		case q := <-s.dumps:
			q.reply <- dumpReply{key: s.key, types: s.sent(q.types)}
		case m := <-s.passOut():
			if err := s.forward(m); err != nil {
				return err
			}
		case err := <-s.passRefused():
			return err
		case err := <-errc:
			return recvError(err)
		case <-s.evict:
			s.srv.metrics.Shed.WithLabelValues("share").Inc()
			return status.Error(codes.Unavailable, "relay at its stream bound, and another identity's share was due: reconnect")
		case <-expired:
			return status.Error(codes.Unauthenticated, "the credential this stream was admitted with expired: reconnect with a fresh one")
		case <-s.ctx.Done():
			return nil
		case <-s.srv.stopping:
			return status.Error(codes.Unavailable, "relay is shutting down")
		}
		// A plain ACK changes nothing to send: only subscription changes
		// and new views need a sync.
		if s.dirty {
			s.dirty = false
			if err := s.sync(); err != nil {
				return err
			}
		}
	}
}
