// Package adsclient is the relay's ADS client: one stream, SotW or Delta,
// to a control plane (istiod, or the relay that owns a key). It owns the
// transport, as grpc-go's xdsclient splits its ADS stream from the
// authority that decides what to ask: the stream's two goroutines, flow
// control (requests are queued, bounded, so that writing never stops the
// reading of responses), the node on the first request, and each type's
// nonce and ACKed version. What to subscribe to, and what a response
// means, stay with the caller: the key's feed, the divergence check,
// passthrough.
//
// Responses are read lazily off the wire (wire.SotWIn, wire.DeltaIn): a
// resource's bytes stay in gRPC's buffer until the caller decodes them,
// and the caller Releases each response once handled. A caller that
// passes responses on as they are reads them whole instead
// (Config.Decoded).
package adsclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Config configures a Stream.
type Config struct {
	// Delta selects the incremental protocol; false: State of the World.
	Delta bool
	// Node is sent on the stream's first request (as the protocol asks),
	// whichever request that is.
	Node *core.Node
	// MaxQueued bounds the requests queued and not yet taken by the
	// stream's writer (which takes them all at once, and writes them
	// while more queue); past it Send fails, and the caller should end
	// the stream: a control plane that reads nothing for that long is
	// stuck. Default (0) 4096.
	MaxQueued int
	// Decoded reads each response whole (SotWResponse, DeltaResponse),
	// for a caller that passes responses on as they are; false reads them
	// lazily (*wire.SotWIn, *wire.DeltaIn), for a caller that looks into
	// each resource and keeps only what it lacks.
	Decoded bool
	// CallOptions are passed on opening the stream (e.g.
	// grpc.MaxCallRecvMsgSize). The stream always uses the codec of
	// package wire.
	CallOptions []grpc.CallOption
}

// Response is a response as the stream reads it: *wire.SotWIn or
// *wire.DeltaIn, or with Config.Decoded SotWResponse or DeltaResponse.
// Release it once handled.
type Response interface {
	GetTypeUrl() string
	GetNonce() string
	Release()
}

// SotWResponse is a SotW response read whole (Config.Decoded).
type SotWResponse struct{ *discovery.DiscoveryResponse }

// DeltaResponse is a Delta response read whole (Config.Decoded).
type DeltaResponse struct {
	*discovery.DeltaDiscoveryResponse
}

// Release does nothing: a decoded response holds no buffer of gRPC's.
func (SotWResponse) Release() {}

// Release does nothing: a decoded response holds no buffer of gRPC's.
func (DeltaResponse) Release() {}

// Stream is one ADS stream. Open it, read Responses until Err yields,
// and Close it. Send, Subscribe, ACK and NACK may be called from any
// goroutine; they never block on the network.
type Stream struct {
	cfg    Config
	cs     grpc.ClientStream
	cancel context.CancelFunc
	wg     sync.WaitGroup

	in    chan Response
	errs  chan error
	ready chan struct{} // signalled when queue gains requests

	mu sync.Mutex
	// queue holds the requests waiting to be written, at most
	// Config.MaxQueued. It grows as requests come (a stream that asks
	// little holds little: a relay runs a stream per key).
	queue   []proto.Message
	first   bool              // the next request is the first: it carries the node
	trailer metadata.MD       // set when a receive failed
	types   map[string]*state // what each type was asked, and its last response
}

// state is one type's standing on the stream.
type state struct {
	subscribed bool
	wildcard   bool
	named      bool        // SotW: the stream named resources of the type
	names      xds.NameSet // subscribed by name
	acked      string      // SotW: version_info last ACKed
	nonce      string      // of the latest response
}

// ErrQueueFull is returned by Send when MaxQueued requests wait.
var ErrQueueFull = errors.New("adsclient: the control plane reads no requests")

