package relay

import (
	"errors"
	"fmt"
	"net"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger/ledgerpb"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/wire"
)

// listen opens the listeners the config asks for: plaintext xDS, TLS xDS
// and peer (any may be nil; validate made sure one xDS port is not).
func (r *Relay) listen() (lis, tlsLis, peerLis net.Listener, err error) {
	open := func(given net.Listener, addr string) (net.Listener, error) {
		if given != nil || addr == "" {
			return given, nil
		}
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("relay: listen %s: %w", addr, err)
		}
		return l, nil
	}
	if lis, err = open(r.cfg.XDS.Listener, r.cfg.XDS.Listen); err != nil {
		return nil, nil, nil, err
	}
	if r.cfg.XDS.TLS != nil {
		if tlsLis, err = open(r.cfg.XDS.TLSListener, r.cfg.XDS.TLSListen); err != nil {
			closeAll(lis)
			return nil, nil, nil, err
		}
	}
	if peerLis, err = open(r.cfg.Tier.Listener, r.cfg.Tier.Listen); err != nil {
		closeAll(lis, tlsLis)
		return nil, nil, nil, err
	}
	return lis, tlsLis, peerLis, nil
}

func closeAll(ls ...net.Listener) {
	for _, l := range ls {
		if l != nil {
			l.Close()
		}
	}
}

// hasPeerPort reports whether the tier's relays have a port of their own.
func (r *Relay) hasPeerPort() bool { return r.cfg.Tier.Listen != "" || r.cfg.Tier.Listener != nil }

// serveXDS serves the relay's gRPC services (ADS, and the tier's ledger
// and inspect exchanges) on lis, as port p, until Stop.
func (r *Relay) serveXDS(lis net.Listener, p port, opts ...grpc.ServerOption) {
	srv := grpc.NewServer(append([]grpc.ServerOption{
		grpc.ForceServerCodecV2(wire.NewCodec()),
		// Stop returns only once every handler has: no stream attaches a
		// key (and starts its goroutine) behind Stop's back.
		grpc.WaitForHandlers(true),
		// Thousands of mostly idle Envoy connections: give each
		// connection's write buffer back between writes.
		grpc.SharedWriteBuffer(true),
		// Fixed receive windows: gRPC's default estimates bandwidth by
		// pinging a client whenever data comes in, which an ACK does: two
		// reads more per Envoy per push, for a few hundred bytes. A window
		// of 1 MiB takes a large Delta reconnect (its
		// initial_resource_versions) at LAN speed, and bounds what one
		// connection can make the relay buffer.
		grpc.InitialWindowSize(1 << 20),
		grpc.InitialConnWindowSize(1 << 20),
		grpc.MaxRecvMsgSize(r.maxRecv(p)),
		grpc.MaxSendMsgSize(r.cfg.MaxMsgSize),
		// A stream's metadata is a token and a few short values: refuse
		// a flood of headers before it is held in memory (grpc-go's
		// default allows 16 MiB).
		grpc.MaxHeaderListSize(maxHeaderListBytes),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	}, append(append(r.connectionLimits(p), opts...), r.cfg.XDS.serverOptions...)...)...)
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, adsService{r, p})
	ledgerpb.RegisterLedgerServer(srv, ledgerServer{r: r, port: p})
	inspectpb.RegisterInspectServer(srv, inspectServer{r: r, port: p})
	r.servers = append(r.servers, srv)
	r.serveWG.Add(1)
	go func() {
		defer r.serveWG.Done()
		if err := srv.Serve(r.tracker.track(lis)); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			r.log.Error("xDS server stopped", "port", p, "addr", lis.Addr().String(), "err", err)
		}
	}()
}

// maxRecv is the largest message port p takes: an Envoy's request is
// bounded by what a real one sends (XDS.MaxRequestBytes); the tier's
// relays, proven, by MaxMsgSize.
func (r *Relay) maxRecv(p port) int {
	if p == portPeer {
		return r.cfg.MaxMsgSize
	}
	return min(r.cfg.XDS.MaxRequestBytes, r.cfg.MaxMsgSize)
}

