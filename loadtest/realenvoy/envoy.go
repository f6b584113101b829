// Package realenvoy runs real Envoy processes as peers in tests, benchmarks
// and the demo: it finds the pinned Envoy binary (loadtest/realenvoy/install
// installs it), starts it with a generated bootstrap whose ADS points at a
// given address, reads its admin interface, and stops it. The simulated Envoy is loadtest/envoy.
package realenvoy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"github.com/envoyproxy/go-control-plane/pkg/wellknown"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Config describes one Envoy process.
type Config struct {
	// Binary is the Envoy binary (Find). Required.
	Binary string
	// XDS is the "host:port" of the ADS server. Required.
	XDS string
	// Delta makes the ADS stream Delta (DELTA_GRPC); else SotW (GRPC).
	Delta bool
	// Node is the node the Envoy presents. Required (an id and a cluster).
	Node *core.Node
	// TLS, if set, dials the ADS server with TLS (and a bearer token), as
	// istio-agent does; nil is plaintext.
	TLS *TLS
	// Ingress, if set, is a listener of the Envoy's own.
	Ingress *Ingress
	// Dir holds the bootstrap and the log (a test's t.TempDir()). Required.
	Dir string
	// LogLevel is Envoy's log level. Default "warning".
	LogLevel string
}

// Ingress is a listener in the Envoy's bootstrap that sends every request
// by route configuration Route, fetched over ADS (RDS): requests reach
// this Envoy on Listen whatever listeners xDS gives it (those of several
// Envoys of one key are the same, and would bind the same port).
type Ingress struct {
	// Listen is the "ip:port" it binds.
	Listen string
	// Route names the RouteConfiguration.
	Route string
}

// TLS is how the Envoy dials a TLS xDS port.
type TLS struct {
	// CAFile holds the roots the server's certificate must chain to.
	CAFile string
	// ServerName is sent as SNI and must be a DNS SAN of the server.
	ServerName string
	// CertFile and KeyFile, if set, are the client certificate (mTLS).
	CertFile, KeyFile string
	// Token, if set, is sent as "authorization: Bearer <Token>" on the
	// stream. It is written into the bootstrap in Dir (mode 0600), which
	// Stop removes.
	Token string
}

// Envoy is a running Envoy process.
type Envoy struct {
	cfg       Config
	cmd       *exec.Cmd
	admin     string // "127.0.0.1:port"
	bootstrap string
	logPath   string
	client    *http.Client

	waitOnce sync.Once
	exited   chan struct{}
	waitErr  error
}