// Open opens an ADS stream on conn; ctx bounds it. Its goroutines run
// until Close.
func Open(ctx context.Context, conn grpc.ClientConnInterface, cfg Config) (*Stream, error) {
	if cfg.MaxQueued <= 0 {
		cfg.MaxQueued = 4096
	}
	sctx, cancel := context.WithCancel(ctx)
	client := discovery.NewAggregatedDiscoveryServiceClient(conn)
	opts := append(slices.Clone(cfg.CallOptions), grpc.ForceCodecV2(wire.NewCodec()))
	var cs grpc.ClientStream
	var err error
	if cfg.Delta {
		cs, err = client.DeltaAggregatedResources(sctx, opts...)
	} else {
		cs, err = client.StreamAggregatedResources(sctx, opts...)
	}
	if err != nil {
		cancel()
		return nil, fmt.Errorf("open %s stream: %w", protocolName(cfg.Delta), err)
	}
	s := &Stream{
		cfg: cfg, cs: cs, cancel: cancel,
		in:    make(chan Response),
		ready: make(chan struct{}, 1),
		errs:  make(chan error, 2),
		first: true,
		types: make(map[string]*state),
	}
	s.wg.Go(func() { s.receive(sctx) })
	s.wg.Go(func() { s.write(sctx) })
	return s, nil
}

func protocolName(delta bool) string {
	if delta {
		return "delta"
	}
	return "sotw"
}

// receive reads responses into s.in until the stream fails or ends.
func (s *Stream) receive(ctx context.Context) {
	for {
		m, into := s.newResponse()
		if err := s.cs.RecvMsg(into); err != nil {
			// The trailer is final once a receive failed (grpc-go's
			// contract): kept for Trailer, whatever ends the stream.
			trailer := s.cs.Trailer()
			s.mu.Lock()
			s.trailer = trailer
			s.mu.Unlock()
			s.errs <- err
			return
		}
		s.mu.Lock()
		s.stateOf(m.GetTypeUrl()).nonce = m.GetNonce()
		s.mu.Unlock()
		select {
		case s.in <- m:
		case <-ctx.Done():
			m.Release()
			return
		}
	}
}

// newResponse returns an empty response of the stream's kind, and the
// message to read it into.
func (s *Stream) newResponse() (Response, any) {
	switch {
	case s.cfg.Delta && s.cfg.Decoded:
		r := DeltaResponse{new(discovery.DeltaDiscoveryResponse)}
		return r, r.DeltaDiscoveryResponse
	case s.cfg.Decoded:
		r := SotWResponse{new(discovery.DiscoveryResponse)}
		return r, r.DiscoveryResponse
	case s.cfg.Delta:
		r := new(wire.DeltaIn)
		return r, r
	default:
		r := new(wire.SotWIn)
		return r, r
	}
}

// write writes queued requests until the stream fails or ends. A write
// that finds the stream ended (io.EOF) reports nothing: the receiver
// reports why it ended, the status the control plane gave.
func (s *Stream) write(ctx context.Context) {
	for {
		select {
		case <-s.ready:
			s.mu.Lock()
			batch := s.queue
			s.queue = nil
			s.mu.Unlock()
			for _, m := range batch {
				if err := s.cs.SendMsg(m); err != nil {
					if !errors.Is(err, io.EOF) {
						s.errs <- err
					}
					return
				}
			}
		case <-ctx.Done():
			return
		}
	}
}

// Responses yields the stream's responses in order.
func (s *Stream) Responses() <-chan Response { return s.in }

// Err yields the stream's failure: io.EOF or the status the control
// plane ended it with, or the error of a write.
func (s *Stream) Err() <-chan error { return s.errs }

// Header returns the header the control plane sent, waiting for it.
func (s *Stream) Header() (metadata.MD, error) { return s.cs.Header() }

// Trailer returns the trailer the control plane ended the stream with:
// nil until the stream's receiver saw the end (Err yields then; after
// Close it is final).
func (s *Stream) Trailer() metadata.MD {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.trailer
}

// Close ends the stream and waits for its goroutines. Idempotent.
func (s *Stream) Close() {
	s.cancel()
	s.wg.Wait()
}

// Send queues m (a DiscoveryRequest or a DeltaDiscoveryRequest, as the
// stream's protocol) for writing, the node set on the stream's first
// request. The stream owns m from now on. For callers that build their own
// requests; Subscribe, ACK and NACK build them from the stream's state.
func (s *Stream) Send(m proto.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sendLocked(m)
}

