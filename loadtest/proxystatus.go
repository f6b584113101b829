package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/report"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/shard/adminpb"
)

// ProxyStatusConfig sizes `loadtest proxystatus`.
type ProxyStatusConfig struct {
	Relays  int `json:"relays"`
	Envoys  int `json:"envoys"`
	Keys    int `json:"keys"`
	Queries int `json:"queries"`
}

// DefaultProxyStatusConfig is issue 6's scale: 10,000 Envoys over 3 relays.
func DefaultProxyStatusConfig() ProxyStatusConfig {
	return ProxyStatusConfig{Relays: 3, Envoys: 10_000, Keys: 100, Queries: 50}
}

// ProxyStatusReport is what RunProxyStatus measured.
type ProxyStatusReport struct {
	Date    string            `json:"date"`
	Machine report.Machine    `json:"machine"`
	Config  ProxyStatusConfig `json:"config"`
	// ListEnvoys: the admin API's tier-wide list of every Envoy with its
	// status per type (the basic view: what relayctl proxy-status shows),
	// asked of one relay over loopback gRPC, the answer decoded; its size
	// on the wire. ListEnvoysFull: the same with every field.
	ListEnvoys          Quantiles `json:"list_envoys"`
	ListEnvoysBytes     int       `json:"list_envoys_bytes"`
	ListEnvoysFull      Quantiles `json:"list_envoys_full"`
	ListEnvoysFullBytes int       `json:"list_envoys_full_bytes"`
	// Syncz: istio.io/debug/syncz over a new ADS stream each time, as
	// istioctl proxy-status --xds-address asks it.
	Syncz      Quantiles `json:"syncz"`
	SynczBytes int       `json:"syncz_bytes"`
	// Target: ListEnvoys P99 ≤ 100 ms.
	Target bool `json:"list_envoys_p99_le_100ms"`
}

