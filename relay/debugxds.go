package relay

import (
	"encoding/json"
	"errors"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"
	"unique"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statusv3 "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/admin"
	"github.com/meshrelay/meshrelay/relay/aggkey"
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

// debugAnswer is what a stream last answered for a debug type URL.
type debugAnswer struct {
	nonce string
	names []string
}

// debugAnswered reports whether a debug request is the client's ACK or
// NACK of the stream's last answer of its type, which is not answered
// again: it names that answer's nonce, and the same resource names or
// an error (Delta: no new names, or an error). Anything else is a
// question, answered as istiod answers every debug request. Istio's ADS
// client (pkg/adsc, which istioctl uses) puts a nonce of its own (a
// timestamp) on every request, its first included, and never ACKs a debug
// answer; an xDS client that does ACK is not answered in a loop.
func (s *stream) debugAnswered(typeURL, responseNonce string, names []string, nack, delta bool) bool {
	last, ok := s.debugSent[typeURL]
	if !ok || responseNonce == "" || responseNonce != last.nonce {
		return false
	}
	return nack || slices.Equal(names, last.names) || delta && len(names) == 0
}

// debugNonce numbers a debug answer and remembers it (debugAnswered).
func (s *stream) debugNonce(typeURL string, names []string) string {
	s.nonce++
	nonce := strconv.FormatUint(s.nonce, 10)
	if s.debugSent == nil {
		s.debugSent = make(map[string]debugAnswer)
	}
	s.debugSent[typeURL] = debugAnswer{nonce: nonce, names: slices.Clone(names)}
	return nonce
}

// answerDebugSotW answers a SotW request for a debug type URL. A debug
// client is not an Envoy: its stream joins no key.
func (s *stream) answerDebugSotW(req *discovery.DiscoveryRequest, names []string) error {
	typeURL := req.GetTypeUrl()
	if s.debugAnswered(typeURL, req.GetResponseNonce(), names, req.GetErrorDetail() != nil, false) {
		return nil
	}
	res, err := s.debugResources(typeURL, names)
	if err != nil {
		return err
	}
	return s.sendRaw(&discovery.DiscoveryResponse{TypeUrl: typeURL, Resources: res,
		VersionInfo: strconv.FormatInt(time.Now().UnixNano(), 10), Nonce: s.debugNonce(typeURL, names),
		ControlPlane: s.r.debugControlPlane()})
}

// answerDebugDelta answers a Delta request for a debug type URL, by the
// same rule.
func (s *stream) answerDebugDelta(req *discovery.DeltaDiscoveryRequest) error {
	typeURL, names := req.GetTypeUrl(), req.GetResourceNamesSubscribe()
	if s.debugAnswered(typeURL, req.GetResponseNonce(), names, req.GetErrorDetail() != nil, true) {
		return nil
	}
	res, err := s.debugResources(typeURL, names)
	if err != nil {
		return err
	}
	out := &discovery.DeltaDiscoveryResponse{TypeUrl: typeURL, SystemVersionInfo: strconv.FormatInt(time.Now().UnixNano(), 10),
		Nonce: s.debugNonce(typeURL, names), ControlPlane: s.r.debugControlPlane()}
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
//     sends a token of istio-system's default account): the whole tier
//     for an identity of Config.Admin.DebugNamespaces (istiod's rule for its
//     root namespace) or of Config.Admin.Identities, the identity's own
//     namespace for any other;
//   - the peer port serves the tier's relays, which ask no debug types.
//
// Anything else is PermissionDenied, saying what would be answered.
func (s *stream) debugCaller(typeURL string) (admin.Caller, error) {
	switch s.port {
	case portPlain:
		if _, trusted := s.r.cfg.XDS.Authorizer.(AllowAll); trusted {
			return admin.Caller{Admin: true}, nil
		}
		return admin.Caller{}, status.Errorf(codes.PermissionDenied,
			"%s is not answered on this plaintext port (it has an Authorizer): ask over the TLS port with a service-account token, or ask the admin API (relayctl)", typeURL)
	case portTLS:
		switch {
		case s.identity != nil:
			if slices.Contains(s.r.cfg.Admin.DebugNamespaces, s.identity.Namespace) {
				// Reads the tier, as istiod answers its root namespace.
				return admin.Caller{Admin: true, Identity: s.identity.SPIFFEID()}, nil
			}
			return s.r.adminGuard.IdentityCaller(*s.identity), nil
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
// syncz does: a CSDS ClientConfig each, with the status of each type the
// Envoy subscribed to, sorted by type URL (one never sent is NOT_SENT; a
// NACK is ERROR).
func (r *Relay) syncz(tl TierLedger, c admin.Caller) ([]*anypb.Any, error) {
	var out []*anypb.Any
	for _, e := range tl.Envoys() {
		if !e.State.Connected() || !c.SeesKey(e.Key) {
			continue
		}
		cc := &statusv3.ClientConfig{Node: &core.Node{Id: e.State.Node, Metadata: metaStruct(e.State.Meta)}}
		for _, et := range e.State.Types {
			gc := &statusv3.ClientConfig_GenericXdsConfig{TypeUrl: et.Type, ConfigStatus: statusv3.ConfigStatus_NOT_SENT}
			switch tl.Status(e, et) {
			case ledger.StatusSynced:
				gc.ConfigStatus, gc.LastUpdated = statusv3.ConfigStatus_SYNCED, timestamppb.New(et.AckedAt)
			case ledger.StatusNACKed:
				gc.ConfigStatus = statusv3.ConfigStatus_ERROR
			case ledger.StatusStale:
				gc.ConfigStatus = statusv3.ConfigStatus_STALE
			}
			cc.GenericXdsConfigs = append(cc.GenericXdsConfigs, gc)
		}
		slices.SortFunc(cc.GenericXdsConfigs, func(a, b *statusv3.ClientConfig_GenericXdsConfig) int {
			return strings.Compare(a.GetTypeUrl(), b.GetTypeUrl())
		})
		a, err := anypb.New(cc)
		if err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		out = append(out, a)
	}
	return out, nil
}

// ledgerConnect starts the ledger's record of an Envoy's stream, with
// what istioctl shows of its node: the namespace (proxy-status -n), the
// cluster and the proxy version, from Istio's node metadata.
func (r *Relay) ledgerConnect(node *core.Node, key aggkey.Key, at time.Time) *ledger.Envoy {
	e := r.ledger.Connect(node.GetId(), string(key), at)
	f := node.GetMetadata().GetFields()
	field := func(name string) string { return unique.Make(f[name].GetStringValue()).Value() } // one copy for a key's Envoys
	e.SetMeta(ledger.NodeMeta{Namespace: field("NAMESPACE"), Cluster: field("CLUSTER_ID"), Version: field("ISTIO_VERSION")})
	return e
}

// metaStruct is m as the node metadata istioctl reads (nil if empty).
func metaStruct(m ledger.NodeMeta) *structpb.Struct {
	if m == (ledger.NodeMeta{}) {
		return nil
	}
	fields := map[string]*structpb.Value{}
	for name, v := range map[string]string{"NAMESPACE": m.Namespace, "CLUSTER_ID": m.Cluster, "ISTIO_VERSION": m.Version} {
		if v != "" {
			fields[name] = structpb.NewStringValue(v)
		}
	}
	return &structpb.Struct{Fields: fields}
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
