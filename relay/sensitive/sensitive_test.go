package sensitive_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	xdstype "github.com/cncf/xds/go/xds/type/v3"
	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	route "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	basicauth "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/basic_auth/v3"
	extauthz "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_authz/v3"
	hcm "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/meshrelay/meshrelay/relay/sensitive"
)

func mustAny(t testing.TB, m proto.Message) *anypb.Any {
	t.Helper()
	a, err := anypb.New(m)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func marshal(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func typeURL(m proto.Message) string {
	return "type.googleapis.com/" + string(m.ProtoReflect().Descriptor().FullName())
}

const pemKey = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----\n"

func inlineKeyTLS() *tlsv3.UpstreamTlsContext {
	return &tlsv3.UpstreamTlsContext{
		Sni: "db.example.com",
		CommonTlsContext: &tlsv3.CommonTlsContext{
			TlsCertificates: []*tlsv3.TlsCertificate{{
				CertificateChain: &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: "-----BEGIN CERTIFICATE-----"}},
				PrivateKey:       &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: pemKey}},
			}},
		},
	}
}

// sdsTLS is the TLS context istiod gives every mesh cluster: certificates
// by SDS, nothing secret inline.
func sdsTLS(host string) *tlsv3.UpstreamTlsContext {
	sds := &core.ConfigSource{
		ResourceApiVersion: core.ApiVersion_V3,
		ConfigSourceSpecifier: &core.ConfigSource_ApiConfigSource{ApiConfigSource: &core.ApiConfigSource{
			ApiType:             core.ApiConfigSource_GRPC,
			TransportApiVersion: core.ApiVersion_V3,
			GrpcServices: []*core.GrpcService{{TargetSpecifier: &core.GrpcService_EnvoyGrpc_{
				EnvoyGrpc: &core.GrpcService_EnvoyGrpc{ClusterName: "sds-grpc"}}}},
			SetNodeOnFirstMessageOnly: true,
		}},
	}
	return &tlsv3.UpstreamTlsContext{
		Sni: "outbound_.80_._." + host,
		CommonTlsContext: &tlsv3.CommonTlsContext{
			TlsParams: &tlsv3.TlsParameters{
				TlsMinimumProtocolVersion: tlsv3.TlsParameters_TLSv1_2,
				TlsMaximumProtocolVersion: tlsv3.TlsParameters_TLSv1_3,
			},
			AlpnProtocols:                  []string{"istio-peer-exchange", "istio"},
			TlsCertificateSdsSecretConfigs: []*tlsv3.SdsSecretConfig{{Name: "default", SdsConfig: sds}},
			ValidationContextType: &tlsv3.CommonTlsContext_CombinedValidationContext{CombinedValidationContext: &tlsv3.CommonTlsContext_CombinedCertificateValidationContext{
				DefaultValidationContext:         &tlsv3.CertificateValidationContext{},
				ValidationContextSdsSecretConfig: &tlsv3.SdsSecretConfig{Name: "ROOTCA", SdsConfig: sds},
			}},
		},
	}
}

// istioCluster is an outbound cluster shaped as istiod builds one for a
// ServiceEntry or Service: EDS, circuit breakers, Istio metadata, the
// metadata-exchange filter (a type this binary does not know), HTTP
// protocol options, and mTLS by SDS for Istio endpoints, plain otherwise.
func istioCluster(t testing.TB, i int, tls *tlsv3.UpstreamTlsContext) *cluster.Cluster {
	host := fmt.Sprintf("svc-%d.ns-%d.svc.cluster.local", i, i%50)
	name := "outbound|80||" + host
	if tls == nil {
		tls = sdsTLS(host)
	}
	meta, err := structpb.NewStruct(map[string]any{
		"services":              []any{map[string]any{"host": host, "name": fmt.Sprintf("svc-%d", i), "namespace": fmt.Sprintf("ns-%d", i%50)}},
		"default_original_port": 80,
	})
	if err != nil {
		t.Fatal(err)
	}
	max := wrapperspb.UInt32(4294967295)
	return &cluster.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &cluster.Cluster_Type{Type: cluster.Cluster_EDS},
		EdsClusterConfig: &cluster.Cluster_EdsClusterConfig{
			ServiceName: name,
			EdsConfig:   &core.ConfigSource{ResourceApiVersion: core.ApiVersion_V3, ConfigSourceSpecifier: &core.ConfigSource_Ads{Ads: &core.AggregatedConfigSource{}}},
		},
		LbPolicy: cluster.Cluster_LEAST_REQUEST,
		CircuitBreakers: &cluster.CircuitBreakers{Thresholds: []*cluster.CircuitBreakers_Thresholds{{
			MaxConnections: max, MaxPendingRequests: max, MaxRequests: max, MaxRetries: max, TrackRemaining: true,
		}}},
		Metadata: &core.Metadata{FilterMetadata: map[string]*structpb.Struct{"istio": meta}},
		Filters: []*cluster.Filter{{Name: "istio.metadata_exchange", TypedConfig: &anypb.Any{
			TypeUrl: "type.googleapis.com/envoy.tcp.metadataexchange.config.MetadataExchange",
			Value:   []byte("\n\x13istio-peer-exchange"),
		}}},
		TransportSocketMatches: []*cluster.Cluster_TransportSocketMatch{
			{
				Name:            "tlsMode-istio",
				Match:           &structpb.Struct{Fields: map[string]*structpb.Value{"tlsMode": structpb.NewStringValue("istio")}},
				TransportSocket: &core.TransportSocket{Name: "envoy.transport_sockets.tls", ConfigType: &core.TransportSocket_TypedConfig{TypedConfig: mustAny(t, tls)}},
			},
			{
				Name:            "tlsMode-disabled",
				Match:           &structpb.Struct{},
				TransportSocket: &core.TransportSocket{Name: "envoy.transport_sockets.raw_buffer"},
			},
		},
	}
}