// RunProxyStatus measures a tier-wide proxy-status: a tier of cfg.Relays
// real relays (shard nodes, gossiping in memory) whose ledgers hold
// cfg.Envoys Envoys between them, 1% NACKing and 1% silent (the ledger is
// driven directly, as in `loadtest ledger`, so that the figures are the
// query's and not those of 10,000 simulated Envoys sharing the cores).
func RunProxyStatus(ctx context.Context, cfg ProxyStatusConfig, out io.Writer) (*ProxyStatusReport, error) {
	if cfg.Relays < 1 || cfg.Envoys < 100 || cfg.Keys < 1 || cfg.Queries < 1 {
		return nil, errors.New("loadtest: proxystatus wants Relays ≥ 1, Envoys ≥ 100, Keys and Queries ≥ 1")
	}
	rep := &ProxyStatusReport{Date: time.Now().UTC().Format(time.RFC3339), Config: cfg,
		Machine: report.ThisMachine()}
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = upstream.Scenario{Services: 10, Endpoints: 10, Namespaces: 1}
	up, err := upstream.Start(ctx, ucfg)
	if err != nil {
		return nil, err
	}
	defer up.Stop(context.Background())
	tier, err := cluster.StartTier(ctx, cluster.TierConfig{Relays: cfg.Relays, Upstream: up.Addr(),
		Relay: func(c *relay.Config) { c.Admin.Listen = "127.0.0.1:0" }})
	if err != nil {
		return nil, err
	}
	defer tier.Stop(context.Background())
	relays := tier.Running()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		formed := true
		for _, r := range relays {
			formed = formed && len(r.Node.Ring().Members()) == cfg.Relays
		}
		if formed {
			break
		}
		if time.Now().After(deadline) {
			return nil, errors.New("loadtest: the ring did not form in 30s")
		}
	}

	lcfg := LedgerConfig{Relays: cfg.Relays, Envoys: cfg.Envoys, Keys: cfg.Keys, Resources: 200, Versions: 10}
	views, keys := buildLedgerViews(lcfg), ledgerKeys(cfg.Keys)
	for i, r := range relays {
		if err := views.populate(r.Node.Relay(), lcfg, keys, i); err != nil {
			return nil, err
		}
	}
	fmt.Fprintf(out, "%d relays, %d Envoys between them over %d keys (1%% NACKing, 1%% silent)\n", cfg.Relays, cfg.Envoys, cfg.Keys)

	asked := relays[0].Node.Relay()
	admin, err := grpc.NewClient(asked.AdminAddr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	c := adminpb.NewAdminClient(admin)
	list := func(view adminpb.EnvoyView, size *int) error {
		l, err := c.ListEnvoys(ctx, &adminpb.ListEnvoysRequest{View: view}, grpc.MaxCallRecvMsgSize(256<<20))
		switch {
		case err != nil:
			return err
		case len(l.GetMissing()) > 0:
			return fmt.Errorf("relays missing from the answer: %v", l.GetMissing())
		case len(l.GetEnvoys()) != cfg.Envoys:
			return fmt.Errorf("ListEnvoys listed %d Envoys, want %d", len(l.GetEnvoys()), cfg.Envoys)
		}
		*size = proto.Size(l)
		return nil
	}
	basic := func() error { return list(adminpb.EnvoyView_ENVOY_VIEW_BASIC, &rep.ListEnvoysBytes) }
	full := func() error { return list(adminpb.EnvoyView_ENVOY_VIEW_FULL, &rep.ListEnvoysFullBytes) }
	xds, err := grpc.NewClient(asked.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20)))
	if err != nil {
		return nil, err
	}
	defer xds.Close()
	syncz := func() error {
		sctx, cancel := context.WithCancel(ctx)
		defer cancel()
		ads, err := discovery.NewAggregatedDiscoveryServiceClient(xds).StreamAggregatedResources(sctx)
		if err != nil {
			return err
		}
		if err := ads.Send(&discovery.DiscoveryRequest{TypeUrl: "istio.io/debug/syncz", Node: &core.Node{Id: "debug~0.0.0.0~loadtest~.svc.cluster.local"}}); err != nil {
			return err
		}
		resp, err := ads.Recv()
		if err != nil {
			return err
		}
		// Connected Envoys only (the silent ones are connected too).
		if len(resp.GetResources()) != cfg.Envoys {
			return fmt.Errorf("syncz listed %d Envoys, want %d", len(resp.GetResources()), cfg.Envoys)
		}
		rep.SynczBytes = proto.Size(resp)
		return nil
	}
	// Connections and the relays' connections to each other are made by
	// the first calls, which are not timed.
	for range 3 {
		if err := errors.Join(basic(), full()); err != nil {
			return nil, err
		}
		if err := syncz(); err != nil {
			return nil, err
		}
	}
	var qerr error
	rep.ListEnvoys = timeQuery(cfg.Queries, func() { qerr = errors.Join(qerr, basic()) })
	rep.ListEnvoysFull = timeQuery(cfg.Queries/5+1, func() { qerr = errors.Join(qerr, full()) })
	rep.Syncz = timeQuery(cfg.Queries, func() { qerr = errors.Join(qerr, syncz()) })
	if qerr != nil {
		return nil, qerr
	}
	rep.Target = rep.ListEnvoys.P99 <= 100*time.Millisecond
	fmt.Fprintf(out, "proxy-status (admin ListEnvoys, tier-wide, asked of relay-0): P50 %v P99 %v, %.1f MiB answer\n",
		rep.ListEnvoys.P50, rep.ListEnvoys.P99, float64(rep.ListEnvoysBytes)/(1<<20))
	fmt.Fprintf(out, "the same, every field (ENVOY_VIEW_FULL, relayctl proxy-status -o json): P50 %v P99 %v, %.1f MiB answer\n",
		rep.ListEnvoysFull.P50, rep.ListEnvoysFull.P99, float64(rep.ListEnvoysFullBytes)/(1<<20))
	fmt.Fprintf(out, "istioctl proxy-status (istio.io/debug/syncz over ADS): P50 %v P99 %v, %.1f MiB answer\n",
		rep.Syncz.P50, rep.Syncz.P99, float64(rep.SynczBytes)/(1<<20))
	fmt.Fprintf(out, "target: proxy-status P99 ≤ 100 ms %s\n", report.Judge(rep.Target))
	return rep, nil
}
