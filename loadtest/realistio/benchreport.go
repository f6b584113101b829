package realistio

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/meshrelay/meshrelay/loadtest"
)

// sampler samples, during a full sync, the resident size of istiod and
// of the relays (every 250 ms) and istiod's count of xDS streams (every
// second: istiod renders its metrics for it).
type sampler struct {
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once

	// Written by the sampling goroutine, read after done is closed.
	istiodRSS, relaysRSS uint64
	streamsMax           int
}

func startSampler(ctx context.Context, b *bench) *sampler {
	ctx, cancel := context.WithCancel(ctx)
	s := &sampler{cancel: cancel, done: make(chan struct{})}
	pids := b.pids()
	rss := make([]uint64, len(pids))
	go func() {
		defer close(s.done)
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for n := 0; ; n++ {
			for i, pid := range pids {
				if st, err := loadtest.ReadProcStat(pid); err == nil {
					rss[i] = max(rss[i], st.RSS)
				}
			}
			if n%4 == 0 {
				if v, err := b.istiodStreams(ctx); err == nil {
					s.streamsMax = max(s.streamsMax, v)
				}
			}
			select {
			case <-ctx.Done():
				s.istiodRSS = rss[0]
				for _, r := range rss[1:] {
					s.relaysRSS += r
				}
				return
			case <-tick.C:
			}
		}
	}()
	return s
}

// stop ends the sampling (idempotent) and returns istiod's largest RSS,
// the sum of each relay's largest, and the most streams istiod counted.
func (s *sampler) stop() (istiodRSS, relaysRSS uint64, streamsMax int) {
	s.once.Do(s.cancel)
	<-s.done
	return s.istiodRSS, s.relaysRSS, s.streamsMax
}

// scrape reads a Prometheus text page at url and returns the sum of
// metric's samples (those whose line contains label, if set).
func scrape(ctx context.Context, url, metric, label string) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return sumMetric(resp.Body, metric, label)
}

// sumMetric sums the samples of metric in a Prometheus text exposition
// (those whose line contains label, if set); none is 0.
func sumMetric(r io.Reader, metric, label string) (float64, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	sum := 0.0
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, metric)
		if !ok || (!strings.HasPrefix(rest, "{") && !strings.HasPrefix(rest, " ")) {
			continue
		}
		if label != "" && !strings.Contains(rest, label) {
			continue
		}
		f := strings.Fields(rest[strings.LastIndexByte(rest, '}')+1:])
		if len(f) == 0 {
			return 0, fmt.Errorf("%s: no value in %q", metric, line)
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", metric, err)
		}
		sum += v
	}
	return sum, sc.Err()
}