// Start writes the bootstrap and starts Envoy, and returns once its admin
// interface answers. The caller must call Stop.
func Start(ctx context.Context, cfg Config) (*Envoy, error) {
	switch {
	case cfg.Binary == "":
		return nil, errors.New("realenvoy: Config.Binary is required")
	case cfg.XDS == "":
		return nil, errors.New("realenvoy: Config.XDS is required")
	case cfg.Node.GetId() == "" || cfg.Node.GetCluster() == "":
		return nil, errors.New("realenvoy: Config.Node needs an id and a cluster")
	case cfg.Dir == "":
		return nil, errors.New("realenvoy: Config.Dir is required")
	}
	if cfg.LogLevel == "" {
		cfg.LogLevel = "warning"
	}
	b, err := bootstrap(cfg)
	if err != nil {
		return nil, err
	}
	js, err := protojson.Marshal(b)
	if err != nil {
		return nil, fmt.Errorf("realenvoy: bootstrap: %w", err)
	}
	e := &Envoy{
		cfg:       cfg,
		bootstrap: filepath.Join(cfg.Dir, "bootstrap.json"),
		logPath:   filepath.Join(cfg.Dir, "envoy.log"),
		client:    &http.Client{Timeout: 10 * time.Second},
		exited:    make(chan struct{}),
	}
	if err := os.WriteFile(e.bootstrap, js, 0o600); err != nil {
		return nil, err
	}
	adminPath := filepath.Join(cfg.Dir, "admin-address")
	os.Remove(adminPath)
	e.cmd = exec.Command(cfg.Binary,
		"--config-path", e.bootstrap,
		"--admin-address-path", adminPath,
		// A base ID of its own, so that several Envoys run side by side
		// (hot restart's shared memory is keyed by it).
		"--use-dynamic-base-id",
		"--concurrency", "1",
		"--log-level", cfg.LogLevel,
		"--log-path", e.logPath,
	)
	// A process group of its own: Stop kills whatever it started.
	e.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	var stderr bytes.Buffer
	e.cmd.Stdout, e.cmd.Stderr = io.Discard, &stderr
	if err := e.cmd.Start(); err != nil {
		return nil, fmt.Errorf("realenvoy: start %s: %w", cfg.Binary, err)
	}
	go func() {
		e.waitErr = e.cmd.Wait()
		close(e.exited)
	}()
	// The admin address file appears once the admin listener is bound.
	wait := time.NewTimer(adminWait)
	defer wait.Stop()
	for {
		if b, err := os.ReadFile(adminPath); err == nil && len(bytes.TrimSpace(b)) > 0 {
			e.admin = string(bytes.TrimSpace(b))
			break
		}
		select {
		case <-e.exited:
			// Envoy prints a bootstrap it refuses, token included.
			why := e.redact(fmt.Sprintf("%v: %s %s", e.waitErr, bytes.TrimSpace(stderr.Bytes()), e.LogTail(10)))
			return nil, fmt.Errorf("realenvoy: envoy exited before its admin listener was up: %s", why)
		case <-wait.C:
			e.Stop()
			return nil, fmt.Errorf("realenvoy: envoy's admin listener not up after %v: %s", adminWait, e.redact(e.LogTail(10)))
		case <-ctx.Done():
			e.Stop()
			return nil, fmt.Errorf("realenvoy: waiting for envoy's admin listener: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	return e, nil
}

// adminWait bounds Start's wait for the admin listener, whatever ctx says.
const adminWait = 30 * time.Second

// redact replaces the bearer token, if any, in text with a placeholder.
func (e *Envoy) redact(text string) string {
	if t := e.cfg.TLS; t != nil && t.Token != "" {
		return strings.ReplaceAll(text, t.Token, "[token]")
	}
	return text
}

// Pid is the Envoy process's id.
func (e *Envoy) Pid() int { return e.cmd.Process.Pid }

// AdminAddr is the "127.0.0.1:port" of Envoy's admin interface.
func (e *Envoy) AdminAddr() string { return e.admin }

// Exited is closed once the process has ended.
func (e *Envoy) Exited() <-chan struct{} { return e.exited }

// Stop ends Envoy: SIGTERM, then SIGKILL to its process group if it has
// not exited within five seconds. It returns once the process is gone, and
// removes the bootstrap (it may hold a token). Safe to call more than once.
func (e *Envoy) Stop() {
	e.waitOnce.Do(func() {
		pgid := e.cmd.Process.Pid
		syscall.Kill(-pgid, syscall.SIGTERM)
		select {
		case <-e.exited:
		case <-time.After(5 * time.Second):
			syscall.Kill(-pgid, syscall.SIGKILL)
			<-e.exited
		}
		// Anything it left in its group.
		syscall.Kill(-pgid, syscall.SIGKILL)
		os.Remove(e.bootstrap)
	})
}

// StopAll stops every Envoy of es at once (Stop waits up to five seconds
// for each).
func StopAll(es []*Envoy) {
	var wg sync.WaitGroup
	for _, e := range es {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.Stop()
		}()
	}
	wg.Wait()
}

// LogTail returns the last n lines of Envoy's log, the bearer token, if
// any, replaced.
func (e *Envoy) LogTail(n int) string {
	b, err := os.ReadFile(e.logPath)
	if err != nil {
		return ""
	}
	return e.redact(lastLines(b, n))
}

// bootstrap builds cfg's bootstrap: the node, an admin listener on an
// ephemeral loopback port, and ADS (CDS and LDS over it) through a static
// cluster "xds" to cfg.XDS over HTTP/2.
func bootstrap(cfg Config) (*bootstrapv3.Bootstrap, error) {
	host, portStr, err := splitHostPort(cfg.XDS)
	if err != nil {
		return nil, fmt.Errorf("realenvoy: Config.XDS: %w", err)
	}
	port, _ := strconv.ParseUint(portStr, 10, 16)
	h2, err := anypb.New(&httpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_{ExplicitHttpConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig{
			ProtocolConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_Http2ProtocolOptions{Http2ProtocolOptions: &core.Http2ProtocolOptions{}},
		}},
	})
	if err != nil {
		return nil, err
	}
	xds := &clusterv3.Cluster{
		Name:                 "xds",
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STATIC},
		ConnectTimeout:       durationpb.New(time.Second),
		LoadAssignment: &endpointv3.ClusterLoadAssignment{
			ClusterName: "xds",
			Endpoints: []*endpointv3.LocalityLbEndpoints{{LbEndpoints: []*endpointv3.LbEndpoint{{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: socketAddress(host, uint32(port))}},
			}}}},
		},
		TypedExtensionProtocolOptions: map[string]*anypb.Any{"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": h2},
	}
	grpcService := &core.GrpcService{TargetSpecifier: &core.GrpcService_EnvoyGrpc_{EnvoyGrpc: &core.GrpcService_EnvoyGrpc{ClusterName: "xds"}}}
	if t := cfg.TLS; t != nil {
		ctx := &tlsv3.UpstreamTlsContext{
			Sni: t.ServerName,
			CommonTlsContext: &tlsv3.CommonTlsContext{
				AlpnProtocols: []string{"h2"},
				ValidationContextType: &tlsv3.CommonTlsContext_ValidationContext{ValidationContext: &tlsv3.CertificateValidationContext{
					TrustedCa: &core.DataSource{Specifier: &core.DataSource_Filename{Filename: t.CAFile}},
					MatchTypedSubjectAltNames: []*tlsv3.SubjectAltNameMatcher{{
						SanType: tlsv3.SubjectAltNameMatcher_DNS,
						Matcher: &matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Exact{Exact: t.ServerName}},
					}},
				}},
			},
		}
		if t.CertFile != "" {
			ctx.CommonTlsContext.TlsCertificates = []*tlsv3.TlsCertificate{{
				CertificateChain: &core.DataSource{Specifier: &core.DataSource_Filename{Filename: t.CertFile}},
				PrivateKey:       &core.DataSource{Specifier: &core.DataSource_Filename{Filename: t.KeyFile}},
			}}
		}
		ts, err := anypb.New(ctx)
		if err != nil {
			return nil, err
		}
		xds.TransportSocket = &core.TransportSocket{Name: "envoy.transport_sockets.tls", ConfigType: &core.TransportSocket_TypedConfig{TypedConfig: ts}}
		if t.Token != "" {
			grpcService.InitialMetadata = []*core.HeaderValue{{Key: "authorization", Value: "Bearer " + t.Token}}
		}
	}
	apiType := core.ApiConfigSource_GRPC
	if cfg.Delta {
		apiType = core.ApiConfigSource_DELTA_GRPC
	}
	ads := &core.ConfigSource{
		ConfigSourceSpecifier: &core.ConfigSource_Ads{Ads: &core.AggregatedConfigSource{}},
		ResourceApiVersion:    core.ApiVersion_V3,
	}
	static := &bootstrapv3.Bootstrap_StaticResources{Clusters: []*clusterv3.Cluster{xds}}
	if in := cfg.Ingress; in != nil {
		l, err := ingressListener(in, ads)
		if err != nil {
			return nil, err
		}
		static.Listeners = []*listenerv3.Listener{l}
	}
	return &bootstrapv3.Bootstrap{
		Node: cfg.Node,
		Admin: &bootstrapv3.Admin{
			Address: socketAddress("127.0.0.1", 0),
		},
		StaticResources: static,
		DynamicResources: &bootstrapv3.Bootstrap_DynamicResources{
			AdsConfig: &core.ApiConfigSource{
				ApiType:                   apiType,
				TransportApiVersion:       core.ApiVersion_V3,
				GrpcServices:              []*core.GrpcService{grpcService},
				SetNodeOnFirstMessageOnly: true,
			},
			CdsConfig: ads,
			LdsConfig: ads,
		},
	}, nil
}

