package realistio

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/loadtest"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
)

// BenchConfig describes a benchmark against the real istiod (Bench).
// Build it with DefaultBenchConfig and change fields.
type BenchConfig struct {
	// Sidecars is how many simulated sidecars sync, first straight from
	// istiod, then through the tier. Default 100.
	Sidecars int
	// Workloads is how many workloads of one namespace the sidecars
	// spread over, round-robin (sidecar i is a pod of workload
	// i % Workloads): one aggregation key each. Default 10.
	Workloads int
	// Services is how many ServiceEntries (one HTTP port, STATIC, with a
	// workload selector) are created on the API server, and as many
	// WorkloadEntries, one behind each. Default 1,000.
	Services int
	// Relays is how many `meshrelay serve` processes the tier has.
	// Default 3.
	Relays int
	// Protocol is the sidecars' ADS variant. Default SotW.
	Protocol envoy.Protocol
	// UpstreamProtocol is what the relays speak to istiod. Default Delta
	// (the relay's default).
	UpstreamProtocol relay.Protocol
	// CreateConcurrency is how many create requests are in flight at
	// once on the API server. Default 32.
	CreateConcurrency int
	// SyncTimeout bounds each full sync (direct, relayed) and the wait
	// until istiod serves every ServiceEntry. Default 10m.
	SyncTimeout time.Duration
	// ChangeTimeout bounds the wait for an edit to reach every sidecar.
	// Default 2m.
	ChangeTimeout time.Duration
	// Settle is how long istiod is watched idle before the direct run,
	// once it is quiet: its idle CPU is reported. Default 5s.
	Settle time.Duration
	// Binaries are the real binaries. Default: Find's.
	Binaries Binaries
	// Meshrelay is the meshrelay binary. Default: cmd/meshrelay of the
	// module in the working directory, built with go build into Dir.
	Meshrelay string
	// RelayArgs are added to every relay's `meshrelay serve` arguments
	// (--divergence-interval=0, to see what the divergence checks cost).
	// Default none.
	RelayArgs []string
	// Dir holds the processes' state and logs (kube-apiserver.log,
	// istiod.log, relay-<i>.log). Default: a temporary directory,
	// removed when Bench succeeds and kept (the error names it) when it
	// fails.
	Dir string
	// Log receives progress lines. Default: discarded.
	Log io.Writer
}

// DefaultBenchConfig returns issue 29's benchmark: 100 sidecars of 10
// workloads, 1,000 ServiceEntries and 1,000 WorkloadEntries, a tier of 3
// relays.
func DefaultBenchConfig() BenchConfig {
	return BenchConfig{
		Sidecars:          100,
		Workloads:         10,
		Services:          1000,
		Relays:            3,
		Protocol:          envoy.SotW,
		UpstreamProtocol:  relay.ProtocolDelta,
		CreateConcurrency: 32,
		SyncTimeout:       10 * time.Minute,
		ChangeTimeout:     2 * time.Minute,
		Settle:            5 * time.Second,
	}
}

// BenchResult is what Bench measured.
type BenchResult struct {
	Sidecars, Workloads, Services, Relays int
	Protocol, UpstreamProtocol            string
	// Create is how long creating the WorkloadEntries and ServiceEntries
	// took; Served how long after that istiod served every one of them to
	// a sidecar of each workload (the warm-up).
	Create, Served time.Duration
	// IstiodIdleCPU is the CPU istiod used, idle, over IdleWindow before
	// the direct run: the background the runs' figures include.
	IstiodIdleCPU, IdleWindow time.Duration
	// Direct is the sidecars on istiod; Relayed the same sidecars
	// through the tier.
	Direct, Relayed BenchRun
}

