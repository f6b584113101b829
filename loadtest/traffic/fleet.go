// Package traffic drives a relay tier the way a mesh does: fleets of
// simulated Envoys (loadtest/envoy) spread over aggregation keys on a
// synthetic istiod-shaped upstream (loadtest/upstream), and the Tracker
// that times each change until every Envoy that must get it ACKed it. The
// demo and the benchmarks are built on it.
package traffic

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// FleetConfig describes a fleet of simulated Envoys.
type FleetConfig struct {
	// Scenario is the upstream's scenario: it names the nodes.
	Scenario upstream.Scenario
	// Envoys is the number of simulated Envoys. Default 100.
	Envoys int
	// Keys is the number of aggregation keys they spread over, round-robin:
	// key k is workload k/Namespaces in namespace k%Namespaces, so keys
	// cover the namespaces evenly. Default 10.
	Keys int
	// Protocol is the Envoys' ADS variant. Default Delta.
	Protocol envoy.Protocol
	// Target is the gRPC address they connect to (a relay or the upstream).
	Target string
	// Targets, if set, replaces Target: Envoy i connects to Targets[i %
	// len(Targets)], as a Service spreading connections over the relays
	// of a tier would (without a proxy in the way of their bytes).
	Targets []string
	// Light makes every Envoy keep no resource bodies (envoy.Config.Light),
	// and decode each resource content once for the whole fleet
	// (envoy.DecodeCache).
	Light bool
	// MaxSyncing, if positive, bounds the Envoys that have started but not
	// yet applied their first clusters and endpoints: StartFleet waits
	// before starting more (with StartRate still the upper bound), so that
	// an initial sync at Istio scale does not have thousands of full
	// responses in flight at once. Default 0: no bound.
	MaxSyncing int
	// EnvoysPerConn is how many Envoys share one gRPC connection. Real
	// Envoys each have their own; sharing saves file descriptors and
	// goroutines when simulating thousands. Default 1.
	EnvoysPerConn int
	// StartRate bounds how many Envoys connect per second (0: all at once).
	StartRate float64
	// Tracker, if set, sees every Envoy's ACKs.
	Tracker *Tracker
	// OnEvent, if set, sees every event of Envoy i (see envoy.Event). It
	// is called on the Envoy's stream goroutine: keep it quick.
	OnEvent func(i int, ev envoy.Event)
	// MaxMsgSize bounds a received message. Default 256 MiB.
	MaxMsgSize int
	// Configure, if set, adjusts Envoy i's config before it starts (a test
	// makes some Envoys reject responses, or never ACK).
	Configure func(i int, c *envoy.Config)
}

// Fleet is a running set of simulated Envoys. Stop it when done.
type Fleet struct {
	cfg    FleetConfig
	envoys []*envoy.Envoy
	// firstSyncing is the first Envoy that may still be waiting for its
	// first clusters and endpoints (MaxSyncing).
	firstSyncing int
	groups       []string // each Envoy's upstream group
	conns        []*grpc.ClientConn
	bytes        atomic.Uint64
}

// keyNode returns pod pod of aggregation key key, as every fleet of the
// load tests spreads Envoys over keys: key k is workload k/Namespaces of
// namespace k%Namespaces (one key per workload under the istio profile).
// KeyNode is the node of pod pod of aggregation key key in sc: keys
// spread over the namespaces, then over workloads.
func KeyNode(sc upstream.Scenario, key, pod int) *core.Node {
	return sc.Node(key%sc.Namespaces, key/sc.Namespaces, pod)
}