// PrintBench writes r as a table: the direct and the relayed run side by
// side, and their ratio.
func PrintBench(w io.Writer, r *BenchResult) {
	fmt.Fprintf(w, "loadtest istio: %d sidecars (%s) of %d workloads, %d ServiceEntries + %d WorkloadEntries; tier of %d relays (%s to istiod)\n",
		r.Sidecars, r.Protocol, r.Workloads, r.Services, r.Services, r.Relays, r.UpstreamProtocol)
	fmt.Fprintf(w, "setup: objects created in %v; istiod served them all %v later; istiod idle: %.2f s CPU in %v\n\n",
		r.Create.Round(time.Millisecond), r.Served.Round(time.Millisecond), r.IstiodIdleCPU.Seconds(), r.IdleWindow)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "run\tsidecars synced\tservices\tkeys\tistiod streams (synced/max/end)\tfull sync wall\tsync P50\tistiod CPU s (synced/quiet)\trelays CPU s (synced/quiet)\tcontrol-plane CPU s\tquiet after\tistiod RSS max\trelays RSS max\tedit→all P50/P99/max\t")
	for _, run := range []struct {
		name string
		r    BenchRun
	}{{"direct", r.Direct}, {"relayed", r.Relayed}} {
		x := run.r
		fmt.Fprintf(tw, "%s\t%d/%d\t%d\t%d\t%d/%d/%d\t%s\t%s\t%.2f/%.2f\t%.2f/%.2f\t%.2f\t%s\t%s\t%s\t%s/%s/%s\t\n",
			run.name, x.Synced, r.Sidecars, r.Services, r.Workloads, x.IstiodStreams, x.IstiodStreamsMax, x.IstiodStreamsEnd,
			secs(x.Sync.Max), secs(x.Sync.P50), x.IstiodCPU.Seconds(), x.IstiodCPUQuiet.Seconds(), x.RelaysCPU.Seconds(), x.RelaysCPUQuiet.Seconds(),
			x.ControlPlaneCPU().Seconds(), secs(x.QuietAfter), mib(x.IstiodRSS), mib(x.RelaysRSS), secs(x.Change.P50), secs(x.Change.P99), secs(x.Change.Max))
	}
	tw.Flush()
	d, rl := r.Direct, r.Relayed
	fmt.Fprintf(w, "\ndirect/relayed: control-plane CPU %s (at the last sidecar's sync: %s), istiod CPU %s, full-sync wall %s\n",
		ratio(d.ControlPlaneCPU(), rl.ControlPlaneCPU()), ratio(d.IstiodCPU+d.RelaysCPU, rl.IstiodCPU+rl.RelaysCPU),
		ratio(d.IstiodCPUQuiet, rl.IstiodCPUQuiet), ratio(d.Sync.Max, rl.Sync.Max))
	fmt.Fprintf(w, "istiod sent %d CDS responses during the direct sync, %d during the relayed one\n", d.IstiodCDSPushes, rl.IstiodCDSPushes)
	fmt.Fprintf(w, "relays at sync: %d keys owned; their streams to istiod: %d keys', %d divergence checks', %d passthrough; divergence checks finished: %d by the sync, %d by quiet\n",
		rl.Keys, rl.RelayStreams.Keys, rl.RelayStreams.DivergenceChecks, rl.RelayStreams.Passthrough, rl.DivergenceChecks, rl.DivergenceChecksQuiet)
	for _, run := range []struct {
		name string
		r    BenchRun
	}{{"direct", d}, {"relayed", rl}} {
		x := run.r
		fmt.Fprintf(w, "%s edit: the added cluster at P50 %s, P99 %s, max %s; its endpoints too at P50 %s, P99 %s, max %s; edit CPU: istiod %.2f s, relays %.2f s\n",
			run.name, secs(x.ChangeCluster.P50), secs(x.ChangeCluster.P99), secs(x.ChangeCluster.Max),
			secs(x.Change.P50), secs(x.Change.P99), secs(x.Change.Max), x.ChangeIstiodCPU.Seconds(), x.ChangeRelaysCPU.Seconds())
	}
	for _, run := range []struct {
		name string
		r    BenchRun
	}{{"direct", d}, {"relayed", rl}} {
		x := run.r
		fmt.Fprintf(w, "%s sidecars: %.1f MiB in %d responses until synced (%.1f MiB, %d by the end), %d streams reopened, %.2f s CPU of this process during the sync, %d protocol violations\n",
			run.name, float64(x.SyncBytes)/(1<<20), x.SyncResponses, float64(x.Bytes)/(1<<20), x.Responses, x.Reconnects, x.SidecarsCPU.Seconds(), x.Violations)
		for _, v := range x.ViolationSamples {
			fmt.Fprintf(w, "  %s\n", v)
		}
	}
}

func secs(d time.Duration) string {
	if d == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fs", d.Seconds())
}

func mib(b uint64) string {
	if b == 0 {
		return "-"
	}
	return fmt.Sprintf("%.0fMiB", float64(b)/(1<<20))
}

func ratio(a, b time.Duration) string {
	if b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f×", a.Seconds()/b.Seconds())
}