// BenchRun is one run's figures: the sidecars' full sync, then one
// ServiceEntry edit.
type BenchRun struct {
	// Synced counts the sidecars that completed their full sync: CDS
	// with every service's cluster, a ClusterLoadAssignment for every
	// EDS cluster, listeners, and every route configuration the
	// listeners name.
	Synced int
	// Sync is the time from the sidecars' start to each one's full sync;
	// Sync.Max is the run's full-sync wall time.
	Sync report.Latency
	// IstiodStreams is istiod's count of connected xDS streams
	// (pilot_xds) once every sidecar synced; IstiodStreamsMax the largest
	// count sampled (every second) during the sync; IstiodStreamsEnd the
	// count after the edit reached every sidecar.
	IstiodStreams, IstiodStreamsMax, IstiodStreamsEnd int
	// Keys is, through the tier, the keys the relays own (each has the
	// key's one upstream stream); 0 for the direct run.
	Keys int
	// RelayStreams is, through the tier, what the relays count of their
	// own streams to istiod once every sidecar synced: the keys'
	// (meshrelay_upstream_streams), divergence checks' and passthrough
	// streams'.
	RelayStreams struct{ Keys, DivergenceChecks, Passthrough int }
	// DivergenceChecks is, through the tier, how many divergence checks
	// the relays finished during the sync (meshrelay_divergence_checks_total,
	// any result); each is a full sync of another member's node on a
	// stream of its own.
	DivergenceChecks int
	// IstiodCDSPushes is how many CDS responses istiod sent during the
	// sync (pilot_xds_pushes{type="cds"}): one per stream it served in
	// full, at least.
	IstiodCDSPushes int
	// IstiodCPU, RelaysCPU and SidecarsCPU are the CPU time (user +
	// system) istiod, the relays together, and this process (the
	// simulated sidecars, and the API server's embedded etcd) used from
	// the sidecars' start to the last one's full sync.
	IstiodCPU, RelaysCPU, SidecarsCPU time.Duration
	// IstiodCPUQuiet and RelaysCPUQuiet are their CPU from the sidecars'
	// start until istiod and the relays were quiet again after the sync
	// (QuietAfter it), so that work the sync set going (the relays'
	// divergence checks) counts; DivergenceChecksQuiet the checks
	// finished by then.
	IstiodCPUQuiet, RelaysCPUQuiet, QuietAfter time.Duration
	DivergenceChecksQuiet                      int
	// IstiodRSS and RelaysRSS are the largest resident sizes sampled
	// (every 250 ms) during the sync, in bytes; RelaysRSS sums each
	// relay's largest.
	IstiodRSS, RelaysRSS uint64
	// ChangeReached counts the sidecars that got the edit (the added
	// host's cluster and its endpoints); Change is the time from the
	// edit's write to the API server to each one's having it.
	ChangeReached int
	Change        report.Latency
	// ChangeCluster is the time from the edit to each sidecar's holding
	// the added host's cluster (its endpoints may still be on the way).
	ChangeCluster report.Latency
	// ChangeIstiodCPU and ChangeRelaysCPU are the CPU used from the edit
	// to the last sidecar's having it.
	ChangeIstiodCPU, ChangeRelaysCPU time.Duration
	// Reconnects counts sidecar streams reopened (refused by an
	// admission limit, or closed) by the end of the run.
	Reconnects uint64
	// SyncBytes and SyncResponses are what the sidecars received until
	// the last one synced; Bytes and Responses by the end of the run.
	SyncBytes, SyncResponses, Bytes, Responses uint64
	// Violations counts protocol violations the sidecars recorded; a few
	// are spelt out in ViolationSamples.
	Violations       int
	ViolationSamples []string
}

// ControlPlaneCPU is istiod's and the relays' CPU for the full sync, until
// they were quiet again after it.
func (r BenchRun) ControlPlaneCPU() time.Duration { return r.IstiodCPUQuiet + r.RelaysCPUQuiet }

// CPURatio is the direct run's control-plane CPU over the relayed run's
// (0 if the relayed run used none): the headline.
func (r *BenchResult) CPURatio() float64 {
	if r.Relayed.ControlPlaneCPU() == 0 {
		return 0
	}
	return r.Direct.ControlPlaneCPU().Seconds() / r.Relayed.ControlPlaneCPU().Seconds()
}

// The objects Bench creates.
const (
	benchServiceNS = "bench-services"
	benchPort      = 80
)

var (
	serviceEntryGVR  = schema.GroupVersionResource{Group: "networking.istio.io", Version: "v1", Resource: "serviceentries"}
	workloadEntryGVR = schema.GroupVersionResource{Group: "networking.istio.io", Version: "v1", Resource: "workloadentries"}
)

func benchHost(name string) string { return name + ".bench.internal" }

// benchCluster is istiod's name for the outbound cluster of host (and of
// its ClusterLoadAssignment).
func benchCluster(host string) string {
	return "outbound|" + strconv.Itoa(benchPort) + "||" + host
}

// Bench runs issue 29's benchmark against the real istiod: a real
// kube-apiserver and istiod, cfg.Services ServiceEntries and
// WorkloadEntries created on the API server, and cfg.Sidecars simulated
// sidecars with Istio-shaped nodes that sync in full (CDS, EDS, LDS,
// RDS, ACKing each response like Envoy) twice: straight from istiod, then
// spread over a tier of cfg.Relays `meshrelay serve` processes (gossip on
// loopback) in front of the same istiod. Each run measures istiod's and
// the relays' CPU for the full sync (at the last sidecar's sync, and
// until they are quiet again after it), then edits one ServiceEntry (adds
// a host) and times until every sidecar has the new cluster and its
// endpoints. Before the runs istiod is given time to take in every
// object (its push context holds every service, its IP autoallocator has
// written every ServiceEntry's address) and a sidecar of each workload
// syncs directly, holding every service with its endpoint.
//
// Every process it starts is stopped before it returns, on error too
// (and dies with this process on Linux). It returns what it measured
// even when it fails part way.
func Bench(ctx context.Context, cfg BenchConfig) (res *BenchResult, err error) {
	def := DefaultBenchConfig()
	for _, d := range []struct {
		v   *int
		def int
	}{{&cfg.Sidecars, def.Sidecars}, {&cfg.Workloads, def.Workloads}, {&cfg.Services, def.Services}, {&cfg.Relays, def.Relays}, {&cfg.CreateConcurrency, def.CreateConcurrency}} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	for _, d := range []struct{ v, def *time.Duration }{{&cfg.SyncTimeout, &def.SyncTimeout}, {&cfg.ChangeTimeout, &def.ChangeTimeout}, {&cfg.Settle, &def.Settle}} {
		if *d.v == 0 {
			*d.v = *d.def
		}
	}
	if cfg.UpstreamProtocol == "" {
		cfg.UpstreamProtocol = def.UpstreamProtocol
	}
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	switch {
	case cfg.Sidecars < 0 || cfg.Workloads < 0 || cfg.Services < 0 || cfg.Relays < 0 || cfg.CreateConcurrency < 0:
		return nil, errors.New("realistio: Sidecars, Workloads, Services, Relays and CreateConcurrency must not be negative")
	case cfg.Workloads > cfg.Sidecars:
		return nil, fmt.Errorf("realistio: field Workloads %d is more than Sidecars %d", cfg.Workloads, cfg.Sidecars)
	case cfg.Workloads > 255 || cfg.Sidecars/cfg.Workloads > 255:
		return nil, errors.New("realistio: at most 255 workloads of at most 255 sidecars each (their IPv4 addresses)")
	}
	if _, err := relay.ParseProtocol(string(cfg.UpstreamProtocol)); err != nil {
		return nil, err
	}
	if cfg.Binaries == (Binaries{}) {
		if cfg.Binaries, err = Find(); err != nil {
			return nil, err
		}
	}
	if cfg.Dir == "" {
		if cfg.Dir, err = os.MkdirTemp("", "meshrelay-istio-bench-"); err != nil {
			return nil, err
		}
		defer func() {
			if err == nil {
				os.RemoveAll(cfg.Dir)
			} else {
				err = fmt.Errorf("%w (processes' logs in %s)", err, cfg.Dir)
			}
		}()
	}
	b := &bench{cfg: cfg, res: &BenchResult{
		Sidecars: cfg.Sidecars, Workloads: cfg.Workloads, Services: cfg.Services, Relays: cfg.Relays,
		Protocol: cfg.Protocol.String(), UpstreamProtocol: string(cfg.UpstreamProtocol),
	}}
	defer b.stop()
	return b.res, b.run(ctx)
}

