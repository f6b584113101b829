package realenvoy_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/realenvoy"
	"github.com/meshrelay/meshrelay/loadtest/realenvoy/install"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"go.uber.org/goleak"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestEnvoyStartsSyncsAndStops runs the harness against the synthetic
// upstream directly: realenvoy.Envoy comes up, takes the whole config (its config
// dump holds every cluster and listener the upstream serves its group), and
// Stop leaves no process behind.
func TestEnvoyStartsSyncsAndStops(t *testing.T) {
	bin := install.EnvoyBinary(t)
	for _, delta := range []bool{false, true} {
		name := "sotw"
		if delta {
			name = "delta"
		}
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			backend := httpBackend(t)
			sc := upstream.Scenario{Services: 4, Endpoints: 4, Namespaces: 1,
				HTTPServices: []upstream.HTTPService{{Name: "web", Backends: []string{backend}}}}
			up, err := upstream.New(upstream.Config{Scenario: sc})
			if err != nil {
				t.Fatal(err)
			}
			if err := up.Start(ctx); err != nil {
				t.Fatal(err)
			}
			defer up.Stop(ctx)
			node := sc.Node(0, 0, 0)
			_, route, _ := upstream.HTTPNames("web")
			ingress := freeAddr(t)
			dir := t.TempDir()
			e, err := realenvoy.Start(ctx, realenvoy.Config{Binary: bin, XDS: up.Addr(), Delta: delta, Node: node, Dir: dir,
				Ingress: &realenvoy.Ingress{Listen: ingress, Route: route}})
			if err != nil {
				t.Fatal(err)
			}
			pid := e.Pid()
			defer e.Stop()

			want := up.Snapshot(sc.Group(node))
			var got map[string]map[string]realenvoy.Resource
			for {
				dump, err := e.ConfigDump(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if got, err = realenvoy.Dynamic(dump); err != nil {
					t.Fatal(err)
				}
				if len(got[resource.ClusterType]) == len(want[resource.ClusterType]) &&
					len(got[resource.EndpointType]) == len(want[resource.EndpointType]) &&
					len(got[resource.ListenerType]) == len(want[resource.ListenerType]) {
					break
				}
				select {
				case <-ctx.Done():
					t.Fatalf("envoy never held the upstream's config: clusters %d of %d, listeners %d of %d; log: %s",
						len(got[resource.ClusterType]), len(want[resource.ClusterType]),
						len(got[resource.ListenerType]), len(want[resource.ListenerType]), e.LogTail(20))
				case <-time.After(50 * time.Millisecond):
				}
			}
			for typeURL, res := range want {
				for n := range res {
					if _, ok := got[typeURL][n]; !ok {
						t.Errorf("envoy lacks %s %s", typeURL, n)
					}
				}
			}
			if ready, err := e.Ready(ctx); err != nil || !ready {
				t.Errorf("/ready: %v, %v; want LIVE", ready, err)
			}
			stats, err := e.Stats(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if stats["cluster_manager.cds.update_success"] == "" || stats["cluster_manager.cds.update_success"] == "0" {
				t.Errorf("cluster_manager.cds.update_success = %q after a full sync", stats["cluster_manager.cds.update_success"])
			}
			if cl, err := e.Clusters(ctx); err != nil || len(cl.GetClusterStatuses()) < len(want[resource.ClusterType]) {
				t.Errorf("/clusters: %d statuses, %v; want at least %d", len(cl.GetClusterStatuses()), err, len(want[resource.ClusterType]))
			}

			// The ingress listener routes by the route the upstream serves.
			resp, err := http.Get("http://" + ingress + "/")
			if err != nil {
				t.Fatalf("GET through the ingress: %v", err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || string(body) != "backend" {
				t.Errorf("GET through the ingress: %d %q, want 200 backend", resp.StatusCode, body)
			}

			e.Stop()
			if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
				t.Errorf("envoy pid %d still there after Stop: %v", pid, err)
			}
			if _, err := os.Stat(filepath.Join(dir, "bootstrap.json")); !os.IsNotExist(err) {
				t.Errorf("bootstrap left after Stop: %v", err)
			}
		})
	}
}

func httpBackend(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "backend") })}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	return lis.Addr().String()
}

func freeAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return lis.Addr().String()
}

// TestFindRefusesWhatIsNotEnvoy: an explicit MESHRELAY_ENVOY that is not
// realenvoy.Envoy is an error naming it, not a silent fallback to another binary.
func TestFindRefusesWhatIsNotEnvoy(t *testing.T) {
	t.Setenv("MESHRELAY_ENVOY", "/bin/true")
	_, err := realenvoy.Find(context.Background())
	if err == nil {
		t.Fatal("realenvoy.Find took /bin/true for realenvoy.Envoy")
	}
	t.Log(err)
}

func TestStartChecksConfig(t *testing.T) {
	for _, cfg := range []realenvoy.Config{
		{},
		{Binary: "envoy"},
		{Binary: "envoy", XDS: "127.0.0.1:1"},
		{Binary: "envoy", XDS: "nowhere", Node: upstream.DefaultScenario().Node(0, 0, 0), Dir: t.TempDir()},
	} {
		if _, err := realenvoy.Start(context.Background(), cfg); err == nil {
			t.Errorf("realenvoy.Start(%+v) succeeded", cfg)
		}
	}
}
