// Package configdump lays views out as Envoy's /config_dump does
// (admin.v3.ConfigDump), every sensitive field redacted (relay/redact):
// what a relay sent a client, or a key's views, as istioctl proxy-config
// and relayctl read them.
package configdump

import (
	"fmt"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/redact"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Type is one type of a dump: a view (of a key, or what a stream sent its
// client) and its version.
type Type struct {
	URL     string
	Version string
	// Entries are the view's resources; one whose Value is nil was
	// declared by the client and is not held, and is left out.
	Entries []ledger.Entry[*xds.Resource]
}

// Build lays views out as Envoy's /config_dump does, each resource as a
// dynamic one with its version (its content hash), every sensitive field
// redacted. Entries without a value (declared by a client, not held) and
// types Envoy's dump has no place for (runtime) are left out.
func Build(types []Type) (*adminv3.ConfigDump, error) {
	dump := &adminv3.ConfigDump{}
	for _, t := range types {
		var bodies []*anypb.Any
		var names, versions []string
		for _, e := range t.Entries {
			if e.Value == nil {
				continue // declared by the client, not held here
			}
			b, err := redact.Any(e.Value.Body)
			if err != nil {
				return nil, fmt.Errorf("config dump: %s %q: %w", xds.ShortType(t.URL), e.Name, err)
			}
			bodies, names, versions = append(bodies, b), append(names, e.Name), append(versions, e.Hash.String())
		}
		var msg proto.Message
		switch t.URL {
		case xds.TypeCluster:
			d := &adminv3.ClustersConfigDump{VersionInfo: t.Version}
			for i, b := range bodies {
				d.DynamicActiveClusters = append(d.DynamicActiveClusters, &adminv3.ClustersConfigDump_DynamicCluster{VersionInfo: versions[i], Cluster: b})
			}
			msg = d
		case xds.TypeEndpoint:
			d := &adminv3.EndpointsConfigDump{}
			for i, b := range bodies {
				d.DynamicEndpointConfigs = append(d.DynamicEndpointConfigs, &adminv3.EndpointsConfigDump_DynamicEndpointConfig{VersionInfo: versions[i], EndpointConfig: b})
			}
			msg = d
		case xds.TypeListener:
			d := &adminv3.ListenersConfigDump{VersionInfo: t.Version}
			for i, b := range bodies {
				d.DynamicListeners = append(d.DynamicListeners, &adminv3.ListenersConfigDump_DynamicListener{Name: names[i],
					ActiveState: &adminv3.ListenersConfigDump_DynamicListenerState{VersionInfo: versions[i], Listener: b}})
			}
			msg = d
		case xds.TypeScopedRoute:
			d := &adminv3.ScopedRoutesConfigDump{}
			for i, b := range bodies {
				d.DynamicScopedRouteConfigs = append(d.DynamicScopedRouteConfigs, &adminv3.ScopedRoutesConfigDump_DynamicScopedRouteConfigs{
					Name: names[i], VersionInfo: versions[i], ScopedRouteConfigs: []*anypb.Any{b}})
			}
			msg = d
		case xds.TypeRoute:
			d := &adminv3.RoutesConfigDump{}
			for i, b := range bodies {
				d.DynamicRouteConfigs = append(d.DynamicRouteConfigs, &adminv3.RoutesConfigDump_DynamicRouteConfig{VersionInfo: versions[i], RouteConfig: b})
			}
			msg = d
		case xds.TypeSecret:
			d := &adminv3.SecretsConfigDump{}
			for i, b := range bodies {
				d.DynamicActiveSecrets = append(d.DynamicActiveSecrets, &adminv3.SecretsConfigDump_DynamicSecret{Name: names[i], VersionInfo: versions[i], Secret: b})
			}
			msg = d
		case xds.TypeExtension:
			d := &adminv3.EcdsConfigDump{}
			for i, b := range bodies {
				d.EcdsFilters = append(d.EcdsFilters, &adminv3.EcdsConfigDump_EcdsFilterConfig{VersionInfo: versions[i], EcdsFilter: b})
			}
			msg = d
		default:
			continue
		}
		a, err := anypb.New(msg)
		if err != nil {
			return nil, err
		}
		dump.Configs = append(dump.Configs, a)
	}
	return dump, nil
}
