package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// rawClient is an ADS client that sends exactly what a test says and
// checks what comes back: protocol conformance needs that control. (The
// simulated Envoy in loadtest/envoy behaves like Envoy instead.)
type rawClient struct {
	t     *testing.T
	delta bool
	node  *core.Node
	sent  bool // node sent

	sotw  discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient
	dstr  discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	msgs  chan proto.Message
	errc  chan error
	close func()

	// SotW: latest nonce and version received, by type.
	nonce   map[string]string
	version map[string]string
	nonces  map[string]bool     // every nonce seen on this stream
	subs    map[string][]string // SotW: the subscription, repeated by ack
	barrier int
	last    proto.Message // the latest response received
	reading sync.Mutex    // held by pause: the receiver stops calling Recv
}

func newRawClient(t *testing.T, conn grpc.ClientConnInterface, delta bool, n *core.Node) *rawClient {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &rawClient{
		t: t, delta: delta, node: n,
		msgs: make(chan proto.Message, 64), errc: make(chan error, 1),
		nonce: map[string]string{}, version: map[string]string{}, nonces: map[string]bool{}, subs: map[string][]string{},
	}
	ads := discovery.NewAggregatedDiscoveryServiceClient(conn)
	var recv func() (proto.Message, error)
	var err error
	if delta {
		c.dstr, err = ads.DeltaAggregatedResources(ctx)
		recv = func() (proto.Message, error) { return c.dstr.Recv() }
	} else {
		c.sotw, err = ads.StreamAggregatedResources(ctx)
		recv = func() (proto.Message, error) { return c.sotw.Recv() }
	}
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c.reading.Lock()
			c.reading.Unlock() //nolint:staticcheck // a gate: pause holds it
			m, err := recv()
			if err != nil {
				c.errc <- err
				return
			}
			select {
			case c.msgs <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	c.close = func() { cancel(); <-done }
	t.Cleanup(c.close)
	return c
}

func (c *rawClient) withNode() *core.Node {
	if c.sent {
		return nil
	}
	c.sent = true
	return c.node
}

// send sends a raw request (the node is added to the first one).
func (c *rawClient) send(m proto.Message) {
	c.t.Helper()
	var err error
	switch r := m.(type) {
	case *discovery.DiscoveryRequest:
		if r.Node == nil {
			r.Node = c.withNode()
		}
		err = c.sotw.Send(r)
	case *discovery.DeltaDiscoveryRequest:
		if r.Node == nil {
			r.Node = c.withNode()
		}
		err = c.dstr.Send(r)
	}
	// io.EOF: the server ended the stream (it may refuse one before it
	// reads a request); its status is what streamErr and recv report.
	if err != nil && !errors.Is(err, io.EOF) {
		c.t.Fatalf("send: %v", err)
	}
}

// subscribe sends a SotW request (names is the whole subscription; version
// and nonce are the latest received: an ACK) or a Delta subscription.
func (c *rawClient) subscribe(typeURL string, names ...string) {
	c.t.Helper()
	if c.delta {
		c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: names})
		return
	}
	c.subs[typeURL] = names
	c.send(&discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: names,
		VersionInfo: c.version[typeURL], ResponseNonce: c.nonce[typeURL]})
}

// ack acknowledges a response (SotW: repeating the subscription).
func (c *rawClient) ack(m proto.Message) {
	c.t.Helper()
	switch r := m.(type) {
	case *discovery.DiscoveryResponse:
		c.send(&discovery.DiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResourceNames: c.subs[r.GetTypeUrl()], VersionInfo: r.GetVersionInfo(), ResponseNonce: r.GetNonce()})
	case *discovery.DeltaDiscoveryResponse:
		c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce()})
	}
}

// nack rejects a response (SotW: with the previous version).
func (c *rawClient) nack(m proto.Message, prevVersion string) {
	c.t.Helper()
	detail := &rpcstatus.Status{Code: 3, Message: "rejected by test"}
	switch r := m.(type) {
	case *discovery.DiscoveryResponse:
		c.send(&discovery.DiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResourceNames: c.subs[r.GetTypeUrl()], VersionInfo: prevVersion, ResponseNonce: r.GetNonce(), ErrorDetail: detail})
	case *discovery.DeltaDiscoveryResponse:
		c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce(), ErrorDetail: detail})
	}
}

