package demo

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/traffic"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/realenvoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// The demo's real Envoys (Config.RealEnvoys): each joins a key of the
// simulated fleet, with a listener of its own whose route, cluster and
// endpoints come over xDS from the tier, and the demo sends a request
// through each every interval to a backend it runs.

// demoService is the HTTP service the real Envoys route to.
const demoService = "web"

// demoEnvoys are the demo's real Envoys and what it last saw of each.
type demoEnvoys struct {
	backend *http.Server
	envoys  []*demoEnvoy
	dir     string
	cancel  context.CancelFunc // ends run's requests
	wg      sync.WaitGroup
}

type demoEnvoy struct {
	e      *realenvoy.Envoy
	node   string
	listen string
	// last is the latest request's result; ok and sent count them.
	last     atomic.Value // string
	ok, sent atomic.Int64
	// status is the ledger's word on it (see demoEnvoys.observe).
	status atomic.Value // string
}

// addDemoService adds the HTTP service the real Envoys route to, backed by
// a server on loopback, to sc; it returns the server.
func addDemoService(sc *upstream.Scenario) (*http.Server, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "backend") }),
		ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(lis)
	sc.HTTPServices = append(sc.HTTPServices, upstream.HTTPService{Name: demoService, Backends: []string{lis.Addr().String()}})
	return srv, nil
}

// startDemoEnvoys starts n real Envoys of binary bin on target: Envoy j
// joins the key of simulated Envoy j (of sims over keys), as the next pod
// of its workload (an IPv4 pod while pods stay under 256: a node's IP
// families are part of its key).
func startDemoEnvoys(ctx context.Context, bin string, n, sims, keys int, sc upstream.Scenario, p envoy.Protocol, target string, backend *http.Server) (*demoEnvoys, error) {
	d := &demoEnvoys{backend: backend}
	var err error
	if d.dir, err = os.MkdirTemp("", "meshrelay-demo-envoys-"); err != nil {
		return nil, err
	}
	_, route, _ := upstream.HTTPNames(demoService)
	for j := range n {
		node := traffic.KeyNode(sc, j%keys, sims/keys+1+j/keys)
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			d.stop()
			return nil, err
		}
		listen := lis.Addr().String()
		lis.Close()
		dir := filepath.Join(d.dir, fmt.Sprintf("envoy-%d", j))
		if err := os.Mkdir(dir, 0o700); err != nil {
			d.stop()
			return nil, err
		}
		e, err := realenvoy.Start(ctx, realenvoy.Config{Binary: bin, XDS: target, Delta: p == envoy.Delta, Node: node, Dir: dir,
			Ingress: &realenvoy.Ingress{Listen: listen, Route: route}})
		if err != nil {
			d.stop()
			return nil, err
		}
		de := &demoEnvoy{e: e, node: node.GetId(), listen: listen}
		de.last.Store("-")
		de.status.Store("-")
		d.envoys = append(d.envoys, de)
	}
	return d, nil
}

// run sends a request through every Envoy each interval, from when it has
// its first config until ctx ends or stop.
func (d *demoEnvoys) run(ctx context.Context, interval time.Duration) {
	ctx, d.cancel = context.WithCancel(ctx)
	client := &http.Client{Timeout: interval}
	for _, de := range d.envoys {
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			// Requests start once the Envoy has its first config (its
			// /ready says LIVE): until then its listener has no route.
			de.last.Store("(waiting for its first config)")
			if de.e.WaitReady(ctx) != nil {
				return
			}
			t := time.NewTicker(interval)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				got := get(ctx, client, de.listen)
				de.last.Store(got)
				if strings.HasPrefix(got, "200") {
					de.ok.Add(1)
				}
				de.sent.Add(1)
			}
		}()
	}
}

// get sends one GET to addr and says what came back.
func get(ctx context.Context, client *http.Client, addr string) string {
	start := time.Now()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/", nil)
	if err != nil {
		return err.Error()
	}
	resp, err := client.Do(req)
	if err != nil {
		return "failed: " + err.Error()
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
	return fmt.Sprintf("%d %s in %s", resp.StatusCode, strings.TrimSpace(string(body)), report.MS(time.Since(start)))
}

// observe records each Envoy's status in rep: SYNCED when it ACKed its
// key's current version of every type, else the first other status.
func (d *demoEnvoys) observe(rep *ledger.Report) {
	if rep == nil {
		return
	}
	byNode := make(map[string]string, len(d.envoys))
	for _, e := range rep.Envoys() {
		if !e.State.Connected() {
			continue
		}
		st := ledger.StatusSynced
		for _, et := range e.State.Types {
			if s := rep.Status(e, et); s != ledger.StatusSynced {
				st = s
				break
			}
		}
		byNode[e.State.Node] = string(st)
	}
	for _, de := range d.envoys {
		if st, ok := byNode[de.node]; ok {
			de.status.Store(st)
		} else {
			de.status.Store("not connected")
		}
	}
}

// print writes a line per Envoy: its relay and key (as the tier lists its
// streams), its status, its latest request.
func (d *demoEnvoys) print(out io.Writer, tier *cluster.Tier) {
	type where struct{ relay, key string }
	at := make(map[string]where, len(d.envoys))
	for _, tr := range tier.Running() {
		for _, c := range tr.Node.Relay().Clients() {
			if c.PeerRelay == "" {
				at[c.NodeID] = where{tr.ID, string(c.Key)}
			}
		}
	}
	for j, de := range d.envoys {
		w, ok := at[de.node]
		if !ok {
			w = where{"-", "-"}
		}
		fmt.Fprintf(out, "        real envoy-%d  %-8s %-40s %-14s GET %s\n", j, w.relay, w.key, de.status.Load(), de.last.Load())
	}
}

// waitReady waits, at most bound, until every Envoy has its first config
// (/ready LIVE).
func (d *demoEnvoys) waitReady(bound time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	for _, de := range d.envoys {
		if de.e.WaitReady(ctx) != nil {
			return
		}
	}
}

// final writes each Envoy's line once more, from the tier's ledger asked
// now and a request sent now.
func (d *demoEnvoys) final(out io.Writer, tier *cluster.Tier) {
	if running := tier.Running(); len(running) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		d.observe(running[0].Node.Relay().TierLedger(ctx, ledger.Scope{}, ledger.Brief).Report)
		cancel()
	}
	client := &http.Client{Timeout: 5 * time.Second}
	for _, de := range d.envoys {
		de.last.Store(get(context.Background(), client, de.listen))
	}
	fmt.Fprintln(out, "real Envoys at the end:")
	d.print(out, tier)
}

// summary says how the requests went.
func (d *demoEnvoys) summary(out io.Writer) {
	var ok, sent int64
	for _, de := range d.envoys {
		ok, sent = ok+de.ok.Load(), sent+de.sent.Load()
	}
	fmt.Fprintf(out, "real Envoys: %d; %d of %d requests through them answered 200\n", len(d.envoys), ok, sent)
}

// stop ends the requests, then stops the Envoys and the backend.
func (d *demoEnvoys) stop() {
	if d.cancel != nil {
		d.cancel()
	}
	d.wg.Wait()
	es := make([]*realenvoy.Envoy, len(d.envoys))
	for i, de := range d.envoys {
		es[i] = de.e
	}
	realenvoy.StopAll(es)
	if d.backend != nil {
		d.backend.Close()
	}
	if d.dir != "" {
		os.RemoveAll(d.dir)
	}
}
