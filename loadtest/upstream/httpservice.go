package upstream

import (
	"fmt"
	"strconv"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
)

// The mutations real-Envoy tests make: of HTTP services
// (Scenario.HTTPServices), under traffic, and of clusters Envoy may reject.

// httpService is the state of an HTTP service. Guarded by Upstream.mu.
type httpService struct {
	cluster string // the cluster its route sends to now
}

// httpBackends builds the endpoints at backends, stamped with mk.
func (u *Upstream) httpBackends(name string, backends []string, mk marker) ([]*endpointv3.LbEndpoint, error) {
	lbs := make([]*endpointv3.LbEndpoint, len(backends))
	for i, b := range backends {
		hp, err := parseHostPort(b)
		if err != nil {
			return nil, fmt.Errorf("upstream: HTTP service %s: backend: %w", name, err)
		}
		lbs[i] = u.sh.lbEndpoint(hp.host, hp.port, mk)
	}
	return lbs, nil
}

// SetHTTPBackends gives HTTP service name the endpoints backends (a rollout
// moving its pods): its cluster's ClusterLoadAssignment changes in every
// group.
func (u *Upstream) SetHTTPBackends(name string, backends []string) (Change, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	hs := u.http[name]
	if hs == nil {
		return Change{}, fmt.Errorf("upstream: no HTTP service %q", name)
	}
	mk := u.nextMarker()
	lbs, err := u.httpBackends(name, backends, mk)
	if err != nil {
		return Change{}, err
	}
	return u.publish(tEDS, u.all, hs.cluster, u.sh.cla(hs.cluster, lbs, mk), mk)
}

// SwitchHTTPCluster sends HTTP service name to a new cluster,
// "cluster-http-<name>-<generation>", holding backends, in every group, as
// istiod does when a route's destination changes: it publishes the new
// cluster and its endpoints, then the route sending to it, then removes
// the old cluster and its endpoints. Each is published on its own, so a
// relay may see them in any order across types; a client must never be
// sent the route before the cluster, nor lose the cluster before the route.
func (u *Upstream) SwitchHTTPCluster(name string, backends []string) ([]Change, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	hs := u.http[name]
	if hs == nil {
		return nil, fmt.Errorf("upstream: no HTTP service %q", name)
	}
	mk := u.nextMarker()
	lbs, err := u.httpBackends(name, backends, mk)
	if err != nil {
		return nil, err
	}
	_, route, base := HTTPNames(name)
	next := base + "-" + strconv.FormatUint(mk.gen, 10)
	var out []Change
	for _, step := range []struct {
		t    int
		name string
		res  types.Resource // nil: removed
	}{
		{tCDS, next, u.sh.grpcCluster(next, mk)},
		{tEDS, next, u.sh.cla(next, lbs, mk)},
		{tRDS, route, u.sh.grpcRouteConfig(route, "*", next, mk)},
		{tCDS, hs.cluster, nil},
		{tEDS, hs.cluster, nil},
	} {
		c, err := u.publish(step.t, u.all, step.name, step.res, mk)
		if err != nil {
			return out, err
		}
		out = append(out, c)
	}
	hs.cluster = next
	return out, nil
}

// PublishCluster publishes c, as given, to group alone: for tests of what
// a real Envoy accepts and rejects (e.g. an invalid field combination
// Envoy NACKs, then the same cluster fixed).
func (u *Upstream) PublishCluster(group string, c *clusterv3.Cluster) (Change, error) {
	gi, ok := u.groupIx[group]
	if !ok {
		return Change{}, fmt.Errorf("upstream: no group %q", group)
	}
	if c.GetName() == "" {
		return Change{}, fmt.Errorf("upstream: publish cluster: no name")
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.publish(tCDS, []int{gi}, c.GetName(), c, u.nextMarker())
}
