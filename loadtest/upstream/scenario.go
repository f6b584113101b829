package upstream

import (
	"fmt"
	"math"
	"net"
	"net/netip"
	"strconv"
	"strings"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// PublicGroup is the node group of proxies whose namespace is not one of the
// scenario's namespaces (or cannot be derived from the node). It sees only the
// services exported to every namespace.
const PublicGroup = "public"

// IstioVersion is the ISTIO_VERSION that Node puts in node metadata.
const IstioVersion = "1.28.0"

// EndpointPort is the port of every WorkloadEntry address.
const EndpointPort = 8080

// goldenRatio spreads namespace-local services evenly over service indices.
const goldenRatio = 0.6180339887498949

// Scenario describes the istiod-shaped configuration the upstream serves.
// A Scenario is a value; its methods are safe for concurrent use.
type Scenario struct {
	// Services is the number of ServiceEntries; each becomes one EDS cluster
	// "outbound|<port>||svc-<i>.ns-<i%Namespaces>.svc.cluster.local", its
	// ClusterLoadAssignment and one virtual host. Must be > 0.
	Services int
	// Endpoints is the number of WorkloadEntries, spread round-robin over the
	// services (WorkloadEntry j backs service j % Services), each with an
	// address 10.x.y.z:8080. Zero means clusters without endpoints.
	Endpoints int
	// Namespaces is the number of namespaces "ns-0" … ; service i lives in
	// namespace i % Namespaces and each namespace is one node group. Must be > 0.
	Namespaces int
	// LocalFraction is the fraction, in [0, 1], of services exported only to
	// their own namespace; the rest are visible to every group. Zero means
	// every group sees the same configuration.
	LocalFraction float64
	// Ports are the service ports, assigned round-robin (service i gets
	// Ports[i % len(Ports)]). Each port has one Listener "0.0.0.0_<port>" and
	// one RouteConfiguration "<port>". Empty means {80, 8080}.
	Ports []uint32
	// GRPCServices are proxyless gRPC services that every group also gets, in
	// the shape grpc-go's xds:/// resolver accepts.
	GRPCServices []GRPCService
	// HTTPServices are services a real Envoy carries traffic to, that every
	// group also gets: the test sends requests to Listen, Envoy routes
	// them to Backends.
	HTTPServices []HTTPService
	// InboundIPs are pod IPs that back a Service. A node whose IP is
	// listed gets, beside its group's listeners, an inbound listener of
	// its own, "inbound|<ip>|8080" (see InboundListenerName), as istiod
	// gives a pod whose IP backs a Service: so two pods of one workload
	// get different config, which a relay's divergence check finds. The
	// node's IP is the first listed one of its INSTANCE_IPS metadata
	// (comma-separated), else the IP in its Istio node id
	// "sidecar~<IP>~<pod>.<ns>~<ns>.svc.cluster.local". Its other types,
	// and everything else, are its group's. Empty: no node gets one.
	InboundIPs []string
}

// InboundListenerName returns the name of the inbound listener a node of
// IP ip gets when ip is one of Scenario.InboundIPs: "inbound|<ip>|8080"
// (the port is EndpointPort).
func InboundListenerName(ip string) string {
	return "inbound|" + ip + "|" + strconv.Itoa(EndpointPort)
}

// HTTPService is a service reached through a real Envoy's listener: the
// upstream serves a Listener "http-<Name>" bound to Listen, a
// RouteConfiguration "route-http-<Name>" sending every request to the
// cluster "cluster-http-<Name>", and its ClusterLoadAssignment holding
// Backends. Every address is on loopback in tests.
type HTTPService struct {
	// Name names the service's resources.
	Name string
	// Listen is the "ip:port" Envoy's listener binds; "" serves no
	// listener (Envoys that have one of their own use the route).
	Listen string
	// Backends are the "ip:port" of the servers behind the service.
	Backends []string
}

// HTTPNames returns the listener, route and cluster (and
// ClusterLoadAssignment) names of HTTP service name.
func HTTPNames(name string) (listener, route, cluster string) {
	return "http-" + name, "route-http-" + name, "cluster-http-" + name
}

// GRPCService is a proxyless gRPC target: the upstream serves an API listener
// named Name, a RouteConfiguration "route-<Name>", a cluster "cluster-<Name>"
// and its ClusterLoadAssignment holding Backend.
type GRPCService struct {
	// Name is the dial target without the scheme, e.g. "greeter.test" for
	// "xds:///greeter.test".
	Name string
	// Backend is the "host:port" of the server behind the target.
	Backend string
}

// DefaultScenario returns a small scenario suitable for demos: 100 services,
// 100 endpoints, 4 namespaces, a quarter of the services namespace-local.
func DefaultScenario() Scenario {
	return Scenario{
		Services:      100,
		Endpoints:     100,
		Namespaces:    4,
		LocalFraction: 0.25,
		Ports:         []uint32{80, 8080},
	}
}

// withDefaults returns s with zero fields that have a default filled in.
func (s Scenario) withDefaults() Scenario {
	if len(s.Ports) == 0 {
		s.Ports = []uint32{80, 8080}
	}
	return s
}

func (s Scenario) validate() error {
	switch {
	case s.Services <= 0:
		return fmt.Errorf("upstream: field Scenario.Services must be > 0, got %d", s.Services)
	case s.Endpoints < 0:
		return fmt.Errorf("upstream: field Scenario.Endpoints must be >= 0, got %d", s.Endpoints)
	case s.Namespaces <= 0:
		return fmt.Errorf("upstream: field Scenario.Namespaces must be > 0, got %d", s.Namespaces)
	case math.IsNaN(s.LocalFraction) || s.LocalFraction < 0 || s.LocalFraction > 1:
		return fmt.Errorf("upstream: field Scenario.LocalFraction must be in [0, 1], got %v", s.LocalFraction)
	}
	seenPort := make(map[uint32]bool, len(s.Ports))
	for _, p := range s.Ports {
		if p == 0 || p > 65535 {
			return fmt.Errorf("upstream: field Scenario.Ports: invalid port %d", p)
		}
		if seenPort[p] {
			return fmt.Errorf("upstream: field Scenario.Ports: duplicate port %d", p)
		}
		seenPort[p] = true
	}
	seenName := make(map[string]bool, len(s.GRPCServices)+len(s.HTTPServices))
	name := func(field, n string) error {
		switch {
		case n == "" || strings.ContainsAny(n, "/ "):
			return fmt.Errorf("upstream: field Scenario.%s: invalid name %q", field, n)
		case seenName[n]:
			return fmt.Errorf("upstream: field Scenario.%s: duplicate name %q", field, n)
		}
		seenName[n] = true
		return nil
	}
	for _, g := range s.GRPCServices {
		if err := name("GRPCServices", g.Name); err != nil {
			return err
		}
		if _, err := parseHostPort(g.Backend); err != nil {
			return fmt.Errorf("upstream: field Scenario.GRPCServices: backend of %q: %w", g.Name, err)
		}
	}
	for _, h := range s.HTTPServices {
		if err := name("HTTPServices", h.Name); err != nil {
			return err
		}
		if _, err := parseHostPort(h.Listen); h.Listen != "" && err != nil {
			return fmt.Errorf("upstream: field Scenario.HTTPServices: listen of %q: %w", h.Name, err)
		}
		for _, b := range h.Backends {
			if _, err := parseHostPort(b); err != nil {
				return fmt.Errorf("upstream: field Scenario.HTTPServices: backend of %q: %w", h.Name, err)
			}
		}
	}
	seenIP := make(map[netip.Addr]bool, len(s.InboundIPs))
	for _, ip := range s.InboundIPs {
		a, err := netip.ParseAddr(ip)
		switch {
		case err != nil || a.Zone() != "":
			return fmt.Errorf("upstream: field Scenario.InboundIPs: %q is not an IP address", ip)
		case seenIP[a.Unmap()]:
			return fmt.Errorf("upstream: field Scenario.InboundIPs: duplicate IP %q", ip)
		}
		seenIP[a.Unmap()] = true
	}
	return nil
}

// inboundIPs returns the addresses of InboundIPs, in order, each as
// ParseAddr reads it, unmapped (validated).
func (s Scenario) inboundIPs() []netip.Addr {
	out := make([]netip.Addr, 0, len(s.InboundIPs))
	for _, ip := range s.InboundIPs {
		a, _ := netip.ParseAddr(ip)
		out = append(out, a.Unmap())
	}
	return out
}

// nodeIPs returns the IPs of node, as InboundIPs reads them: those of its
// INSTANCE_IPS metadata, else the one in its Istio node id. Text that is
// not an IP is skipped.
func nodeIPs(node *core.Node) []netip.Addr {
	var texts []string
	if v := node.GetMetadata().GetFields()["INSTANCE_IPS"].GetStringValue(); v != "" {
		texts = strings.Split(v, ",")
	} else if parts := strings.Split(node.GetId(), "~"); len(parts) == 4 {
		texts = parts[1:2]
	}
	var out []netip.Addr
	for _, t := range texts {
		if a, err := netip.ParseAddr(strings.TrimSpace(t)); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// hostPort is a parsed "ip:port".
type hostPort struct {
	host string
	port uint32
}

func parseHostPort(s string) (hostPort, error) {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return hostPort{}, err
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 || host == "" {
		return hostPort{}, fmt.Errorf("want host:port, got %q", s)
	}
	return hostPort{host, uint32(n)}, nil
}

// NamespaceName returns the name of namespace ns: "ns-<ns>".
func NamespaceName(ns int) string { return "ns-" + strconv.Itoa(ns) }

// ServiceHost returns the host name of service i:
// "svc-<i>.ns-<i%Namespaces>.svc.cluster.local".
func (s Scenario) ServiceHost(i int) string {
	return "svc-" + strconv.Itoa(i) + "." + NamespaceName(s.namespaceOf(i)) + ".svc.cluster.local"
}

// ServicePort returns the port of service i.
func (s Scenario) ServicePort(i int) uint32 {
	ports := s.withDefaults().Ports
	return ports[i%len(ports)]
}

// ClusterName returns the name of service i's cluster, which is also the
// name of its ClusterLoadAssignment: "outbound|<port>||<host>".
func (s Scenario) ClusterName(i int) string {
	return clusterName(s.ServicePort(i), s.ServiceHost(i))
}

// IsLocal reports whether service i is exported only to its own namespace.
func (s Scenario) IsLocal(i int) bool {
	_, frac := math.Modf(float64(i) * goldenRatio)
	return frac < s.LocalFraction
}

func (s Scenario) namespaceOf(i int) int {
	if s.Namespaces <= 0 {
		return 0
	}
	return i % s.Namespaces
}

func clusterName(port uint32, host string) string {
	return "outbound|" + strconv.FormatUint(uint64(port), 10) + "||" + host
}

// Node returns an Istio sidecar node for pod number pod of workload number
// workload in namespace ns, shaped like the nodes istio-agent sends:
// id "sidecar~<IP>~wl-<workload>-<pod>.ns-<ns>~ns-<ns>.svc.cluster.local"
// and ISTIO_VERSION, NAMESPACE, CLUSTER_ID, INSTANCE_IPS, INTERCEPTION_MODE,
// MESH_ID, SERVICE_ACCOUNT, WORKLOAD_NAME, NAME and LABELS metadata.
// Pods of one workload differ only in their name and IP, so they belong to
// the same aggregation class. The IP is unique per (ns, workload, pod):
// 10.(128+ns).<workload>.<pod> when ns < 128 and workload, pod < 256, else an
// IPv6 address fd00::/16 built from the three numbers (as uint32).
// ns may be >= Namespaces: such a node gets the PublicGroup view.
func (s Scenario) Node(ns, workload, pod int) *core.Node {
	ip := NodeIP(ns, workload, pod)
	nsName := NamespaceName(ns)
	wl := "wl-" + strconv.Itoa(workload)
	podName := wl + "-" + strconv.Itoa(pod)
	str := func(v string) *structpb.Value { return structpb.NewStringValue(v) }
	return &core.Node{
		Id:            "sidecar~" + ip + "~" + podName + "." + nsName + "~" + nsName + ".svc.cluster.local",
		Cluster:       wl + "." + nsName,
		UserAgentName: "envoy",
		Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
			"ISTIO_VERSION":     str(IstioVersion),
			"NAMESPACE":         str(nsName),
			"CLUSTER_ID":        str("Kubernetes"),
			"INSTANCE_IPS":      str(ip),
			"INTERCEPTION_MODE": str("REDIRECT"),
			"MESH_ID":           str("cluster.local"),
			"SERVICE_ACCOUNT":   str(wl),
			"WORKLOAD_NAME":     str(wl),
			"NAME":              str(podName),
			"LABELS": structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
				"app":     str(wl),
				"version": str("v1"),
			}}),
		}},
	}
}

