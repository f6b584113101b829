package relay

import (
	"context"
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
var synczTypes = []string{typeListener, typeRoute, typeEndpoint, typeCluster, typeExtension}

// answerDebugSotW answers a SotW request for a debug type URL. A debug
// client is not an Envoy: its stream joins no key. An ACK or a NACK of an
// answer (a request with a response nonce) is not answered again.
func (s *stream) answerDebugSotW(typeURL, responseNonce string, names []string) error {
	if responseNonce != "" {
		return nil
	}
	res, err := s.r.debugResources(s.ctx, s.port, typeURL, names)
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
	res, err := s.r.debugResources(s.ctx, s.port, req.GetTypeUrl(), req.GetResourceNamesSubscribe())
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

// debugResources answers a debug type URL for the tier. Only a relay whose
// xDS port is trusted (Authorizer AllowAll, as istiod's plaintext port)
// answers: with an Authorizer, a stream proves only that it may have its
// own node's config, not every node's, and the admin API (which has its
// own access control) answers the same questions.
func (r *Relay) debugResources(ctx context.Context, p port, typeURL string, names []string) ([]*anypb.Any, error) {
	if _, trusted := r.cfg.Authorizer.(AllowAll); !trusted || p != portPlain {
		return nil, status.Errorf(codes.PermissionDenied, "%s is answered only on a trusted xDS port (no Authorizer): ask the admin API (relayctl)", typeURL)
	}
	if typeURL == typeDebugSyncz {
		return r.syncz(r.TierLedger(ctx, ledger.Scope{}))
	}
	if len(names) != 1 {
		return nil, status.Errorf(codes.InvalidArgument, "%s wants one resource name, the node id; got %d", typeURL, len(names))
	}
	d, _, err := r.TierConfigDump(ctx, &inspectpb.ConfigDumpRequest{Node: names[0]})
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

// syncz lists the tier's connected Envoys as istiod's syncz does: a CSDS
// ClientConfig each, with the status of each type istiod reports (types it
// never subscribed to are NOT_SENT; a NACK is ERROR).
func (r *Relay) syncz(tl TierLedger) ([]*anypb.Any, error) {
	var out []*anypb.Any
	for _, e := range tl.Envoys() {
		if !e.State.Connected() {
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
