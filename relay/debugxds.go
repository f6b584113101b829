package relay

import (
	"encoding/json"
	"errors"
	"runtime/debug"
	"strconv"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statusv3 "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// istiod answers two debug type URLs on its ADS port, and istioctl asks
// them (istioctl proxy-status --xds-address, istioctl x internal-debug):
// the relay answers them for the whole tier, the way istiod does, rather
// than passing them through to the upstream (which knows none of the
// tier's Envoys).
const (
	// typeDebugSyncz lists the Envoys, each as a CSDS ClientConfig with the
	// status of each type.
	typeDebugSyncz = "istio.io/debug/syncz"
	// typeDebugConfigDump returns the config dump of the node named in
	// resource_names, as the sections of Envoy's config dump.
	typeDebugConfigDump = "istio.io/debug/config_dump"
)

// synczTypes are the types a syncz answer gives the status of, as istiod's.
var synczTypes = []string{xds.TypeListener, xds.TypeRoute, xds.TypeEndpoint, xds.TypeCluster, xds.TypeExtension}

// answerDebugSotW answers a SotW request for a debug type URL. A debug
// client is not an Envoy: its stream joins no key. An ACK or a NACK of an
// answer (a request with a response nonce) is not answered again.
func (s *stream) answerDebugSotW(typeURL, responseNonce string, names []string) error {
	if responseNonce != "" {
		return nil
	}
	res, err := s.debugResources(typeURL, names)
	if err != nil {
		return err
	}
	s.nonce++
	return s.sendRaw(&discovery.DiscoveryResponse{TypeUrl: typeURL, Resources: res,
		VersionInfo: strconv.FormatInt(time.Now().UnixNano(), 10), Nonce: strconv.FormatUint(s.nonce, 10),
		ControlPlane: s.r.debugControlPlane()})
}

// answerDebugDelta answers a Delta request for a debug type URL.
func (s *stream) answerDebugDelta(req *discovery.DeltaDiscoveryRequest) error {
	if req.GetResponseNonce() != "" {
		return nil
	}
	res, err := s.debugResources(req.GetTypeUrl(), req.GetResourceNamesSubscribe())
	if err != nil {
		return err
	}
	s.nonce++
	out := &discovery.DeltaDiscoveryResponse{TypeUrl: req.GetTypeUrl(), SystemVersionInfo: strconv.FormatInt(time.Now().UnixNano(), 10),
		Nonce: strconv.FormatUint(s.nonce, 10), ControlPlane: s.r.debugControlPlane()}
	for i, a := range res {
		out.Resources = append(out.Resources, &discovery.Resource{Name: strconv.Itoa(i), Resource: a})
	}
	return s.sendRaw(out)
}

func isDebugType(typeURL string) bool {
	return typeURL == typeDebugSyncz || typeURL == typeDebugConfigDump
}

// debugCaller decides what a debug stream may see, by its port:
//
//   - the plaintext port, if trusted (Authorizer AllowAll, as istiod's
//     15010), answers everything; with an Authorizer a stream proves only
//     that it may have its own node's config, not every node's;
//   - the TLS port answers a stream that proved an identity (istioctl
//     sends its service-account token) as the admin API would
//     (identityCaller): everything for Config.AdminIdentities, the
//     identity's own namespace for any other;
//   - the peer port serves the tier's relays, which ask no debug types.
//
// Anything else is PermissionDenied, saying what would be answered.
func (s *stream) debugCaller(typeURL string) (AdminCaller, error) {
	switch s.port {
	case portPlain:
		if _, trusted := s.r.cfg.Authorizer.(AllowAll); trusted {
			return AdminCaller{Admin: true}, nil
		}
		return AdminCaller{}, status.Errorf(codes.PermissionDenied,
			"%s is not answered on this plaintext port (it has an Authorizer): ask over the TLS port with a service-account token, or ask the admin API (relayctl)", typeURL)
	case portTLS:
		switch {
		case s.identity != nil:
			return s.r.identityCaller(*s.identity), nil
		case s.peerRelay != nil:
			return AdminCaller{}, status.Errorf(codes.PermissionDenied, "%s is not answered for the tier's relays", typeURL)
		}
		return AdminCaller{}, status.Errorf(codes.PermissionDenied,
			"%s on the TLS port is answered only for a stream that proved an identity, and this relay authenticates no one there (--xds-auth none): ask the admin API (relayctl)", typeURL)
	}
	return AdminCaller{}, status.Errorf(codes.PermissionDenied, "%s is not answered on the peer port: it serves the tier's relays only", typeURL)
}

// debugResources answers a debug type URL for the tier, as much of it as
// the stream's caller may see: syncz lists the Envoys of the keys it sees;
// config_dump refuses a node whose id names another namespace
// (PermissionDenied, whether or not it exists) and answers a node whose
// key the caller does not see as one the tier does not hold (nothing, as
// istiod answers for a node not connected to it).
func (s *stream) debugResources(typeURL string, names []string) ([]*anypb.Any, error) {
	c, err := s.debugCaller(typeURL)
	if err != nil {
		return nil, err
	}
	r, ctx := s.r, s.ctx
	if typeURL == typeDebugSyncz {
		return r.syncz(r.TierLedger(ctx, ledger.Scope{}, ledger.Full), c)
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

// syncz lists the tier's connected Envoys of the keys c sees as istiod's
// syncz does: a CSDS ClientConfig each, with the status of each type
// istiod reports (types it never subscribed to are NOT_SENT; a NACK is
// ERROR).
func (r *Relay) syncz(tl TierLedger, c AdminCaller) ([]*anypb.Any, error) {
	var out []*anypb.Any
	for _, e := range tl.Envoys() {
		if !e.State.Connected() || !c.SeesKey(e.Key) {
			continue
		}
		cc := &statusv3.ClientConfig{Node: &core.Node{Id: e.State.Node}}
		for _, typeURL := range synczTypes {
			gc := &statusv3.ClientConfig_GenericXdsConfig{TypeUrl: typeURL, ConfigStatus: statusv3.ConfigStatus_NOT_SENT}
			for _, et := range e.State.Types {
				if et.Type != typeURL {
					continue
				}
				switch tl.Status(e, et) {
				case ledger.StatusSynced:
					gc.ConfigStatus, gc.LastUpdated = statusv3.ConfigStatus_SYNCED, timestamppb.New(et.AckedAt)
				case ledger.StatusNACKed:
					gc.ConfigStatus = statusv3.ConfigStatus_ERROR
				case ledger.StatusStale:
					gc.ConfigStatus = statusv3.ConfigStatus_STALE
				}
			}
			cc.GenericXdsConfigs = append(cc.GenericXdsConfigs, gc)
		}
		a, err := anypb.New(cc)
		if err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		out = append(out, a)
	}
	return out, nil
}

// debugControlPlane identifies the relay to istioctl, which reads the
// identifier of a debug answer as istiod's JSON (component, ID, build
// info).
func (r *Relay) debugControlPlane() *core.ControlPlane {
	type buildInfo struct {
		Version string `json:"version"`
	}
	id := struct {
		Component string
		ID        string
		Info      buildInfo
	}{Component: "meshrelay", ID: r.cfg.ID, Info: buildInfo{Version: "unknown"}}
	if bi, ok := debug.ReadBuildInfo(); ok {
		id.Info.Version = bi.Main.Version
	}
	b, _ := json.Marshal(id)
	return &core.ControlPlane{Identifier: string(b)}
}