// ingressListener builds in's listener: an HTTP connection manager whose
// routes come from RDS over ADS.
func ingressListener(in *Ingress, ads *core.ConfigSource) (*listenerv3.Listener, error) {
	host, portStr, err := splitHostPort(in.Listen)
	if err != nil {
		return nil, fmt.Errorf("realenvoy: Config.Ingress.Listen: %w", err)
	}
	if in.Route == "" {
		return nil, errors.New("realenvoy: Config.Ingress.Route is required")
	}
	port, _ := strconv.ParseUint(portStr, 10, 16)
	router, err := anypb.New(&routerv3.Router{})
	if err != nil {
		return nil, err
	}
	hcm, err := anypb.New(&hcmv3.HttpConnectionManager{
		StatPrefix: "ingress",
		RouteSpecifier: &hcmv3.HttpConnectionManager_Rds{Rds: &hcmv3.Rds{
			ConfigSource: ads, RouteConfigName: in.Route,
		}},
		HttpFilters: []*hcmv3.HttpFilter{{Name: wellknown.Router, ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: router}}},
	})
	if err != nil {
		return nil, err
	}
	return &listenerv3.Listener{
		Name:    "ingress",
		Address: socketAddress(host, uint32(port)),
		FilterChains: []*listenerv3.FilterChain{{Filters: []*listenerv3.Filter{{
			Name:       wellknown.HTTPConnectionManager,
			ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: hcm},
		}}}},
	}, nil
}

func socketAddress(host string, port uint32) *core.Address {
	return &core.Address{Address: &core.Address_SocketAddress{SocketAddress: &core.SocketAddress{
		Address:       host,
		PortSpecifier: &core.SocketAddress_PortValue{PortValue: port},
	}}}
}

func splitHostPort(hp string) (host, port string, err error) {
	host, port, err = net.SplitHostPort(hp)
	if err != nil {
		return "", "", err
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 || host == "" {
		return "", "", fmt.Errorf("want host:port, got %q", hp)
	}
	return host, port, nil
}
