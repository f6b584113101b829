package loadtest

import (
	"context"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/meshrelay/meshrelay/loadtest/traffic"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// TestFanoutTLS runs the fan-out benchmark tiny over the relay's TLS port,
// once per token verifier: every Envoy syncs and gets every change over
// TLS (the relay child serves no other port), presenting one token per
// key, and the connect storm admits every stream.
func TestFanoutTLS(t *testing.T) {
	requireLinux(t)
	cfg := tinyFanoutConfig(20, 2, 20, 4, 2)
	cfg.Protocols = []envoy.Protocol{envoy.Delta}
	cfg.Modes = []FanoutMode{Relayed}
	cfg.TLS = TLSOn
	cfg.TLSVerifiers = []Verifier{VerifierLocal, VerifierTokenReview}
	cfg.AdmitStreams, cfg.AdmitConcurrency = 20, 4
	cfg.StartRelay = testStartRelay(t)
	rep := runTinyFanout(t, cfg, "tls-local, tls-tokenreview")
	for i, r := range rep.Runs {
		if want := transportName(true, cfg.TLSVerifiers[i]); r.Transport != want {
			t.Errorf("run %d: transport %q, want %q", i, r.Transport, want)
		}
		if !r.Synced || r.ChangesDone != cfg.Changes || r.ChangesTimedOut != 0 {
			t.Errorf("%s: synced %v, changes done %d, timed out %d, want true, %d, 0", r.Transport, r.Synced, r.ChangesDone, r.ChangesTimedOut, cfg.Changes)
		}
		if r.ACK.N != cfg.Changes*cfg.Envoys {
			t.Errorf("%s: %d (change, Envoy) ACKs, want %d", r.Transport, r.ACK.N, cfg.Changes*cfg.Envoys)
		}
		if r.UpstreamStreams.AfterSync != int64(cfg.Keys) || r.Violations != 0 || r.Refused != 0 {
			t.Errorf("%s: upstream streams %d, violations %d, Envoys refused %d, want %d, 0, 0", r.Transport, r.UpstreamStreams.AfterSync, r.Violations, r.Refused, cfg.Keys)
		}
		if r.Tokens != cfg.Keys {
			t.Errorf("%s: %d tokens presented, want %d (one per namespace and service account)", r.Transport, r.Tokens, cfg.Keys)
		}
		// A verdict is cached: the fleet and the storm cost at most a
		// review per token.
		if tr := r.Transport == "tls-tokenreview"; tr && (r.TokenReviews < 1 || r.TokenReviews > cfg.Keys) || !tr && r.TokenReviews != 0 {
			t.Errorf("%s: %d token reviews, want 1 to %d with tokenreview, else 0", r.Transport, r.TokenReviews, cfg.Keys)
		}
		switch a := r.Admission; {
		case a == nil:
			t.Errorf("%s: no connect storm", r.Transport)
		case a.Admitted != cfg.AdmitStreams || len(a.Refused) != 0 || a.Err != "":
			t.Errorf("%s: storm admitted %d of %d, refused %v, error %q, want all", r.Transport, a.Admitted, cfg.AdmitStreams, a.Refused, a.Err)
		case a.RatePerS <= 0 || a.Latency.N != cfg.AdmitStreams:
			t.Errorf("%s: storm rate %v/s, %d latencies, want > 0 and %d", r.Transport, a.RatePerS, a.Latency.N, cfg.AdmitStreams)
		}
	}
}

// A fleet whose tokens are another namespace's is refused by the TLS port
// (PermissionDenied, istiod's rule) and gets no config; a plaintext client
// is not served there either.
func TestTLSFleetWrongNamespaceRefused(t *testing.T) {
	requireLinux(t)
	for _, v := range []Verifier{VerifierLocal, VerifierTokenReview} {
		t.Run(string(v), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			sc := upstream.DefaultScenario()
			sc.Services, sc.Endpoints, sc.Namespaces = 10, 10, 2
			ucfg := upstream.DefaultConfig()
			ucfg.Scenario = sc
			up := startTestUpstream(t, ctx, ucfg)
			creds, err := NewMeshCredentials(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			reviewURL := ""
			if v == VerifierTokenReview {
				kube, err := creds.StartTokenReview(0)
				if err != nil {
					t.Fatal(err)
				}
				defer func() {
					kube.Stop()
					if err := kube.Err(); err != nil {
						t.Error(err)
					}
				}()
				reviewURL = kube.URL()
			}
			child, err := testStartRelay(t)(ctx, RelayChildConfig{Upstream: up.Addr(), TLS: creds.RelayTLS(v, reviewURL)})
			if err != nil {
				t.Fatal(err)
			}
			defer child.Stop(context.Background())

			tr := newTLSTransport(creds, child.Addr(), 1, 0)
			defer tr.Close()
			tr.token = func(n *core.Node) (string, error) {
				// The right service account of the namespace after the node's.
				f := n.GetMetadata().GetFields()
				var ns int
				if _, err := fmt.Sscanf(f["NAMESPACE"].GetStringValue(), "ns-%d", &ns); err != nil {
					return "", err
				}
				return creds.Token(upstream.NamespaceName((ns+1)%sc.Namespaces), f["SERVICE_ACCOUNT"].GetStringValue())
			}
			fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: sc, Envoys: 6, Keys: 2, Protocol: envoy.Delta,
				Target: child.Addr(), Configure: tr.configure})
			if err != nil {
				t.Fatal(err)
			}
			defer fleet.Stop(context.Background())
			if err := tr.Err(); err != nil {
				t.Fatal(err)
			}
			for _, e := range fleet.Envoys() {
				err := e.WaitFor(ctx, func(v envoy.View) bool { return status.Code(v.Stats().LastErr) == codes.PermissionDenied })
				if err != nil {
					t.Fatalf("%s: %v; last stream error %v, want PermissionDenied", e.ID(), err, e.Stats().LastErr)
				}
				if st := e.Stats(); st.Responses != 0 || len(e.Resources(envoy.ClusterType)) != 0 {
					t.Errorf("%s: %d responses, %d clusters held, want none", e.ID(), st.Responses, len(e.Resources(envoy.ClusterType)))
				}
			}

			// Plaintext on the TLS port: no handshake, no stream.
			conn, err := grpc.NewClient(child.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
			defer scancel()
			st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(sctx)
			if err == nil {
				_ = st.Send(&discovery.DeltaDiscoveryRequest{Node: sc.Node(0, 0, 99), TypeUrl: envoy.ClusterType})
				_, err = st.Recv()
			}
			if err == nil || status.Code(err) == codes.OK {
				t.Errorf("plaintext stream on the TLS port: %v, want an error", err)
			}
		})
	}
}

func TestTLSModeFlag(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want TLSMode
		err  bool
	}{
		{nil, TLSOff, false},
		{[]string{"--tls"}, TLSOn, false},
		{[]string{"--tls=compare"}, TLSCompare, false},
		{[]string{"--tls=off"}, TLSOff, false},
		{[]string{"--tls=false"}, TLSOff, false},
		{[]string{"--tls=sometimes"}, "", true},
	} {
		mode := TLSOff
		fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
		fs.SetOutput(io.Discard)
		TLSModeVar(fs, &mode, "tls", "")
		err := fs.Parse(tt.args)
		if (err != nil) != tt.err || !tt.err && mode != tt.want {
			t.Errorf("Parse(%q): mode %q, error %v, want %q, error %v", tt.args, mode, err, tt.want, tt.err)
		}
	}
}