// StartFleet connects cfg.Envoys simulated Envoys to cfg.Target. It returns
// once every Envoy has started (not synced: see WaitSynced).
func StartFleet(ctx context.Context, cfg FleetConfig) (*Fleet, error) {
	if cfg.Envoys == 0 {
		cfg.Envoys = 100
	}
	if cfg.Keys == 0 {
		cfg.Keys = 10
	}
	if cfg.EnvoysPerConn == 0 {
		cfg.EnvoysPerConn = 1
	}
	if cfg.MaxMsgSize == 0 {
		cfg.MaxMsgSize = 256 << 20
	}
	switch {
	case cfg.Envoys < 0 || cfg.Keys < 0 || cfg.EnvoysPerConn < 0 || cfg.MaxSyncing < 0:
		return nil, errors.New("loadtest: Envoys, Keys, EnvoysPerConn and MaxSyncing must not be negative")
	case cfg.Target == "" && len(cfg.Targets) == 0:
		return nil, errors.New("loadtest: fields Target and Targets are empty")
	case cfg.Target != "" && len(cfg.Targets) > 0:
		return nil, errors.New("loadtest: fields Target and Targets are both set")
	case cfg.Scenario.Namespaces <= 0:
		return nil, errors.New("loadtest: the scenario has no namespaces")
	}
	targets := cfg.Targets
	if len(targets) == 0 {
		targets = []string{cfg.Target}
	}
	f := &Fleet{cfg: cfg}
	var decoded *envoy.DecodeCache
	if cfg.Light {
		decoded = envoy.NewDecodeCache()
	}
	// conn[t] is the connection the next Envoys of targets[t] share;
	// used[t] how many share it.
	conn := make([]*grpc.ClientConn, len(targets))
	used := make([]int, len(targets))
	var pace *time.Ticker
	if cfg.StartRate > 0 {
		pace = time.NewTicker(time.Duration(float64(time.Second) / cfg.StartRate))
		defer pace.Stop()
	}
	for i := range cfg.Envoys {
		if err := f.waitSyncing(ctx, cfg.MaxSyncing); err != nil {
			f.Stop(context.Background())
			return nil, err
		}
		t := i % len(targets)
		if used[t]%cfg.EnvoysPerConn == 0 {
			c, err := grpc.NewClient(targets[t],
				grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(cfg.MaxMsgSize)))
			if err != nil {
				f.Stop(ctx)
				return nil, fmt.Errorf("loadtest: dial %s: %w", targets[t], err)
			}
			conn[t] = c
			f.conns = append(f.conns, c)
		}
		used[t]++
		node := KeyNode(cfg.Scenario, i%cfg.Keys, i/cfg.Keys)
		ec := envoy.DefaultConfig()
		ec.Node = node
		ec.Protocol = cfg.Protocol
		ec.Conn = conn[t]
		ec.Light, ec.DecodeCache = cfg.Light, decoded
		ec.Generation = upstream.Generation
		ec.MaxRecvMsgSize = cfg.MaxMsgSize
		// A relay pushes without waiting for ACKs, so a response may cross
		// an unsubscription on the wire more than once.
		ec.UnsubscribeGrace = 8
		idx := i
		ec.OnEvent = func(ev envoy.Event) {
			if ev.Kind == envoy.Received {
				f.bytes.Add(uint64(ev.Bytes))
			}
			if cfg.Tracker != nil {
				cfg.Tracker.Observe(idx, ev)
			}
			if cfg.OnEvent != nil {
				cfg.OnEvent(idx, ev)
			}
		}
		if cfg.Configure != nil {
			cfg.Configure(i, &ec)
		}
		e, err := envoy.New(ec)
		if err != nil {
			f.Stop(ctx)
			return nil, err
		}
		if err := e.Start(ctx); err != nil {
			f.Stop(ctx)
			return nil, err
		}
		f.envoys = append(f.envoys, e)
		f.groups = append(f.groups, cfg.Scenario.Group(node))
		if cfg.Tracker != nil {
			cfg.Tracker.AddEnvoy(idx, f.groups[idx])
		}
		if pace != nil {
			select {
			case <-pace.C:
			case <-ctx.Done():
				f.Stop(context.Background())
				return nil, ctx.Err()
			}
		}
	}
	return f, nil
}

