package xds

import (
	"bytes"
	"runtime"
	"slices"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	runtimev3 "github.com/envoyproxy/go-control-plane/envoy/service/runtime/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	meshv1alpha1 "istio.io/api/mesh/v1alpha1"

	"github.com/meshrelay/meshrelay/relay/xds/ndspb"
)

// typeOther is a type the relay does not cache.
const typeOther = "type.googleapis.com/meshrelay.test.v1.PerProxy"

// decodeTypes are the type URLs FuzzDecode picks from: every cached type,
// and one that is not.
var decodeTypes = append(slices.Clone(PushOrder), typeOther)

// FuzzDecode decodes arbitrary bytes as a resource of a type picked by
// typeIdx (below 128: the Any carries the same type URL; from 128 on:
// another one), with an expected name as Delta gives one.
func FuzzDecode(f *testing.F) {
	add := func(typeIdx uint8, name string, m proto.Message) {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(typeIdx, name, b)
	}
	idx := func(typeURL string) uint8 { return uint8(slices.Index(decodeTypes, typeURL)) }
	add(idx(TypeCluster), "", mkCluster("c0"))
	add(idx(TypeCluster), "c0", mkCluster("c0"))
	add(idx(TypeCluster), "c1", mkCluster("c0")) // mismatched name
	add(idx(TypeEndpoint), "c0", mkCLA("c0", 8080, 9090))
	add(idx(TypeListener), "", mkListener("l80", "r80"))
	add(idx(TypeRoute), "r80", mkRoute("r80", "c0", "c1"))
	add(idx(TypeRuntime), "", &runtimev3.Runtime{Name: "rt0", Layer: &structpb.Struct{}})
	add(idx(TypeCluster), "", &core.Node{Id: "not a cluster"})
	add(idx(TypeEndpoint), "", mkCluster("c0")) // a cluster's bytes read as a CLA
	add(idx(typeOther), "", mkCluster("c0"))    // not a cached type
	nt := &ndspb.NameTable{Table: map[string]*ndspb.NameTable_NameInfo{"c0.ns1.svc.cluster.local": {Ips: []string{"10.96.0.1"}}}}
	add(idx(TypeNameTable), "", nt)  // unnamed, as istiod sends it
	add(idx(TypeNameTable), "x", nt) // named anyhow
	add(idx(TypeProxyConfig), "", &meshv1alpha1.ProxyConfig{CaCertificatesPem: []string{"-----BEGIN CERTIFICATE-----"}})
	add(128+idx(TypeCluster), "", mkCluster("c0"))
	f.Add(idx(TypeCluster), "", []byte{})
	f.Add(idx(TypeRoute), "", []byte{0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f}) // truncated
	f.Add(idx(TypeListener), "x", []byte("\xff\xfe garbage"))

	f.Fuzz(func(t *testing.T, typeIdx uint8, name string, value []byte) {
		typeURL := decodeTypes[int(typeIdx%128)%len(decodeTypes)]
		anyType := typeURL
		if typeIdx >= 128 {
			anyType = decodeTypes[(int(typeIdx%128)+1)%len(decodeTypes)]
		}
		s := NewStore()
		x, err := s.Decode(typeURL, &anypb.Any{TypeUrl: anyType, Value: value}, name)
		if err != nil {
			if x != nil {
				t.Fatalf("decode(%s, %q) = %v, %v: a resource with an error", ShortType(typeURL), name, x, err)
			}
			if _, err2 := s.Decode(typeURL, &anypb.Any{TypeUrl: anyType, Value: value}, name); err2 == nil {
				t.Fatalf("decode(%s, %q) failed (%v), then succeeded", ShortType(typeURL), name, err)
			}
			return
		}
		if anyType != typeURL {
			t.Fatalf("decode(%s) accepted an Any of type %s", ShortType(typeURL), anyType)
		}
		if x.Name == "" {
			t.Fatalf("decode(%s, %q) = a resource without a name", ShortType(typeURL), name)
		}
		if Singleton(typeURL) {
			if x.Name != SingletonName {
				t.Fatalf("decode(%s, %q) = resource named %q, want %q", ShortType(typeURL), name, x.Name, SingletonName)
			}
		} else if name != "" && x.Name != name {
			t.Fatalf("decode(%s, %q) = resource named %q", ShortType(typeURL), name, x.Name)
		}
		if want := ContentHash(typeURL, value); x.Hash != want {
			t.Fatalf("decode(%s, %q).Hash = %s, want %s", ShortType(typeURL), name, x.Hash, want)
		}
		if x.Type != typeURL || x.Body.GetTypeUrl() != typeURL || !bytes.Equal(x.Body.GetValue(), value) {
			t.Fatalf("decode(%s, %q) = resource of type %s, body %s (%d bytes), want the input (%d bytes)",
				ShortType(typeURL), name, x.Type, x.Body.GetTypeUrl(), len(x.Body.GetValue()), len(value))
		}
		// The same content, in other bytes and with or without a name,
		// is the same *Resource (interning); another name is refused.
		for _, want := range []string{"", x.Name} {
			y, err := s.Decode(typeURL, &anypb.Any{TypeUrl: typeURL, Value: bytes.Clone(value)}, want)
			if err != nil || y != x {
				t.Fatalf("decode(%s, %q) again = %p, %v, want %p (interned)", ShortType(typeURL), want, y, err, x)
			}
		}
		// (A Singleton's one resource is the relay's whatever its name.)
		if y, err := s.Decode(typeURL, &anypb.Any{TypeUrl: typeURL, Value: value}, x.Name+"~other"); err == nil && !Singleton(typeURL) {
			t.Fatalf("decode(%s, %q) of a resource named %q = %p, want an error", ShortType(typeURL), x.Name+"~other", x.Name, y)
		}
		if y := s.Lookup(x.Hash); y != x {
			t.Fatalf("lookup(%s) = %p, want %p", x.Hash, y, x)
		}
		runtime.KeepAlive(x)
	})
}