// recv waits for the next response and checks the per-stream rules every
// response must follow.
func (c *rawClient) recv() proto.Message {
	c.t.Helper()
	select {
	case m := <-c.msgs:
		var nonce, typeURL, cp string
		switch r := m.(type) {
		case *discovery.DiscoveryResponse:
			nonce, typeURL, cp = r.GetNonce(), r.GetTypeUrl(), r.GetControlPlane().GetIdentifier()
			c.nonce[typeURL], c.version[typeURL] = nonce, r.GetVersionInfo()
		case *discovery.DeltaDiscoveryResponse:
			nonce, typeURL, cp = r.GetNonce(), r.GetTypeUrl(), r.GetControlPlane().GetIdentifier()
		}
		if nonce == "" || c.nonces[nonce] {
			c.t.Fatalf("response nonce %q is empty or repeated on the stream", nonce)
		}
		c.nonces[nonce] = true
		c.last = m
		if cp == "" {
			c.t.Fatalf("response for %s carries no control_plane.identifier", typeURL)
		}
		return m
	case err := <-c.errc:
		c.errc <- err
		c.t.Fatalf("stream ended: %v", err)
	case <-time.After(10 * time.Second):
		c.t.Fatalf("no response within 10s")
	}
	return nil
}

func (c *rawClient) recvSotW(typeURL string) *discovery.DiscoveryResponse {
	c.t.Helper()
	r, ok := c.recv().(*discovery.DiscoveryResponse)
	if !ok || r.GetTypeUrl() != typeURL {
		c.t.Fatalf("got response for %s, want %s", r.GetTypeUrl(), typeURL)
	}
	return r
}

func (c *rawClient) recvDelta(typeURL string) *discovery.DeltaDiscoveryResponse {
	c.t.Helper()
	r, ok := c.recv().(*discovery.DeltaDiscoveryResponse)
	if !ok || r.GetTypeUrl() != typeURL {
		c.t.Fatalf("got response for %s, want %s", r.GetTypeUrl(), typeURL)
	}
	return r
}

// pause stops the client reading from the stream (after the message it is
// reading now); resume lets it read again.
func (c *rawClient) pause()  { c.reading.Lock() }
func (c *rawClient) resume() { c.reading.Unlock() }

// streamErr waits for the stream to end and returns why.
func (c *rawClient) streamErr() error {
	c.t.Helper()
	for {
		select {
		case <-c.msgs:
		case err := <-c.errc:
			c.errc <- err
			return err
		case <-time.After(10 * time.Second):
			c.t.Fatalf("stream still open after 10s")
			return nil
		}
	}
}

// names returns the resource names of a response.
func names(m proto.Message) []string {
	var out []string
	switch r := m.(type) {
	case *discovery.DiscoveryResponse:
		for _, a := range r.GetResources() {
			res, err := a.UnmarshalNew()
			if err != nil {
				out = append(out, "?")
				continue
			}
			out = append(out, cache.GetResourceName(res))
		}
	case *discovery.DeltaDiscoveryResponse:
		for _, x := range r.GetResources() {
			out = append(out, x.GetName())
		}
	}
	return out
}

// quiet asserts that the relay sends nothing more for what came before: it
// subscribes to a fresh runtime name (a barrier) and requires that the next
// response is the barrier's (responses of the skip types excepted). Responses on a stream are ordered, and the
// relay decides what to send for a request before it reads the next one.
func (c *rawClient) quiet(skip ...string) {
	c.t.Helper()
	c.barrier++
	name := fmt.Sprint("barrier-", c.barrier)
	if c.delta {
		c.subscribe(xds.TypeRuntime, name)
	} else {
		c.subscribe(xds.TypeRuntime, append(slices.Clone(c.subs[xds.TypeRuntime]), name)...)
	}
	m := c.recv()
	for slices.Contains(skip, typeOf(m)) {
		m = c.recv() // allowed before the barrier, and left unanswered
	}
	if got := names(m); typeOf(m) != xds.TypeRuntime || !slices.Equal(got, []string{name}) {
		c.t.Fatalf("got %s %v before the barrier %s: the relay sent what it should not have", xds.ShortType(typeOf(m)), got, name)
	}
	c.ack(m)
}

func typeOf(m proto.Message) string {
	if r, ok := m.(interface{ GetTypeUrl() string }); ok {
		return r.GetTypeUrl()
	}
	return ""
}

func lastOf(t *testing.T, c *rawClient) proto.Message {
	t.Helper()
	if c.last == nil {
		t.Fatal("no response received")
	}
	return c.last
}

func equalStrings(a, b []string) bool { return slices.Equal(a, b) }
