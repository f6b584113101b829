package main

import (
	"context"
	"slices"
	"testing"
	"time"

	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
)

// TestAdminReflection: the admin listener's server reflection lists the
// services, and serves the descriptors of Envoy's and Istio's types, so
// that a client knowing none of them (grpcurl) resolves an Any: here an
// UpstreamTlsContext is decoded from descriptors fetched by reflection
// alone, as grpcurl does.
func TestAdminReflection(t *testing.T) {
	admin := freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- serve(ctx, []string{"--upstream", "127.0.0.1:1", "--xds-listen", "127.0.0.1:0", "--admin-listen", admin,
			"--gossip-listen", "127.0.0.1:0", "--log-level", "error"})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	conn, err := grpc.NewClient(admin, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
	defer rcancel()
	var stream reflectionpb.ServerReflection_ServerReflectionInfoClient
	for {
		if stream, err = reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(rctx); err == nil {
			if err = stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err == nil {
				break
			}
		}
		if rctx.Err() != nil {
			t.Fatalf("reflection: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var services []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		services = append(services, s.GetName())
	}
	for _, want := range []string{"meshrelay.admin.v1.Admin", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} {
		if !slices.Contains(services, want) {
			t.Errorf("reflection lists %v, want %s among them", services, want)
		}
	}

	// Every file a symbol needs, as grpcurl collects them.
	files := map[string]*descriptorpb.FileDescriptorProto{}
	fetch := func(symbol string) {
		t.Helper()
		if err := stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: symbol}}); err != nil {
			t.Fatal(err)
		}
		resp, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if e := resp.GetErrorResponse(); e != nil {
			t.Fatalf("reflection of %s: %s", symbol, e.GetErrorMessage())
		}
		for _, b := range resp.GetFileDescriptorResponse().GetFileDescriptorProto() {
			fd := &descriptorpb.FileDescriptorProto{}
			if err := proto.Unmarshal(b, fd); err != nil {
				t.Fatal(err)
			}
			files[fd.GetName()] = fd
		}
	}
	const tlsContext = "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
	for _, symbol := range []string{tlsContext, "envoy.admin.v3.ConfigDump", "istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig",
		"istio.mesh.v1alpha1.ProxyConfig", "istio.networking.v1alpha3.ServiceEntry", "meshrelay.admin.v1.Admin"} {
		fetch(symbol)
	}
	set := &descriptorpb.FileDescriptorSet{}
	for _, fd := range files {
		set.File = append(set.File, fd)
	}
	// Built from what reflection served alone, not from this binary's types.
	reg, err := protodesc.NewFiles(set)
	if err != nil {
		t.Fatalf("the descriptors served do not form a registry: %v", err)
	}
	d, err := reg.FindDescriptorByName(tlsContext)
	if err != nil {
		t.Fatal(err)
	}
	a, err := anypb.New(&tlsv3.UpstreamTlsContext{Sni: "checkout.payments.svc.cluster.local"})
	if err != nil {
		t.Fatal(err)
	}
	m := dynamicpb.NewMessage(d.(protoreflect.MessageDescriptor))
	if err := proto.Unmarshal(a.GetValue(), m); err != nil {
		t.Fatal(err)
	}
	if sni := m.Get(m.Descriptor().Fields().ByName("sni")).String(); sni != "checkout.payments.svc.cluster.local" {
		t.Errorf("decoded by reflection, sni = %q", sni)
	}
	for _, name := range []protoreflect.FullName{"istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig", "istio.mesh.v1alpha1.ProxyConfig",
		"istio.networking.v1alpha3.ServiceEntry"} {
		if _, err := reg.FindDescriptorByName(name); err != nil {
			t.Errorf("reflection did not serve %s: %v", name, err)
		}
	}
}