func TestIn(t *testing.T) {
	withSocket := func(tls proto.Message) *cluster.Cluster {
		return &cluster.Cluster{Name: "c", TransportSocket: &core.TransportSocket{
			Name: "envoy.transport_sockets.tls", ConfigType: &core.TransportSocket_TypedConfig{TypedConfig: mustAny(t, tls)}}}
	}
	inlineKeyStruct, err := structpb.NewStruct(map[string]any{
		"common_tls_context": map[string]any{"tls_certificates": []any{map[string]any{"private_key": map[string]any{"inline_string": pemKey}}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	sniStruct, _ := structpb.NewStruct(map[string]any{"sni": "x"})
	listenerWith := func(filter proto.Message) *listener.Listener {
		return &listener.Listener{Name: "l", FilterChains: []*listener.FilterChain{{Filters: []*listener.Filter{{
			Name: "envoy.filters.network.http_connection_manager",
			ConfigType: &listener.Filter_TypedConfig{TypedConfig: mustAny(t, &hcm.HttpConnectionManager{
				StatPrefix:  "http",
				HttpFilters: []*hcm.HttpFilter{{Name: "f", ConfigType: &hcm.HttpFilter_TypedConfig{TypedConfig: mustAny(t, filter)}}},
			})},
		}}}}}
	}
	for _, c := range []struct {
		name string
		m    proto.Message
		want bool
	}{
		{"Istio cluster, mTLS by SDS", istioCluster(t, 1, nil), false},
		{"Istio cluster, inline key in a transport socket match", istioCluster(t, 1, inlineKeyTLS()), true},
		{"cluster, inline key in transport_socket", withSocket(inlineKeyTLS()), true},
		{"cluster, inline key in a TypedStruct", withSocket(&xdstype.TypedStruct{TypeUrl: typeURL(&tlsv3.UpstreamTlsContext{}), Value: inlineKeyStruct}), true},
		{"cluster, TypedStruct without a key", withSocket(&xdstype.TypedStruct{TypeUrl: typeURL(&tlsv3.UpstreamTlsContext{}), Value: sniStruct}), false},
		{"cluster, an Any of a type unknown here", &cluster.Cluster{Name: "c", TransportSocket: &core.TransportSocket{
			ConfigType: &core.TransportSocket_TypedConfig{TypedConfig: &anypb.Any{TypeUrl: "type.googleapis.com/example.Unknown", Value: []byte(pemKey)}}}}, false},
		{"cluster, EDS over Google gRPC with an inline client key", &cluster.Cluster{Name: "c", EdsClusterConfig: &cluster.Cluster_EdsClusterConfig{
			EdsConfig: &core.ConfigSource{ConfigSourceSpecifier: &core.ConfigSource_ApiConfigSource{ApiConfigSource: &core.ApiConfigSource{
				GrpcServices: []*core.GrpcService{{TargetSpecifier: &core.GrpcService_GoogleGrpc_{GoogleGrpc: &core.GrpcService_GoogleGrpc{
					ChannelCredentials: &core.GrpcService_GoogleGrpc_ChannelCredentials{CredentialSpecifier: &core.GrpcService_GoogleGrpc_ChannelCredentials_SslCredentials{
						SslCredentials: &core.GrpcService_GoogleGrpc_SslCredentials{PrivateKey: &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: pemKey}}}}},
				}}}},
			}}},
		}}, true},
		{"endpoints", &endpoint.ClusterLoadAssignment{ClusterName: "c", Endpoints: []*endpoint.LocalityLbEndpoints{{}}}, false},
		{"listener, session ticket keys", &listener.Listener{Name: "l", FilterChains: []*listener.FilterChain{{
			TransportSocket: &core.TransportSocket{ConfigType: &core.TransportSocket_TypedConfig{TypedConfig: mustAny(t, &tlsv3.DownstreamTlsContext{
				SessionTicketKeysType: &tlsv3.DownstreamTlsContext_SessionTicketKeys{SessionTicketKeys: &tlsv3.TlsSessionTicketKeys{
					Keys: []*core.DataSource{{Specifier: &core.DataSource_InlineBytes{InlineBytes: make([]byte, 80)}}}}},
			})}}}}}, true},
		{"listener, basic auth users in an HTTP filter (Any in Any)", listenerWith(&basicauth.BasicAuth{
			Users: &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: "user:{SHA}hash"}}}), true},
		{"listener, basic auth with no users", listenerWith(&basicauth.BasicAuth{Realm: "r"}), false},
		{"route, ext_authz context extensions (a sensitive map)", &route.RouteConfiguration{Name: "r", VirtualHosts: []*route.VirtualHost{{
			Name: "v", TypedPerFilterConfig: map[string]*anypb.Any{"envoy.filters.http.ext_authz": mustAny(t, &extauthz.ExtAuthzPerRoute{
				Override: &extauthz.ExtAuthzPerRoute_CheckSettings{CheckSettings: &extauthz.CheckSettings{ContextExtensions: map[string]string{"k": "v"}}}})},
		}}}, true},
		{"secret, private key", &tlsv3.Secret{Name: "s", Type: &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
			PrivateKey: &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: pemKey}}}}}, true},
		{"secret, a root CA only", &tlsv3.Secret{Name: "s", Type: &tlsv3.Secret_ValidationContext{ValidationContext: &tlsv3.CertificateValidationContext{
			TrustedCa: &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: "-----BEGIN CERTIFICATE-----"}}}}}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := sensitive.In(typeURL(c.m), marshal(t, c.m))
			if err != nil || got != c.want {
				t.Errorf("In(%s) = %v, %v; want %v, nil", typeURL(c.m), got, err, c.want)
			}
			// (The reference does not follow TypedStruct.)
			if ref := reference(t, c.m.ProtoReflect(), 0); ref != c.want && !strings.Contains(c.name, "TypedStruct") {
				t.Errorf("the reference walk says %v, want %v (the case is wrong)", ref, c.want)
			}
		})
	}
}

