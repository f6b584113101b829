package realenvoy

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	// Every Envoy type, so that the Any fields of a config dump resolve.
	_ "github.com/meshrelay/meshrelay/relay/xdstypes"
)

// Get returns the body of the admin path (e.g. "/stats"), failing on any
// status but 200.
func (e *Envoy) Get(ctx context.Context, path string) ([]byte, error) {
	body, code, err := e.get(ctx, path)
	if err != nil {
		return nil, err
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("realenvoy: GET %s: %d: %s", path, code, bytes.TrimSpace(body))
	}
	return body, nil
}

func (e *Envoy) get(ctx context.Context, path string) ([]byte, int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+e.admin+path, nil)
	if err != nil {
		return nil, 0, err
	}
	resp, err := e.client.Do(req)
	if err != nil {
		return nil, 0, fmt.Errorf("realenvoy: GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 256<<20))
	return body, resp.StatusCode, err
}

// Ready reports whether Envoy's /ready says LIVE: it has its initial
// config (the first CDS and LDS answers, and what they needed, warmed).
func (e *Envoy) Ready(ctx context.Context) (bool, error) {
	body, code, err := e.get(ctx, "/ready")
	if err != nil {
		return false, err
	}
	return code == http.StatusOK && strings.TrimSpace(string(body)) == "LIVE", nil
}

// WaitReady waits until Ready says LIVE, or ctx ends.
func (e *Envoy) WaitReady(ctx context.Context) error {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		if ready, _ := e.Ready(ctx); ready {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("realenvoy: envoy not LIVE: %w", ctx.Err())
		case <-t.C:
		}
	}
}

// ConfigDump returns /config_dump?include_eds, parsed.
func (e *Envoy) ConfigDump(ctx context.Context) (*adminv3.ConfigDump, error) {
	out := &adminv3.ConfigDump{}
	return out, e.getJSON(ctx, "/config_dump?include_eds", out)
}

// getJSON reads the admin path's JSON into out.
func (e *Envoy) getJSON(ctx context.Context, path string, out proto.Message) error {
	body, err := e.Get(ctx, path)
	if err != nil {
		return err
	}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(body, out); err != nil {
		return fmt.Errorf("realenvoy: GET %s: %w", path, err)
	}
	return nil
}

// Resource is one dynamic resource of a config dump, with the version_info
// of the response it came in.
type Resource struct {
	Message proto.Message
	Version string
}

// Dynamic returns the dynamic resources of dump Envoy is using, by type URL
// and name: active clusters, the active state of listeners, route
// configurations and the endpoint assignments of EDS clusters. Static and
// warming ones are left out.
func Dynamic(dump *adminv3.ConfigDump) (map[string]map[string]Resource, error) {
	out := map[string]map[string]Resource{
		resource.ClusterType: {}, resource.ListenerType: {}, resource.RouteType: {}, resource.EndpointType: {},
	}
	add := func(typeURL, version string, a interface {
		UnmarshalNew() (proto.Message, error)
	}) error {
		m, err := a.UnmarshalNew()
		if err != nil {
			return fmt.Errorf("realenvoy: config dump: %s: %w", typeURL, err)
		}
		name := resourceName(m)
		out[typeURL][name] = Resource{Message: m, Version: version}
		return nil
	}
	for _, c := range dump.GetConfigs() {
		m, err := c.UnmarshalNew()
		if err != nil {
			return nil, fmt.Errorf("realenvoy: config dump: %w", err)
		}
		switch d := m.(type) {
		case *adminv3.ClustersConfigDump:
			for _, dc := range d.GetDynamicActiveClusters() {
				if err := add(resource.ClusterType, dc.GetVersionInfo(), dc.GetCluster()); err != nil {
					return nil, err
				}
			}
		case *adminv3.ListenersConfigDump:
			for _, dl := range d.GetDynamicListeners() {
				if st := dl.GetActiveState(); st != nil {
					if err := add(resource.ListenerType, st.GetVersionInfo(), st.GetListener()); err != nil {
						return nil, err
					}
				}
			}
		case *adminv3.RoutesConfigDump:
			for _, dr := range d.GetDynamicRouteConfigs() {
				if err := add(resource.RouteType, dr.GetVersionInfo(), dr.GetRouteConfig()); err != nil {
					return nil, err
				}
			}
		case *adminv3.EndpointsConfigDump:
			for _, de := range d.GetDynamicEndpointConfigs() {
				if err := add(resource.EndpointType, de.GetVersionInfo(), de.GetEndpointConfig()); err != nil {
					return nil, err
				}
			}
		}
	}
	// include_eds dumps the endpoints of every cluster; only those an EDS
	// cluster takes from EDS came over xDS.
	eds := make(map[string]bool)
	for _, r := range out[resource.ClusterType] {
		c, ok := r.Message.(*clusterv3.Cluster)
		if !ok || c.GetType() != clusterv3.Cluster_EDS {
			continue
		}
		name := c.GetEdsClusterConfig().GetServiceName()
		if name == "" {
			name = c.GetName()
		}
		eds[name] = true
	}
	for name := range out[resource.EndpointType] {
		if !eds[name] {
			delete(out[resource.EndpointType], name)
		}
	}
	return out, nil
}

func resourceName(m proto.Message) string {
	if n, ok := m.(interface{ GetName() string }); ok {
		return n.GetName()
	}
	if n, ok := m.(interface{ GetClusterName() string }); ok {
		return n.GetClusterName()
	}
	return ""
}

// Stats returns /stats as name → value (counters and gauges as decimal
// text, text readouts such as control_plane.identifier as they are).
func (e *Envoy) Stats(ctx context.Context) (map[string]string, error) {
	body, err := e.Get(ctx, "/stats")
	if err != nil {
		return nil, err
	}
	return parseStats(body), nil
}

// parseStats reads /stats's text: a "name: value" line per stat.
func parseStats(body []byte) map[string]string {
	out := make(map[string]string)
	for line := range strings.Lines(string(body)) {
		if name, value, ok := strings.Cut(strings.TrimRight(line, "\n"), ": "); ok {
			out[name] = strings.Trim(value, `"`)
		}
	}
	return out
}

// Stat returns the value of the stat named name (as /stats prints it),
// and whether Envoy has it. Envoy matches the name against every stat it
// has, on its main thread, the one that applies config: with a few
// hundred clusters that is milliseconds, so a tight poll delays what it
// measures. Gauge is cheaper.
func (e *Envoy) Stat(ctx context.Context, name string) (string, bool, error) {
	return e.stat(ctx, name, "")
}

// Gauge is Stat for a gauge (update_time, connected_state, …): Envoy
// matches it against its gauges only.
func (e *Envoy) Gauge(ctx context.Context, name string) (string, bool, error) {
	return e.stat(ctx, name, "&type=Gauges")
}

func (e *Envoy) stat(ctx context.Context, name, query string) (string, bool, error) {
	body, err := e.Get(ctx, "/stats?filter="+url.QueryEscape("^"+regexp.QuoteMeta(name)+"$")+query)
	if err != nil {
		return "", false, err
	}
	v, ok := parseStats(body)[name]
	return v, ok, nil
}

// Clusters returns /clusters?format=json, parsed.
func (e *Envoy) Clusters(ctx context.Context) (*adminv3.Clusters, error) {
	out := &adminv3.Clusters{}
	return out, e.getJSON(ctx, "/clusters?format=json", out)
}