// bench is one Bench run: what it started, so that stop ends it all.
type bench struct {
	cfg    BenchConfig
	res    *BenchResult
	logs   []*os.File
	kube   *KubeAPI
	istiod *Istiod
	dyn    *dynamic.DynamicClient
	relays []*benchRelay
	fleet  *traffic.Fleet
	edits  int // hosts added to svc-0 so far
}

type benchRelay struct {
	child            *loadtest.Child
	xds, admin, goss string
}

func (b *bench) logf(format string, args ...any) {
	fmt.Fprintf(b.cfg.Log, "istio bench %s: %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

// logTail returns the last n lines of the file at path, or why it cannot.
func logTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

func (b *bench) logFile(name string) (*os.File, error) {
	f, err := os.Create(filepath.Join(b.cfg.Dir, name+".log"))
	if err == nil {
		b.logs = append(b.logs, f)
	}
	return f, err
}

// stop ends everything started, in reverse order.
func (b *bench) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if b.fleet != nil {
		b.fleet.Stop(ctx)
	}
	b.stopRelays(ctx)
	if b.istiod != nil {
		b.istiod.Stop()
	}
	if b.kube != nil {
		b.kube.Stop()
	}
	for _, f := range b.logs {
		f.Close()
	}
}

func (b *bench) stopRelays(ctx context.Context) {
	var wg sync.WaitGroup
	for _, r := range b.relays {
		wg.Go(func() { _ = r.child.Stop(ctx) })
	}
	wg.Wait()
	b.relays = nil
}

func (b *bench) run(ctx context.Context) error {
	if b.cfg.Meshrelay == "" {
		b.logf("go build ./cmd/meshrelay")
		log, err := b.logFile("build")
		if err != nil {
			return err
		}
		if b.cfg.Meshrelay, err = loadtest.BuildMeshrelay(ctx, b.cfg.Dir, log); err != nil {
			return err
		}
	}
	cfg := b.cfg
	if err := b.startMesh(ctx); err != nil {
		return err
	}
	if err := b.createObjects(ctx); err != nil {
		return err
	}
	if err := b.warmUp(ctx); err != nil {
		return err
	}

	b.logf("direct: %d sidecars of %d workloads on istiod %s", cfg.Sidecars, cfg.Workloads, b.istiod.PlainAddr)
	if err := b.measure(ctx, &b.res.Direct, []string{b.istiod.PlainAddr}); err != nil {
		return fmt.Errorf("direct: %w", err)
	}
	if err := b.settle(ctx); err != nil {
		return err
	}

	if err := b.startTier(ctx); err != nil {
		return err
	}
	var addrs []string
	for _, r := range b.relays {
		addrs = append(addrs, r.xds)
	}
	b.logf("relayed: %d sidecars over %d relays", cfg.Sidecars, len(addrs))
	if err := b.measure(ctx, &b.res.Relayed, addrs); err != nil {
		return fmt.Errorf("relayed: %w", err)
	}
	return nil
}

// startMesh starts kube-apiserver and istiod.
func (b *bench) startMesh(ctx context.Context) error {
	log, err := b.logFile("kube-apiserver")
	if err != nil {
		return err
	}
	if b.kube, err = StartKubeAPI(ctx, b.cfg.Binaries.KubeAPIServer, b.cfg.Dir, log); err != nil {
		return err
	}
	if b.dyn, err = dynamic.NewForConfig(b.kube.Config); err != nil {
		return err
	}
	idir := filepath.Join(b.cfg.Dir, "istiod")
	if err := os.MkdirAll(idir, 0o755); err != nil {
		return err
	}
	if log, err = b.logFile("istiod"); err != nil {
		return err
	}
	if b.istiod, err = StartIstiod(ctx, b.cfg.Binaries.PilotDiscovery, b.kube, idir, log); err != nil {
		return err
	}
	b.logf("kube-apiserver %s and istiod %s ready", b.kube.URL, b.istiod.PlainAddr)
	return nil
}

// createObjects creates the namespaces, then the WorkloadEntries, then
// the ServiceEntries (so that each ServiceEntry finds its endpoint), with
// CreateConcurrency requests in flight.
func (b *bench) createObjects(ctx context.Context) error {
	for _, ns := range []string{benchServiceNS, upstream.NamespaceName(0)} {
		_, err := b.kube.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create namespace %s: %w", ns, err)
		}
	}
	start := time.Now()
	n := b.cfg.Services
	if err := b.createAll(ctx, workloadEntryGVR, n, func(i int) *unstructured.Unstructured {
		name := "svc-" + strconv.Itoa(i)
		return benchObject("WorkloadEntry", name, map[string]any{
			// 10.0.0.0/9: the sidecars are in 10.128.0.0/9.
			"address": fmt.Sprintf("10.%d.%d.%d", i>>16&0x7f, i>>8&0xff, i&0xff),
			"labels":  map[string]any{"app": name},
		})
	}); err != nil {
		return err
	}
	if err := b.createAll(ctx, serviceEntryGVR, n, func(i int) *unstructured.Unstructured {
		name := "svc-" + strconv.Itoa(i)
		return benchObject("ServiceEntry", name, map[string]any{
			"hosts":            []any{benchHost(name)},
			"location":         "MESH_INTERNAL",
			"resolution":       "STATIC",
			"ports":            []any{map[string]any{"number": int64(benchPort), "name": "http", "protocol": "HTTP", "targetPort": int64(8080)}},
			"workloadSelector": map[string]any{"labels": map[string]any{"app": name}},
		})
	}); err != nil {
		return err
	}
	b.res.Create = time.Since(start)
	b.logf("%d WorkloadEntries and %d ServiceEntries created in %v", n, n, b.res.Create.Round(time.Millisecond))
	return nil
}