func TestInCannotCheck(t *testing.T) {
	if _, err := sensitive.In("type.googleapis.com/example.Unknown", []byte("x")); !errors.Is(err, sensitive.ErrUnknownType) {
		t.Errorf("In(unknown type) error = %v, want ErrUnknownType", err)
	}
	// A transport socket (field 24) cut short.
	body := append(marshal(t, &cluster.Cluster{Name: "c"}), 0xc2, 0x01, 0x10, 0x0a)
	if got, err := sensitive.In(typeURL(&cluster.Cluster{}), body); err == nil {
		t.Errorf("In(truncated cluster) = %v, nil; want an error", got)
	}
	// Nested deeper than In follows: a TypedStruct per level would do, an
	// Any within an Any is simplest.
	var a proto.Message = &tlsv3.UpstreamTlsContext{}
	for range 150 {
		a = mustAny(t, a)
	}
	if _, err := sensitive.In(typeURL(a), marshal(t, a)); err == nil {
		t.Error("In(an Any nested 150 deep) succeeded; want an error")
	}
}

// reference is the slow, obvious answer: decode everything and look at
// every set field, following Any (not TypedStruct).
func reference(t testing.TB, m protoreflect.Message, depth int) bool {
	if depth > 200 {
		return false
	}
	if a, ok := m.Interface().(*anypb.Any); ok {
		inner, err := a.UnmarshalNew()
		if err != nil {
			return false
		}
		return reference(t, inner.ProtoReflect(), depth+1)
	}
	found := false
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if sensitive.Field(fd) {
			found = true
			return false
		}
		switch {
		case fd.IsList() && fd.Message() != nil:
			for i := range v.List().Len() {
				found = found || reference(t, v.List().Get(i).Message(), depth+1)
			}
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				found = found || reference(t, mv.Message(), depth+1)
				return !found
			})
		case !fd.IsList() && !fd.IsMap() && fd.Message() != nil:
			found = reference(t, v.Message(), depth+1)
		}
		return !found
	})
	return found
}

// fuzzTypes are the types FuzzIn reads bodies as.
var fuzzTypes = []proto.Message{&cluster.Cluster{}, &listener.Listener{}, &route.RouteConfiguration{}, &tlsv3.Secret{}, &endpoint.ClusterLoadAssignment{}}

// FuzzIn: In never panics on any body, and never misses a sensitive field
// the reference walk finds in a body protobuf's decoder accepts.
func FuzzIn(f *testing.F) {
	f.Add(uint8(0), marshal(f, istioCluster(f, 1, nil)))
	f.Add(uint8(0), marshal(f, istioCluster(f, 2, inlineKeyTLS())))
	f.Add(uint8(3), marshal(f, &tlsv3.Secret{Name: "s", Type: &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
		PrivateKey: &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: pemKey}}}}}))
	f.Add(uint8(1), []byte{0x0a, 0x01, 'l'})
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		typ := fuzzTypes[int(which)%len(fuzzTypes)]
		got, err := sensitive.In(typeURL(typ), body)
		m := typ.ProtoReflect().New()
		if proto.Unmarshal(body, m.Interface()) != nil {
			return
		}
		if err == nil && !got && reference(t, m, 0) {
			t.Fatalf("In missed a sensitive field the reference found in %s", protojson.Format(m.Interface()))
		}
	})
}