func (s *Stream) sendLocked(m proto.Message) error {
	switch r := m.(type) {
	case *discovery.DiscoveryRequest:
		if s.cfg.Delta {
			return errors.New("adsclient: a SotW request on a Delta stream")
		}
		if s.first {
			r.Node = s.cfg.Node
		}
	case *discovery.DeltaDiscoveryRequest:
		if !s.cfg.Delta {
			return errors.New("adsclient: a Delta request on a SotW stream")
		}
		if s.first {
			r.Node = s.cfg.Node
		}
	default:
		return fmt.Errorf("adsclient: %T is no ADS request", m)
	}
	if len(s.queue) >= s.cfg.MaxQueued {
		return ErrQueueFull
	}
	s.queue = append(s.queue, m)
	s.first = false
	select {
	case s.ready <- struct{}{}:
	default: // the writer is signalled already
	}
	return nil
}

func (s *Stream) stateOf(typeURL string) *state {
	st := s.types[typeURL]
	if st == nil {
		st = &state{}
		s.types[typeURL] = st
	}
	return st
}

// Subscribe sets typeURL's subscription: every resource (wildcard), and
// names. SotW asks the whole set again, with the version last ACKed and
// the latest nonce; Delta sends what changed, or, first, the set.
func (s *Stream) Subscribe(typeURL string, wildcard bool, names []string) error {
	set := xds.NewNameSet(names)
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stateOf(typeURL)
	var req proto.Message
	if s.cfg.Delta {
		r := &discovery.DeltaDiscoveryRequest{TypeUrl: typeURL}
		if !st.subscribed {
			r.ResourceNamesSubscribe = set
			if wildcard {
				r.ResourceNamesSubscribe = append([]string{xds.WildcardName}, set...)
			}
		} else {
			r.ResourceNamesSubscribe, r.ResourceNamesUnsubscribe = st.names.Diff(set)
			if wildcard && !st.wildcard {
				r.ResourceNamesSubscribe = append(r.ResourceNamesSubscribe, xds.WildcardName)
			}
			if !wildcard && st.wildcard {
				r.ResourceNamesUnsubscribe = append(r.ResourceNamesUnsubscribe, xds.WildcardName)
			}
		}
		req = r
	} else {
		rn := xds.SotWResourceNames(wildcard, set, st.named)
		st.named = st.named || len(rn) > 0
		req = &discovery.DiscoveryRequest{TypeUrl: typeURL, VersionInfo: st.acked, ResourceNames: rn, ResponseNonce: st.nonce}
	}
	if err := s.sendLocked(req); err != nil {
		return err
	}
	st.subscribed, st.wildcard, st.names = true, wildcard, set
	return nil
}

// ACK accepts resp. A SotW ACK of a type the stream never subscribed to
// sends nothing: it would subscribe to it.
func (s *Stream) ACK(resp Response) error {
	return s.answer(resp, nil)
}

// NACK refuses resp, saying why: the control plane keeps the stream on
// the version last ACKed.
func (s *Stream) NACK(resp Response, cause error) error {
	return s.answer(resp, &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: cause.Error()})
}

func (s *Stream) answer(resp Response, nack *rpcstatus.Status) error {
	typeURL := resp.GetTypeUrl()
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stateOf(typeURL)
	if s.cfg.Delta {
		return s.sendLocked(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResponseNonce: resp.GetNonce(), ErrorDetail: nack})
	}
	if !st.subscribed {
		return nil
	}
	if nack == nil {
		if r, ok := resp.(interface{ GetVersionInfo() string }); ok { // *wire.SotWIn, SotWResponse
			st.acked = r.GetVersionInfo()
		}
	}
	return s.sendLocked(&discovery.DiscoveryRequest{TypeUrl: typeURL, VersionInfo: st.acked,
		ResourceNames: xds.SotWResourceNames(st.wildcard, st.names, st.named), ResponseNonce: resp.GetNonce(), ErrorDetail: nack})
}