func benchObject(kind, name string, spec map[string]any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "networking.istio.io/v1",
		"kind":       kind,
		"metadata":   map[string]any{"name": name, "namespace": benchServiceNS},
		"spec":       spec,
	}}
}

// createAll creates object(i) for i in [0, n) with CreateConcurrency
// workers; the first error stops it.
func (b *bench) createAll(ctx context.Context, gvr schema.GroupVersionResource, n int, object func(i int) *unstructured.Unstructured) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	client := b.dyn.Resource(gvr).Namespace(benchServiceNS)
	next := make(chan int)
	var wg sync.WaitGroup
	for range b.cfg.CreateConcurrency {
		wg.Go(func() {
			for i := range next {
				if _, err := client.Create(ctx, object(i), metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
					cancel(fmt.Errorf("create %s %d: %w", gvr.Resource, i, err))
				}
			}
		})
	}
	for i := range n {
		select {
		case next <- i:
			continue
		case <-ctx.Done():
		}
		break
	}
	close(next)
	wg.Wait()
	return context.Cause(ctx)
}

// sidecarFleet starts the sidecars: sidecar i is pod i/Workloads of
// workload i%Workloads in namespace ns-0 (loadtest's Istio-shaped nodes,
// presenting the istiod release's ISTIO_VERSION), connected to
// targets[i%len(targets)], each on a gRPC connection of its own.
func (b *bench) sidecarFleet(ctx context.Context, n int, targets []string, light bool) (*traffic.Fleet, error) {
	return traffic.StartFleet(ctx, traffic.FleetConfig{
		Scenario: upstream.Scenario{Namespaces: 1},
		Envoys:   n,
		Keys:     b.cfg.Workloads,
		Protocol: b.cfg.Protocol,
		Targets:  targets,
		Light:    light,
		Configure: func(_ int, c *envoy.Config) {
			c.Node = istioNode(c.Node)
			c.Generation = nil // istiod's resources carry none
		},
	})
}

// istioNode is node as pilot-agent of the istiod release built here
// presents it.
func istioNode(node *core.Node) *core.Node {
	n := proto.Clone(node).(*core.Node)
	md := n.GetMetadata().GetFields()
	md["ISTIO_VERSION"] = structpb.NewStringValue("1.31.0")
	md["PROXY_CONFIG"] = structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{"concurrency": structpb.NewNumberValue(2)}})
	return n
}

// fullySynced reports whether e holds a full sync: at least minClusters
// clusters, a ClusterLoadAssignment for every EDS cluster it asked for
// (at least one), listeners, and every route configuration they name.
func fullySynced(e *envoy.Envoy, v envoy.View, minClusters int) bool {
	if v.Len(envoy.ClusterType) < minClusters || v.Len(envoy.ListenerType) == 0 {
		return false
	}
	for _, t := range []string{envoy.EndpointType, envoy.RouteType} {
		subs := e.Subscribed(t)
		if (t == envoy.EndpointType && len(subs) == 0) || v.Len(t) < len(subs) {
			return false
		}
		for _, s := range subs {
			if !v.Has(t, s) {
				return false
			}
		}
	}
	return true
}

