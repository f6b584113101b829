package relay

import (
	"errors"
	"slices"
	"strconv"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/admin"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/istiodebug"
)

// istiod answers two debug type URLs on its ADS port (relay/istiodebug
// builds the answers): a debug client is not an Envoy, its stream joins no
// key, and what it may see depends on the port it came in on
// (debugCaller).

// answerDebugSotW answers a SotW request for a debug type URL. A debug
// client is not an Envoy: its stream joins no key.
func (r *Relay) answerDebugSotW(s *stream, req *discovery.DiscoveryRequest, names []string) error {
	typeURL := req.GetTypeUrl()
	if s.debugAnswered(typeURL, req.GetResponseNonce(), names, req.GetErrorDetail() != nil, false) {
		return nil
	}
	res, err := r.debugResources(s, typeURL, names)
	if err != nil {
		return err
	}
	return s.sendRaw(&discovery.DiscoveryResponse{TypeUrl: typeURL, Resources: res,
		VersionInfo: strconv.FormatInt(time.Now().UnixNano(), 10), Nonce: s.debugNonce(typeURL, names),
		ControlPlane: istiodebug.ControlPlane(r.cfg.ID)})
}

// answerDebugDelta answers a Delta request for a debug type URL, by the
// same rule.
func (r *Relay) answerDebugDelta(s *stream, req *discovery.DeltaDiscoveryRequest) error {
	typeURL, names := req.GetTypeUrl(), req.GetResourceNamesSubscribe()
	if s.debugAnswered(typeURL, req.GetResponseNonce(), names, req.GetErrorDetail() != nil, true) {
		return nil
	}
	res, err := r.debugResources(s, typeURL, names)
	if err != nil {
		return err
	}
	out := &discovery.DeltaDiscoveryResponse{TypeUrl: typeURL, SystemVersionInfo: strconv.FormatInt(time.Now().UnixNano(), 10),
		Nonce: s.debugNonce(typeURL, names), ControlPlane: istiodebug.ControlPlane(r.cfg.ID)}
	for i, a := range res {
		out.Resources = append(out.Resources, &discovery.Resource{Name: strconv.Itoa(i), Resource: a})
	}
	return s.sendRaw(out)
}

// debugCaller decides what a debug stream may see, by its port:
//
//   - the plaintext port, if trusted (Authorizer AllowAll, as istiod's
//     15010), answers everything; with an Authorizer a stream proves only
//     that it may have its own node's config, not every node's;
//   - the TLS port answers a stream that proved an identity (istioctl
//     sends a token of istio-system's default account): the whole tier
//     for an identity of Config.Admin.DebugNamespaces (istiod's rule for its
//     root namespace) or of Config.Admin.Identities, the identity's own
//     namespace for any other;
//   - the peer port serves the tier's relays, which ask no debug types.
//
// Anything else is PermissionDenied, saying what would be answered.
func (r *Relay) debugCaller(s *stream, typeURL string) (admin.Caller, error) {
	switch s.port {
	case portPlain:
		if _, trusted := r.cfg.XDS.Authorizer.(AllowAll); trusted {
			return admin.Caller{Admin: true}, nil
		}
		return admin.Caller{}, status.Errorf(codes.PermissionDenied,
			"%s is not answered on this plaintext port (it has an Authorizer): ask over the TLS port with a service-account token, or ask the admin API (relayctl)", typeURL)
	case portTLS:
		switch {
		case s.identity != nil:
			if slices.Contains(r.cfg.Admin.DebugNamespaces, s.identity.Namespace) {
				// Reads the tier, as istiod answers its root namespace.
				return admin.Caller{Admin: true, Identity: s.identity.SPIFFEID()}, nil
			}
			return r.adminGuard.IdentityCaller(*s.identity), nil
		case s.peerRelay != nil:
			return admin.Caller{}, status.Errorf(codes.PermissionDenied, "%s is not answered for the tier's relays", typeURL)
		}
		return admin.Caller{}, status.Errorf(codes.PermissionDenied,
			"%s on the TLS port is answered only for a stream that proved an identity, and this relay authenticates no one there (--xds-auth none): ask the admin API (relayctl)", typeURL)
	}
	return admin.Caller{}, status.Errorf(codes.PermissionDenied, "%s is not answered on the peer port: it serves the tier's relays only", typeURL)
}

// debugResources answers a debug type URL for the tier, as much of it as
// the stream's caller may see: syncz lists the Envoys of the keys it sees;
// config_dump refuses a node whose id names another namespace
// (PermissionDenied, whether or not it exists) and answers a node whose
// key the caller does not see as one the tier does not hold (nothing, as
// istiod answers for a node not connected to it).
func (r *Relay) debugResources(s *stream, typeURL string, names []string) ([]*anypb.Any, error) {
	c, err := r.debugCaller(s, typeURL)
	if err != nil {
		return nil, err
	}
	ctx := s.ctx
	if typeURL == istiodebug.TypeSyncz {
		syncz, err := istiodebug.Syncz(r.TierLedger(ctx, ledger.Scope{}, ledger.Full).Report, c.SeesKey)
		if err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		return syncz, nil
	}
	if len(names) != 1 {
		return nil, status.Errorf(codes.InvalidArgument, "%s wants one resource name, the node id; got %d", typeURL, len(names))
	}
	if !c.MayAskNode(names[0]) {
		return nil, status.Errorf(codes.PermissionDenied, "%s: %s may ask only for nodes of its own namespace", typeURL, c)
	}
	d, _, err := r.TierConfigDump(ctx, &inspectpb.ConfigDumpRequest{Node: names[0]})
	if err == nil && !c.SeesKey(d.GetKey()) {
		// Its id names no namespace, or the caller's, but its key is
		// another's: as if it were not there.
		err = ErrNotHeld
	}
	if errors.Is(err, ErrNotHeld) {
		// As istiod: no such connection here is an empty answer.
		r.log.Debug("config dump: node not on the tier", "node", names[0])
		return nil, nil
	}
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	var dump adminv3.ConfigDump
	if err := d.GetConfigDump().UnmarshalTo(&dump); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return dump.GetConfigs(), nil
}
