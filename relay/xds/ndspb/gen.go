// Package ndspb is Istio's Name Discovery Service resource, the NameTable
// pilot-agent's DNS proxy asks istiod for (type URL
// type.googleapis.com/istio.networking.nds.v1.NameTable). nds.proto is a
// copy of istio.io/istio/pkg/dns/proto/nds.proto: the istio module, not
// istio.io/api, holds it, and the relay must not link istiod to read it.
//
// The generated file is committed: a build needs no protoc. Regenerate it,
// after installing protoc 3.21.12 (Debian's protobuf-compiler) and
// protoc-gen-go v1.36.12, with:
//
//	go generate ./relay/xds/ndspb
package ndspb

//go:generate protoc --go_out=. --go_opt=paths=source_relative nds.proto