// warmUp waits until istiod serves every ServiceEntry, with its
// endpoint, to a sidecar of each workload (straight from istiod), which
// also fills istiod's caches for both runs; then lets istiod settle and
// measures its idle CPU.
func (b *bench) warmUp(ctx context.Context) error {
	start := time.Now()
	wctx, cancel := context.WithTimeout(ctx, b.cfg.SyncTimeout)
	defer cancel()
	// First with no sidecar connected: istiod pushes a connected one
	// all its config after each debounced batch of ServiceEntries, which
	// slows it down a great deal (7,000 of 10,000 ServiceEntries in 10
	// minutes, 10 sidecars connected).
	for logged := start; ; {
		n, err := scrape(wctx, "http://"+b.istiod.MonitoringAddr+"/metrics", "pilot_services", "")
		if err == nil && int(n) >= b.cfg.Services {
			break
		}
		if time.Since(logged) >= 30*time.Second {
			b.logf("istiod's push context holds %v services (%v)", n, err)
			logged = time.Now()
		}
		if !traffic.SleepCtx(wctx, time.Second) {
			return fmt.Errorf("istiod's push context holds %v of %d services (%v) after %v", n, b.cfg.Services, err, b.cfg.SyncTimeout)
		}
	}
	b.logf("istiod's push context holds every service after %v", time.Since(start).Round(time.Millisecond))
	if err := b.waitAllocated(wctx); err != nil {
		return err
	}
	f, err := b.sidecarFleet(ctx, b.cfg.Workloads, []string{b.istiod.PlainAddr}, false)
	if err != nil {
		return err
	}
	defer f.Stop(context.WithoutCancel(ctx))
	probe := f.Envoys()[0]
	for served := 0; ; {
		if served = servedServices(probe, b.cfg.Services); served == b.cfg.Services {
			break
		}
		select {
		case <-wctx.Done():
			return fmt.Errorf("istiod serves %d of %d ServiceEntries with their endpoints after %v", served, b.cfg.Services, b.cfg.SyncTimeout)
		case <-time.After(time.Second):
		}
	}
	for _, e := range f.Envoys() {
		if err := e.WaitFor(wctx, func(v envoy.View) bool { return fullySynced(e, v, b.cfg.Services) }); err != nil {
			return fmt.Errorf("warm-up sidecar %s: %w", e.ID(), err)
		}
	}
	b.res.Served = time.Since(start)
	b.logf("istiod serves all %d services (%v after the last was created)", b.cfg.Services, b.res.Served.Round(time.Millisecond))
	f.Stop(ctx)
	if err := b.settle(ctx); err != nil {
		return err
	}
	before, err := loadtest.ReadProcStat(b.istiod.Pid())
	if err != nil {
		return err
	}
	if !traffic.SleepCtx(ctx, b.cfg.Settle) {
		return ctx.Err()
	}
	after, err := loadtest.ReadProcStat(b.istiod.Pid())
	if err != nil {
		return err
	}
	b.res.IstiodIdleCPU, b.res.IdleWindow = after.CPU-before.CPU, b.cfg.Settle
	return nil
}

// waitAllocated waits until istiod's IP autoallocator has written an
// address into the status of every ServiceEntry (steady state in a
// mesh: each write is a config update, which istiod pushes to every
// connected sidecar; at 10,000 ServiceEntries with sidecars connected it
// got through about 5 a second), or has written none for 30 s (it is
// off, or done with what it allocates).
func (b *bench) waitAllocated(ctx context.Context) error {
	client := b.dyn.Resource(serviceEntryGVR).Namespace(benchServiceNS)
	start := time.Now()
	last, lastChange, logged := -1, time.Now(), time.Now()
	for {
		list, err := client.List(ctx, metav1.ListOptions{})
		if err != nil {
			return fmt.Errorf("list ServiceEntries: %w", err)
		}
		n := 0
		for _, se := range list.Items {
			if a, _, _ := unstructured.NestedSlice(se.Object, "status", "addresses"); len(a) > 0 {
				n++
			}
		}
		switch {
		case n >= b.cfg.Services:
			b.logf("istiod allocated every ServiceEntry an address %v after its push context held them", time.Since(start).Round(time.Millisecond))
			return nil
		case n != last:
			last, lastChange = n, time.Now()
		case time.Since(lastChange) > 30*time.Second:
			b.logf("istiod allocated %d of %d ServiceEntries an address, none more in 30 s: going on", n, b.cfg.Services)
			return nil
		}
		if time.Since(logged) >= 30*time.Second {
			b.logf("istiod allocated %d of %d ServiceEntries an address", n, b.cfg.Services)
			logged = time.Now()
		}
		if !traffic.SleepCtx(ctx, 5*time.Second) {
			return fmt.Errorf("istiod allocated %d of %d ServiceEntries an address: %w", n, b.cfg.Services, ctx.Err())
		}
	}
}

// servedServices counts the bench's services e holds a cluster of and a
// ClusterLoadAssignment with an endpoint for (it decodes the load
// assignments only once every service has both).
func servedServices(e *envoy.Envoy, n int) int {
	clusters := e.Resources(envoy.ClusterType)
	cla := e.Resources(envoy.EndpointType)
	var held []envoy.Held
	for i := range n {
		name := benchCluster(benchHost("svc-" + strconv.Itoa(i)))
		if _, ok := clusters[name]; !ok {
			continue
		}
		if h, ok := cla[name]; ok {
			held = append(held, h)
		}
	}
	if len(held) < n {
		return len(held)
	}
	served := 0
	for _, h := range held {
		if hasEndpoint(h) {
			served++
		}
	}
	return served
}

func hasEndpoint(h envoy.Held) bool {
	var cla endpoint.ClusterLoadAssignment
	if h.Resource == nil || h.Resource.UnmarshalTo(&cla) != nil {
		return false
	}
	for _, le := range cla.GetEndpoints() {
		if len(le.GetLbEndpoints()) > 0 {
			return true
		}
	}
	return false
}

