package relay

import (
	"context"
	"crypto/tls"
	"fmt"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	authenticationv1 "k8s.io/api/authentication/v1"

	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// A reconnect storm on the TLS port with the TokenReview verifier: 10,000
// streams carrying 100 distinct tokens (100 workloads of 100 pods) are
// each authenticated, checked against their node and served, and cost the
// Kubernetes API (an HTTP server speaking its JSON) at most one review per
// token.
func TestTLSPortTokenReviewStorm(t *testing.T) {
	const workloads, streamsEach = 100, 100
	up := newTestUpstream(t, "ns1", "ns2")
	seed(up, "ns1", 3)
	seed(up, "ns2", 3)
	type workload struct{ ns, sa, token string }
	var ws []workload
	accounts := map[string]workload{}
	issuer := authtest.NewIssuer(t)
	for i := range workloads {
		w := workload{ns: fmt.Sprint("ns", 1+i%2), sa: fmt.Sprint("sa-", i)}
		// The API server, not a signature, decides: any JWT-shaped token.
		w.token = issuer.Sign(t, authtest.Token{Namespace: w.ns, ServiceAccount: w.sa, TTL: time.Hour})
		ws = append(ws, w)
		accounts[w.token] = w
	}
	api := authtest.NewKubeAPI(t, func(tok string, _ []string) authenticationv1.TokenReviewStatus {
		w, ok := accounts[tok]
		if !ok {
			return authtest.Unauthenticated("unknown token")
		}
		return authtest.ServiceAccount(w.ns, w.sa, "istio-ca")
	})
	tcfg := auth.DefaultTokenReviewConfig()
	tcfg.Client = api.Clientset()
	reviews, err := auth.NewTokenReview(tcfg)
	if err != nil {
		t.Fatal(err)
	}
	authn, err := auth.NewAuthenticator(auth.ModeJWT, nil, reviews)
	if err != nil {
		t.Fatal(err)
	}
	mesh := authtest.NewCA(t, "mesh root")
	certFile, keyFile := mesh.Serving(t, "meshrelay.istio-system.svc").Write(t, "")
	pair, err := tlsfiles.LoadKeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	r := startRelay(t, up, func(c *Config) {
		c.XDS.Listen, c.XDS.TLSListen = "", "127.0.0.1:0"
		c.XDS.TLS = tlsfiles.ServerConfig(pair, nil, tls.NoClientCert)
		c.XDS.Authenticator = authn
		c.XDS.AdmitRate = 0 // the storm is admitted as fast as it comes
	})
	e := &secureEnv{up: up, r: r, mesh: mesh}

	// One connection a workload (its pods' streams share it), and 256
	// streams in flight at any time, the tokens interleaved so that each
	// token's streams arrive together: a storm as a Service spreads it,
	// not 10,000 goroutines of the test's own starving the relay's.
	conns := make([]*grpc.ClientConn, len(ws))
	for i, w := range ws {
		conns[i] = e.dial(t, creds{token: w.token, perRPC: true})
	}
	next := make(chan int)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failed []error
	for range 256 {
		wg.Go(func() {
			for n := range next {
				w := ws[n%workloads]
				if err := firstClusters(conns[n%workloads], saNode(w.ns, w.sa, n)); err != nil {
					mu.Lock()
					failed = append(failed, fmt.Errorf("%s/%s stream %d: %w", w.ns, w.sa, n, err))
					mu.Unlock()
				}
			}
		})
	}
	began := time.Now()
	for n := range workloads * streamsEach {
		next <- n
	}
	close(next)
	wg.Wait()
	t.Logf("%d streams of %d tokens served in %v; the API server saw %d reviews, at most %d at once",
		workloads*streamsEach, workloads, time.Since(began).Round(time.Millisecond), api.Requests(), api.MaxConcurrent())
	if len(failed) > 0 {
		t.Fatalf("%d of %d streams failed, first: %v", len(failed), workloads*streamsEach, failed[0])
	}
	if got := api.Requests(); got > workloads {
		t.Fatalf("the API server saw %d reviews for %d distinct tokens, want at most one a token", got, workloads)
	}
}

// firstClusters opens a Delta stream on conn presenting n, and returns nil
// once it is answered with clusters.
func firstClusters(conn *grpc.ClientConn, n *core.Node) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		return err
	}
	if err := st.Send(&discovery.DeltaDiscoveryRequest{Node: n, TypeUrl: xds.TypeCluster}); err != nil {
		_ = err // the refusal, if any, comes back on Recv
	}
	resp, err := st.Recv()
	if err != nil {
		return err
	}
	if len(resp.GetResources()) == 0 {
		return fmt.Errorf("answered %v, want the namespace's clusters", resp)
	}
	return nil
}