// waitSyncing waits, if limit is positive, until fewer than limit
// started Envoys are still waiting for their first clusters and
// endpoints.
func (f *Fleet) waitSyncing(ctx context.Context, limit int) error {
	if limit <= 0 {
		return nil
	}
	applied := func(e *envoy.Envoy) bool {
		return e.Version(envoy.ClusterType) != "" && e.Version(envoy.EndpointType) != ""
	}
	for {
		for f.firstSyncing < len(f.envoys) && applied(f.envoys[f.firstSyncing]) {
			f.firstSyncing++ // never looked at again
		}
		syncing := 0
		for _, e := range f.envoys[f.firstSyncing:] {
			if !applied(e) {
				syncing++
			}
		}
		if syncing < limit {
			return nil
		}
		if !SleepCtx(ctx, 20*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// Stop stops every Envoy and closes the connections.
func (f *Fleet) Stop(ctx context.Context) {
	var wg sync.WaitGroup
	for _, e := range f.envoys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = e.Stop(ctx)
		}()
	}
	wg.Wait()
	for _, c := range f.conns {
		_ = c.Close()
	}
}

// Envoys returns the fleet's Envoys.
func (f *Fleet) Envoys() []*envoy.Envoy { return f.envoys }

// Groups returns each Envoy's upstream node group, by index.
func (f *Fleet) Groups() []string { return slices.Clone(f.groups) }

// BytesReceived is the total size of the responses the fleet received.
func (f *Fleet) BytesReceived() uint64 { return f.bytes.Load() }

// Connected returns how many Envoys have a stream open now.
func (f *Fleet) Connected() int {
	n := 0
	for _, e := range f.envoys {
		if e.Stats().Connected {
			n++
		}
	}
	return n
}

// FleetFigures are a fleet's counters at one moment.
type FleetFigures struct {
	Envoys int `json:"envoys"`
	// Connected counts the Envoys with a stream open.
	Connected int `json:"connected"`
	// BytesReceived is the size of every response the fleet received.
	BytesReceived uint64 `json:"bytes_received"`
	// Reconnects counts streams reopened; ReconnectReasons says why the
	// last stream of each Envoy that reopened one ended, most common first
	// (at most as many as the violations spelt out, each "N× reason").
	Reconnects       uint64   `json:"reconnects"`
	ReconnectReasons []string `json:"reconnect_reasons,omitempty"`
	// Refused counts Envoys whose last stream the server refused
	// (Unauthenticated, PermissionDenied).
	Refused int `json:"refused"`
	// Violations counts the protocol violations recorded; a few of them
	// are in ViolationSamples.
	Violations       int      `json:"violations"`
	ViolationSamples []string `json:"violation_samples,omitempty"`
	// Tokens is the distinct tokens a TLS fleet presented (a fleet child's).
	Tokens int `json:"tokens,omitempty"`
}

// Health is what a report says of the fleet's streams and violations.
func (f FleetFigures) Health() report.Health {
	return report.Health{Reconnects: f.Reconnects, ReconnectReasons: f.ReconnectReasons, Violations: f.Violations, ViolationSamples: f.ViolationSamples}
}

// MaxViolationSamples bounds FleetFigures.ViolationSamples.
const MaxViolationSamples = 5

// Figures returns the fleet's counters now, with at most samples
// violations spelt out.
func (f *Fleet) Figures(samples int) FleetFigures {
	fig := FleetFigures{Envoys: len(f.envoys), BytesReceived: f.BytesReceived()}
	reasons := map[string]int{}
	for _, e := range f.envoys {
		st := e.Stats()
		fig.Reconnects += st.Reconnects
		if st.Reconnects > 0 && st.LastErr != nil {
			reasons[st.LastErr.Error()]++
		}
		if st.Connected {
			fig.Connected++
		} else if c := status.Code(st.LastErr); c == codes.Unauthenticated || c == codes.PermissionDenied {
			fig.Refused++
		}
	}
	fig.ReconnectReasons = topReasons(reasons, samples)
	v := f.Violations()
	fig.Violations = len(v)
	for _, e := range v[:min(len(v), samples)] {
		fig.ViolationSamples = append(fig.ViolationSamples, e.Error())
	}
	return fig
}

// topReasons returns the n most common reasons, each "N× reason", most
// common first.
func topReasons(count map[string]int, n int) []string {
	reasons := slices.SortedFunc(maps.Keys(count), func(a, b string) int {
		return cmp.Or(cmp.Compare(count[b], count[a]), cmp.Compare(a, b))
	})
	var out []string
	for _, r := range reasons[:min(len(reasons), n)] {
		out = append(out, fmt.Sprintf("%d× %s", count[r], r))
	}
	return out
}

// Counters returns each Envoy's bytes received and streams reopened.
func (f *Fleet) Counters() EnvoyCounters {
	c := EnvoyCounters{Bytes: make([]uint64, len(f.envoys)), Reconnects: make([]uint64, len(f.envoys))}
	for i, e := range f.envoys {
		st := e.Stats()
		c.Bytes[i], c.Reconnects[i] = st.BytesReceived, st.Reconnects
	}
	return c
}

// Violations returns every protocol violation any Envoy recorded.
func (f *Fleet) Violations() []error {
	var out []error
	for _, e := range f.envoys {
		for _, v := range e.Violations() {
			out = append(out, fmt.Errorf("%s: %w", e.ID(), v))
		}
	}
	return out
}

// Synced counts the Envoys that hold exactly the clusters and endpoints
// their group is served now (names and generations).
func (f *Fleet) Synced(up *upstream.Upstream) int {
	want := map[string]map[string]uint64{}
	n := 0
	for i, e := range f.envoys {
		g := f.groups[i]
		w, ok := want[g]
		if !ok {
			w = Expected(up.Snapshot(g))
			want[g] = w
		}
		if holds(e, w) {
			n++
		}
	}
	return n
}

// WaitSynced waits until every Envoy holds its group's clusters and
// endpoints (as Synced counts them; listeners and routes may still be on
// their way), or ctx ends. It checks every 200 ms, and checks an Envoy no more once it has
// been seen synced (call it when the upstream is not changing).
func (f *Fleet) WaitSynced(ctx context.Context, up *upstream.Upstream) error {
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	want := map[string]map[string]uint64{}
	for _, g := range up.Groups() {
		want[g] = Expected(up.Snapshot(g))
	}
	synced := make([]bool, len(f.envoys))
	n := 0
	for {
		for i, e := range f.envoys {
			if !synced[i] && holds(e, want[f.groups[i]]) {
				synced[i] = true
				n++
			}
		}
		if n == len(f.envoys) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("loadtest: %d of %d Envoys synced: %w", n, len(f.envoys), ctx.Err())
		case <-t.C:
		}
	}
}

// Expected maps "type|name" to generation for CDS and EDS of a snapshot.
func Expected(snap map[string]map[string]proto.Message) map[string]uint64 {
	return Generations(snap, envoy.ClusterType, envoy.EndpointType)
}

func holds(e *envoy.Envoy, want map[string]uint64) bool {
	n := 0
	for _, typeURL := range []string{envoy.ClusterType, envoy.EndpointType} {
		held := e.Resources(typeURL)
		for name, h := range held {
			g, ok := want[typeURL+"|"+name]
			if !ok || g != h.Generation {
				return false
			}
		}
		n += len(held)
	}
	return n == len(want)
}