// settle waits until istiod counts no connected stream (the last run's
// sidecars and relays are gone) and then until it is quiet: a second in
// which it used at most quietCPU, quietSeconds times in a row (config
// still being processed, a push to the clients that left, a garbage
// collection of what they held would be measured in the next run); three
// minutes at most, after which it goes on and says so.
func (b *bench) settle(ctx context.Context) error {
	deadline := time.Now().Add(time.Minute)
	for {
		n, err := b.istiodStreams(ctx)
		if err == nil && n == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("istiod still counts %d streams (%v) a minute after its clients left", n, err)
		}
		if !traffic.SleepCtx(ctx, 200*time.Millisecond) {
			return ctx.Err()
		}
	}
	took, ok, err := quiet(ctx, []int{b.istiod.Pid()}, quietCPU)
	if err != nil {
		return err
	}
	if !ok {
		b.logf("istiod not quiet after %v: going on", took.Round(time.Second))
		return nil
	}
	b.logf("istiod quiet after %v", took.Round(time.Second))
	return nil
}

// quietCPU is the CPU a second in which a process counts as quiet (its
// background when idle: istiod about 3 ms, a relay about 10 ms).
const quietCPU = 20 * time.Millisecond

// quiet waits until the processes pids used at most limit of CPU
// together in each of 3 seconds in a row, for 3 minutes at most (ok
// false), and returns how long it waited.
func quiet(ctx context.Context, pids []int, limit time.Duration) (took time.Duration, ok bool, err error) {
	start := time.Now()
	total := func() (time.Duration, error) {
		var sum time.Duration
		for _, pid := range pids {
			st, err := loadtest.ReadProcStat(pid)
			if err != nil {
				return 0, err
			}
			sum += st.CPU
		}
		return sum, nil
	}
	last, err := total()
	if err != nil {
		return 0, false, err
	}
	for n := 0; n < 3; {
		if time.Since(start) > 3*time.Minute {
			return time.Since(start), false, nil
		}
		if !traffic.SleepCtx(ctx, time.Second) {
			return time.Since(start), false, ctx.Err()
		}
		now, err := total()
		if err != nil {
			return 0, false, err
		}
		if now-last <= limit {
			n++
		} else {
			n = 0
		}
		last = now
	}
	return time.Since(start), true, nil
}

// istiodStreams is istiod's count of connected xDS streams (pilot_xds).
func (b *bench) istiodStreams(ctx context.Context) (int, error) {
	v, err := scrape(ctx, "http://"+b.istiod.MonitoringAddr+"/metrics", "pilot_xds", "")
	return int(v), err
}

// istiodCDSPushes is istiod's count of CDS responses sent so far.
func (b *bench) istiodCDSPushes(ctx context.Context) (int, error) {
	v, err := scrape(ctx, "http://"+b.istiod.MonitoringAddr+"/metrics", "pilot_xds_pushes", `type="cds"`)
	return int(v), err
}

// Pid is istiod's process id.
func (d *Istiod) Pid() int { return d.proc.cmd.Process.Pid }

// startTier starts the relays: `meshrelay serve` processes on loopback,
// gossiping with each other, each with istiod as its upstream, and waits
// until each is ready and sees the whole tier.
func (b *bench) startTier(ctx context.Context) error {
	n := b.cfg.Relays
	// Each relay listens on an address of its own in 127/8 at fixed ports.
	// Ports picked free on 127.0.0.1 and bound later are not safe: a
	// relay started earlier dials istiod from 127.0.0.1 and the kernel may
	// give that connection the very port a later relay was to bind (CI saw
	// a relay exit so). Sockets dialled over loopback take 127.0.0.1 as
	// their source, never these addresses. The third octet keeps two
	// benches on one machine apart.
	host := func(i int) string { return fmt.Sprintf("127.77.%d.%d", os.Getpid()%250+1, i+1) }
	// A tier name of its own: never merge with another run's tier on
	// this machine.
	cluster := fmt.Sprintf("istio-bench-%d", os.Getpid())
	for i := range n {
		var join []string
		for j := range n {
			if j != i {
				join = append(join, host(j)+":7946")
			}
		}
		h := host(i)
		r := &benchRelay{xds: h + ":15010", admin: h + ":15014", goss: h + ":7946"}
		name := "relay-" + strconv.Itoa(i)
		log, err := b.logFile(name)
		if err != nil {
			return err
		}
		r.child, err = loadtest.StartChild(ctx, loadtest.ChildConfig{
			Path: b.cfg.Meshrelay,
			Args: append([]string{"serve", "--id", name, "--cluster", cluster,
				"--xds-listen", r.xds, "--admin-listen", r.admin, "--gossip-listen", r.goss,
				"--join", strings.Join(join, ","), "--rejoin-interval", "1s", "--drain-period", "1s",
				"--upstream", b.istiod.PlainAddr, "--upstream-protocol", string(b.cfg.UpstreamProtocol),
				"--log-level", "warn"}, b.cfg.RelayArgs...),
			Stderr:       log,
			Addr:         r.xds,
			Dir:          b.cfg.Dir,
			ReadyTimeout: time.Minute,
		})
		if err != nil {
			return fmt.Errorf("%s: %w; the end of its log:\n%s", name, err, logTail(log.Name(), 20))
		}
		b.relays = append(b.relays, r)
	}
	deadline := time.Now().Add(time.Minute)
	hc := &http.Client{Timeout: 2 * time.Second}
	for _, r := range b.relays {
		for {
			ready := httpOK(ctx, hc, "http://"+r.admin+"/readyz")
			members, err := scrape(ctx, "http://"+r.admin+"/metrics", "meshrelay_ring_members", "")
			if ready && err == nil && int(members) == n {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("relay %s: ready %v, %v relays in its ring (%v) after a minute; want %d", r.xds, ready, members, err, n)
			}
			if !traffic.SleepCtx(ctx, 100*time.Millisecond) {
				return ctx.Err()
			}
		}
	}
	b.logf("%d relays ready, one ring", n)
	return nil
}