// adsService is the ADS server of one port.
type adsService struct {
	r    *Relay
	port port
}

func (a adsService) StreamAggregatedResources(ss discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	return a.r.srv.serveSotW(ss, a.port)
}

func (a adsService) DeltaAggregatedResources(ds discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	return a.r.srv.serveDelta(ds, a.port)
}

// checkPort refuses what port p does not serve: relay-to-relay traffic
// (isPeer) anywhere but on the peer port when there is one, and anything
// else on it.
func (r *Relay) checkPort(p port, isPeer bool) error {
	switch {
	case p == portPeer && !isPeer:
		return status.Error(codes.PermissionDenied, "this port serves the tier's relays only: Envoys dial the xDS port")
	case p != portPeer && isPeer && r.hasPeerPort():
		return status.Error(codes.PermissionDenied, "relay-to-relay traffic goes to the peer port")
	}
	return nil
}

// peerProvenByTLS reports whether a relay-to-relay call on port p is
// proven by the peer port's mTLS handshake (Tier.TLS verified the
// certificate and its identity), so that no secret proof is needed.
func (r *Relay) peerProvenByTLS(p port) bool { return p == portPeer && r.cfg.Tier.TLS != nil }

// unprovenPeer reports whether a call on port p that names itself a relay
// must be refused for lack of any proof: on the authenticating TLS port,
// without a peer secret, believing it would skip authentication.
func (r *Relay) unprovenPeer(p port) bool {
	return p == portTLS && r.cfg.XDS.Authenticator != nil && len(r.cfg.Tier.Secret) == 0
}

// PeerAddr returns the address the tier's relays dial for this one (after
// Start): its peer port's, else its plaintext xDS port's, or nil.
func (r *Relay) PeerAddr() net.Addr {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.peerLis != nil:
		return r.peerLis.Addr()
	case r.lis != nil:
		return r.lis.Addr()
	}
	return nil
}

// peerStreamsPerConnection bounds the streams one relay may open on a
// connection to the peer port: one per key it subscribes to here.
const peerStreamsPerConnection = 1 << 16

// connectionLimits returns the server options that bound a connection on
// port p: its open streams (XDS.MaxStreamsPerConnection) and its age
// (XDS.MaxConnectionAge). On a port the tier's relays dial (the peer
// port, or the plaintext xDS port of a tier without one) a connection may
// carry a stream per key, and is not aged: it carries every key's stream
// between two relays, which would all end at once.
func (r *Relay) connectionLimits(p port) []grpc.ServerOption {
	// Generous keepalive: a loaded Envoy (or a loaded 2-core benchmark)
	// may be slow to answer a ping, and a dropped connection costs a
	// reconnect.
	ka := keepalive.ServerParameters{Time: time.Minute, Timeout: 20 * time.Second}
	streams := r.cfg.XDS.MaxStreamsPerConnection
	peersDial := p == portPeer ||
		p == portPlain && r.cfg.Tier.Owners != nil && r.cfg.Tier.Listen == "" && r.cfg.Tier.Listener == nil
	if peersDial {
		streams = peerStreamsPerConnection
	} else if r.cfg.XDS.MaxConnectionAge > 0 {
		ka.MaxConnectionAge, ka.MaxConnectionAgeGrace = r.cfg.XDS.MaxConnectionAge, r.cfg.XDS.MaxConnectionAgeGrace
	}
	return []grpc.ServerOption{grpc.MaxConcurrentStreams(streams), grpc.KeepaliveParams(ka)}
}

// maxHeaderListBytes bounds a call's metadata: an authorization header
// (auth.MaxTokenBytes) and the rest with room to spare.
const maxHeaderListBytes = 64 << 10
