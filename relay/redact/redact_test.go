package redact

import (
	"bytes"
	"strings"
	"testing"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/meshrelay/meshrelay/relay/xds"
)

const (
	privateKey = "-----BEGIN EC PRIVATE KEY-----\nsecret-key-bytes\n-----END EC PRIVATE KEY-----"
	certChain  = "-----BEGIN CERTIFICATE-----\npublic-cert\n-----END CERTIFICATE-----"
)

func inline(s string) *core.DataSource {
	return &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: s}}
}

func mustAny(m proto.Message) *anypb.Any {
	a, err := anypb.New(m)
	if err != nil {
		panic(err)
	}
	return a
}

// TestRedact: what Envoy marks sensitive is "[redacted]" wherever it is
// (in a Secret, in a cluster's TLS context inside an Any), what it does not
// mark is kept, an Any of a type the relay does not know is not shown, and
// the resource given is never changed.
func TestRedact(t *testing.T) {
	secret := &tlsv3.Secret{Name: "default", Type: &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
		CertificateChain: inline(certChain), PrivateKey: inline(privateKey), Password: inline("hunter2"),
	}}}
	generic := &tlsv3.Secret{Name: "token", Type: &tlsv3.Secret_GenericSecret{GenericSecret: &tlsv3.GenericSecret{Secret: inline("bearer-xyz")}}}
	upstreamTLS := &tlsv3.UpstreamTlsContext{CommonTlsContext: &tlsv3.CommonTlsContext{
		TlsCertificates: []*tlsv3.TlsCertificate{{CertificateChain: inline(certChain), PrivateKey: inline(privateKey)}},
	}, Sni: "svc.example"}
	c := &cluster.Cluster{Name: "outbound|443||svc", TransportSocket: &core.TransportSocket{Name: "tls",
		ConfigType: &core.TransportSocket_TypedConfig{TypedConfig: mustAny(upstreamTLS)}},
		Metadata: &core.Metadata{TypedFilterMetadata: map[string]*anypb.Any{
			"istio": {TypeUrl: "type.googleapis.com/istio.unknown.v1.Thing", Value: []byte("opaque")},
		}}}

	for _, tc := range []struct {
		name       string
		in         proto.Message
		gone, kept []string
	}{
		{"tls certificate", secret, []string{"secret-key-bytes", "hunter2"}, []string{"public-cert", "default"}},
		{"generic secret", generic, []string{"bearer-xyz"}, []string{"token"}},
		{"cluster with an inline TLS context and unknown metadata", c, []string{"secret-key-bytes", "opaque"}, []string{"public-cert", "svc.example", "outbound|443||svc", "istio.unknown.v1.Thing"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := mustAny(tc.in)
			before := proto.Clone(in)
			out, err := Any(in)
			if err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(in, before) {
				t.Fatal("redactAny changed the resource it was given")
			}
			m, err := out.UnmarshalNew()
			if err != nil {
				t.Fatalf("the redacted resource does not decode: %v", err)
			}
			text := deepText(t, m)
			for _, s := range tc.gone {
				if strings.Contains(text, s) {
					t.Errorf("redacted %s still holds %q:\n%s", tc.name, s, text)
				}
			}
			for _, s := range append(tc.kept, redacted) {
				if !strings.Contains(text, s) {
					t.Errorf("redacted %s lost %q:\n%s", tc.name, s, text)
				}
			}
		})
	}
}

// TestRedactDropsUnknownFields: a field this binary's protos do not know
// (sent by a newer control plane) may be a sensitive one: it is dropped.
func TestRedactDropsUnknownFields(t *testing.T) {
	b, err := proto.Marshal(&tlsv3.Secret{Name: "default"})
	if err != nil {
		t.Fatal(err)
	}
	b = protowire.AppendTag(b, 999, protowire.BytesType)
	b = protowire.AppendBytes(b, []byte("unknown-secret"))
	out, err := Any(&anypb.Any{TypeUrl: xds.TypeSecret, Value: b})
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(out.GetValue(), []byte("unknown-secret")) {
		t.Fatal("an unknown field survived redaction")
	}
	var got tlsv3.Secret
	if err := out.UnmarshalTo(&got); err != nil || got.GetName() != "default" {
		t.Fatalf("redacted = %v, %v; want the secret's name kept", &got, err)
	}
}

// deepText renders m as JSON, every Any it holds unpacked at any depth.
func deepText(t testing.TB, m proto.Message) string {
	t.Helper()
	b, err := protojson.Marshal(m)
	if err != nil {
		t.Fatalf("render %T: %v", m, err)
	}
	return string(b)
}

// FuzzRedact: resources come from the upstream, untrusted. Whatever bytes a
// Secret or a Cluster holds, redaction returns an error or a resource that
// decodes and is its own redaction (nothing sensitive is left to redact).
func FuzzRedact(f *testing.F) {
	secret, _ := proto.Marshal(&tlsv3.Secret{Name: "s", Type: &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{PrivateKey: inline("k")}}})
	ctx, _ := anypb.New(&tlsv3.UpstreamTlsContext{Sni: "x", CommonTlsContext: &tlsv3.CommonTlsContext{TlsCertificates: []*tlsv3.TlsCertificate{{PrivateKey: inline("k")}}}})
	c, _ := proto.Marshal(&cluster.Cluster{Name: "c", TransportSocket: &core.TransportSocket{ConfigType: &core.TransportSocket_TypedConfig{TypedConfig: ctx}}})
	nested, _ := anypb.New(wrapperspb.String("v"))
	deep, _ := proto.Marshal(&cluster.Cluster{Name: "d", TransportSocket: &core.TransportSocket{ConfigType: &core.TransportSocket_TypedConfig{TypedConfig: nested}}})
	f.Add(xds.TypeSecret, secret)
	f.Add(xds.TypeCluster, c)
	f.Add(xds.TypeCluster, deep)
	f.Add(xds.TypeCluster, []byte{0xff, 0x01})
	f.Fuzz(func(t *testing.T, typeURL string, value []byte) {
		if typeURL != xds.TypeSecret && typeURL != xds.TypeCluster {
			typeURL = xds.TypeCluster
		}
		out, err := Any(&anypb.Any{TypeUrl: typeURL, Value: value})
		if err != nil {
			return
		}
		again, err := Any(out)
		if err != nil {
			t.Fatalf("redacting a redacted resource failed: %v", err)
		}
		a, _ := out.UnmarshalNew()
		b, _ := again.UnmarshalNew()
		if !proto.Equal(a, b) {
			t.Fatalf("redaction is not idempotent:\n%v\n%v", a, b)
		}
		if bytes.Contains(out.GetValue(), []byte("secret-key-bytes")) {
			t.Fatal("a private key survived")
		}
	})
}