func httpOK(ctx context.Context, hc *http.Client, url string) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false
	}
	resp, err := hc.Do(req)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// relayMetric sums metric (lines that contain label, if set) over the
// relays.
func (b *bench) relayMetric(ctx context.Context, metric, label string) (int, error) {
	sum := 0.0
	for _, r := range b.relays {
		v, err := scrape(ctx, "http://"+r.admin+"/metrics", metric, label)
		if err != nil {
			return 0, err
		}
		sum += v
	}
	return int(sum), nil
}

// pids returns istiod's process id, then the relays'.
func (b *bench) pids() []int {
	out := []int{b.istiod.Pid()}
	for _, r := range b.relays {
		out = append(out, r.child.Pid())
	}
	return out
}

// cpu is the CPU time of istiod and of the relays together, and of this
// process, now.
func (b *bench) cpu() (istiod, relays, self time.Duration, err error) {
	for i, pid := range b.pids() {
		st, err := loadtest.ReadProcStat(pid)
		if err != nil {
			return 0, 0, 0, err
		}
		if i == 0 {
			istiod = st.CPU
		} else {
			relays += st.CPU
		}
	}
	st, err := loadtest.ReadProcStat(os.Getpid())
	return istiod, relays, st.CPU, err
}

// measure runs the sidecars against targets: their full sync, then one
// ServiceEntry edit; it stops them before it returns.
func (b *bench) measure(ctx context.Context, run *BenchRun, targets []string) error {
	cfg := b.cfg
	smp := startSampler(ctx, b)
	defer smp.stop()
	// The harness's own scrapes of the processes' metrics cost them CPU
	// (a relay's /metrics page takes a few milliseconds to render): they
	// are made before the start, and those after the sync are left out.
	cds0, err := b.istiodCDSPushes(ctx)
	if err != nil {
		return err
	}
	div0, err := b.relayMetric(ctx, "meshrelay_divergence_checks_total", "")
	if err != nil {
		return err
	}
	i0, r0, s0, err := b.cpu()
	if err != nil {
		return err
	}
	start := time.Now()
	if b.fleet, err = b.sidecarFleet(ctx, cfg.Sidecars, targets, true); err != nil {
		return err
	}
	defer func() {
		b.fleet.Stop(context.WithoutCancel(ctx))
		b.fleet = nil
	}()
	sctx, cancel := context.WithTimeout(ctx, cfg.SyncTimeout)
	defer cancel()
	took := b.waitAll(sctx, start, func(e *envoy.Envoy, v envoy.View) bool { return fullySynced(e, v, cfg.Services+b.edits) })[0]
	i1, r1, s1, err := b.cpu()
	if err != nil {
		return err
	}
	run.IstiodRSS, run.RelaysRSS, run.IstiodStreamsMax = smp.stop()
	run.IstiodCPU, run.RelaysCPU, run.SidecarsCPU = i1-i0, r1-r0, s1-s0
	run.Synced, run.Sync = summarize(took)
	if run.IstiodStreams, err = b.istiodStreams(ctx); err != nil {
		return err
	}
	cds1, err := b.istiodCDSPushes(ctx)
	if err != nil {
		return err
	}
	div1, err := b.relayMetric(ctx, "meshrelay_divergence_checks_total", "")
	if err != nil {
		return err
	}
	run.IstiodCDSPushes, run.DivergenceChecks = cds1-cds0, div1-div0
	run.IstiodStreamsMax = max(run.IstiodStreamsMax, run.IstiodStreams)
	if len(b.relays) > 0 {
		if run.Keys, err = b.relayMetric(ctx, "meshrelay_keys_by_source", `source="upstream"`); err != nil {
			return err
		}
		if run.RelayStreams.Keys, err = b.relayMetric(ctx, "meshrelay_upstream_streams", ""); err != nil {
			return err
		}
		if run.RelayStreams.DivergenceChecks, err = b.relayMetric(ctx, "meshrelay_divergence_check_streams", ""); err != nil {
			return err
		}
		if run.RelayStreams.Passthrough, err = b.relayMetric(ctx, "meshrelay_passthrough_streams", ""); err != nil {
			return err
		}
	}
	iScraped, rScraped, _, err := b.cpu()
	if err != nil {
		return err
	}
	b.figures(run)
	run.SyncBytes, run.SyncResponses = run.Bytes, run.Responses
	b.logf("%d of %d sidecars synced; wall %v; istiod CPU %v, relays CPU %v; istiod streams %d (max %d)",
		run.Synced, cfg.Sidecars, run.Sync.Max.Round(time.Millisecond), run.IstiodCPU, run.RelaysCPU, run.IstiodStreams, run.IstiodStreamsMax)
	if run.Synced < cfg.Sidecars {
		return fmt.Errorf("%d of %d sidecars synced in %v", run.Synced, cfg.Sidecars, cfg.SyncTimeout)
	}
	// What the sync set going goes on a while after it (the relays'
	// divergence checks, istiod's bookkeeping): count it too.
	took2, ok, err := quiet(ctx, b.pids(), quietCPU*time.Duration(len(b.pids())))
	if err != nil {
		return err
	}
	i2, r2, _, err := b.cpu()
	if err != nil {
		return err
	}
	i2, r2 = i2-(iScraped-i1), r2-(rScraped-r1) // less the scrapes at the sync
	if run.QuietAfter, run.IstiodCPUQuiet, run.RelaysCPUQuiet = took2, i2-i0, r2-r0; !ok {
		b.logf("not quiet %v after the sync: going on", took2.Round(time.Second))
	}
	if run.DivergenceChecksQuiet, err = b.relayMetric(ctx, "meshrelay_divergence_checks_total", ""); err != nil {
		return err
	}
	run.DivergenceChecksQuiet -= div0
	b.logf("quiet %v after the sync: istiod CPU %v, relays CPU %v since the start", took2.Round(time.Second), run.IstiodCPUQuiet, run.RelaysCPUQuiet)

	// The edit: svc-0 gets another host, whose cluster and endpoints
	// every sidecar must get.
	b.edits++
	host := benchHost("edit-" + strconv.Itoa(b.edits))
	cluster := benchCluster(host)
	i0, r0, _, err = b.cpu()
	if err != nil {
		return err
	}
	at := time.Now()
	if err := b.addHost(ctx, "svc-0", host); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, cfg.ChangeTimeout)
	defer cancel()
	steps := b.waitAll(cctx, at, func(_ *envoy.Envoy, v envoy.View) bool {
		return v.Has(envoy.ClusterType, cluster)
	}, func(_ *envoy.Envoy, v envoy.View) bool {
		return v.Has(envoy.ClusterType, cluster) && v.Has(envoy.EndpointType, cluster)
	})
	i1, r1, _, err = b.cpu()
	if err != nil {
		return err
	}
	run.ChangeIstiodCPU, run.ChangeRelaysCPU = i1-i0, r1-r0
	_, run.ChangeCluster = summarize(steps[0])
	run.ChangeReached, run.Change = summarize(steps[1])
	if run.IstiodStreamsEnd, err = b.istiodStreams(ctx); err != nil {
		return err
	}
	b.figures(run)
	b.logf("edit reached %d of %d sidecars: P50 %v, P99 %v, max %v", run.ChangeReached, cfg.Sidecars,
		run.Change.P50.Round(time.Millisecond), run.Change.P99.Round(time.Millisecond), run.Change.Max.Round(time.Millisecond))
	if run.ChangeReached < cfg.Sidecars {
		return fmt.Errorf("the edit reached %d of %d sidecars in %v", run.ChangeReached, cfg.Sidecars, cfg.ChangeTimeout)
	}
	return nil
}