// NodeIP returns the IP that Node uses for (ns, workload, pod).
func NodeIP(ns, workload, pod int) string {
	if ns >= 0 && ns < 128 && workload >= 0 && workload < 256 && pod >= 0 && pod < 256 {
		return netip.AddrFrom4([4]byte{10, byte(128 + ns), byte(workload), byte(pod)}).String()
	}
	var b [16]byte
	b[0] = 0xfd
	put := func(off int, v uint32) {
		b[off], b[off+1], b[off+2], b[off+3] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
	}
	put(4, uint32(ns))
	put(8, uint32(workload))
	put(12, uint32(pod))
	return netip.AddrFrom16(b).String()
}

// Group returns the node group whose view node gets: the node's namespace
// taken from its NAMESPACE metadata, else from the fourth "~" part of its id
// ("<ns>.svc.cluster.local"). A namespace that is not one of the scenario's
// ("ns-<j>" with j < Namespaces), or a node without either, gets PublicGroup.
func (s Scenario) Group(node *core.Node) string {
	ns := node.GetMetadata().GetFields()["NAMESPACE"].GetStringValue()
	if ns == "" {
		if parts := strings.Split(node.GetId(), "~"); len(parts) == 4 {
			ns, _, _ = strings.Cut(parts[3], ".")
		}
	}
	if _, ok := s.namespaceIndex(ns); ok {
		return ns
	}
	return PublicGroup
}

// namespaceIndex parses "ns-<j>" (canonical decimal) with 0 <= j < Namespaces.
func (s Scenario) namespaceIndex(ns string) (int, bool) {
	num, ok := strings.CutPrefix(ns, "ns-")
	if !ok {
		return 0, false
	}
	j, err := strconv.Atoi(num)
	if err != nil || j < 0 || j >= s.Namespaces || strconv.Itoa(j) != num {
		return 0, false
	}
	return j, true
}
