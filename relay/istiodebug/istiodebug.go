// Package istiodebug is what istiod answers on its ADS port for the debug
// type URLs istioctl asks (istioctl proxy-status --xds-address, istioctl x
// internal-debug), built from the tier's ledger: the relay answers them for
// the whole tier, the way istiod does, rather than passing them through to
// the upstream, which knows none of the tier's Envoys. Which caller may see
// what, and the stream's nonces, are the relay's.
package istiodebug

import (
	"encoding/json"
	"runtime/debug"
	"slices"
	"strings"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	statusv3 "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/meshrelay/meshrelay/ledger"
)

const (
	// TypeSyncz lists the Envoys, each as a CSDS ClientConfig with the
	// status of each type.
	TypeSyncz = "istio.io/debug/syncz"
	// TypeConfigDump returns the config dump of the node named in
	// resource_names, as the sections of Envoy's config dump.
	TypeConfigDump = "istio.io/debug/config_dump"
)

// IsDebugType reports whether typeURL is one of istiod's debug types.
func IsDebugType(typeURL string) bool {
	return typeURL == TypeSyncz || typeURL == TypeConfigDump
}

// Syncz lists the tier's connected Envoys of the keys sees admits as
// istiod's syncz does: a CSDS ClientConfig each, with the status of each
// type the Envoy subscribed to, sorted by type URL (one never sent is
// NOT_SENT; a NACK is ERROR).
func Syncz(r *ledger.Report, sees func(key string) bool) ([]*anypb.Any, error) {
	var out []*anypb.Any
	for _, e := range r.Envoys() {
		if !e.State.Connected() || !sees(e.Key) {
			continue
		}
		cc := &statusv3.ClientConfig{Node: &core.Node{Id: e.State.Node, Metadata: MetaStruct(e.State.Meta)}}
		for _, et := range e.State.Types {
			gc := &statusv3.ClientConfig_GenericXdsConfig{TypeUrl: et.Type, ConfigStatus: statusv3.ConfigStatus_NOT_SENT}
			switch r.Status(e, et) {
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
			return nil, err
		}
		out = append(out, a)
	}
	return out, nil
}

// MetaStruct is m as the node metadata istioctl reads (nil if empty).
func MetaStruct(m ledger.NodeMeta) *structpb.Struct {
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

// ControlPlane identifies the relay id to istioctl, which reads the
// identifier of a debug answer as istiod's JSON (component, ID, build
// info).
func ControlPlane(id string) *core.ControlPlane {
	type buildInfo struct {
		Version string `json:"version"`
	}
	v := struct {
		Component string
		ID        string
		Info      buildInfo
	}{Component: "meshrelay", ID: id, Info: buildInfo{Version: "unknown"}}
	if bi, ok := debug.ReadBuildInfo(); ok {
		v.Info.Version = bi.Main.Version
	}
	b, _ := json.Marshal(v)
	return &core.ControlPlane{Identifier: string(b)}
}