// figures copies the fleet's counters into run.
func (b *bench) figures(run *BenchRun) {
	fig := b.fleet.Figures(5)
	run.Reconnects, run.Bytes = fig.Reconnects, fig.BytesReceived
	run.Violations, run.ViolationSamples = fig.Violations, fig.ViolationSamples
	run.Responses = 0
	for _, e := range b.fleet.Envoys() {
		run.Responses += e.Stats().Responses
	}
}

// waitAll waits, for every sidecar at once, until each of conds holds
// for it in turn, or ctx ends; took[k] are the times from start to when
// conds[k] held, for the sidecars where it did.
func (b *bench) waitAll(ctx context.Context, start time.Time, conds ...func(*envoy.Envoy, envoy.View) bool) (took [][]time.Duration) {
	var mu sync.Mutex
	took = make([][]time.Duration, len(conds))
	var wg sync.WaitGroup
	for _, e := range b.fleet.Envoys() {
		wg.Go(func() {
			for k, cond := range conds {
				if e.WaitFor(ctx, func(v envoy.View) bool { return cond(e, v) }) != nil {
					return
				}
				d := time.Since(start)
				mu.Lock()
				took[k] = append(took[k], d)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return took
}

// addHost adds host to ServiceEntry name's hosts.
func (b *bench) addHost(ctx context.Context, name, host string) error {
	client := b.dyn.Resource(serviceEntryGVR).Namespace(benchServiceNS)
	se, err := client.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("get ServiceEntry %s: %w", name, err)
	}
	hosts, _, err := unstructured.NestedSlice(se.Object, "spec", "hosts")
	if err != nil {
		return fmt.Errorf("ServiceEntry %s: %w", name, err)
	}
	if err := unstructured.SetNestedSlice(se.Object, append(hosts, host), "spec", "hosts"); err != nil {
		return err
	}
	if _, err := client.Update(ctx, se, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update ServiceEntry %s: %w", name, err)
	}
	return nil
}

// summarize returns how many durations there are and their percentiles
// by nearest rank, as loadtest's Latency reports them.
func summarize(d []time.Duration) (int, report.Latency) {
	if len(d) == 0 {
		return 0, report.Latency{}
	}
	s := slices.Sorted(slices.Values(d))
	n := len(s)
	q := func(pct int) time.Duration { return s[max(1, (pct*n+99)/100)-1] }
	return n, report.Latency{N: n, P50: q(50), P95: q(95), P99: q(99), Max: s[n-1]}
}
