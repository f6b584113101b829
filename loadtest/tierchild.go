package loadtest

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/shard"
)

// TierRelayChildConfig is one relay of a tier whose relays each run in a
// process of their own (`loadtest tier-relay-child`): a shard.Node, as
// `meshrelay serve` runs it, gossiping with the others over loopback UDP
// and TCP and owning its share of the keys, with its ledger sampled for
// the parent (see RunTierRelayChild).
type TierRelayChildConfig struct {
	// ID is the relay's name. Required.
	ID string `json:"id"`
	// Upstream is the upstream's gRPC target. Required.
	Upstream string `json:"upstream"`
	// UpstreamProtocol is the ADS variant spoken upstream. Default delta.
	UpstreamProtocol relay.Protocol `json:"upstream_protocol,omitempty"`
	// Gossip is the loopback host:port the relay gossips on (TCP and
	// UDP). Required.
	Gossip string `json:"gossip"`
	// Join lists the other relays' Gossip addresses (those not up yet are
	// joined by the periodic rejoin, every 2 s).
	Join []string `json:"join,omitempty"`
	// CPUs, if set, pins the child (ChildConfig.CPUs); it is how the
	// parent starts it, not something the child reads.
	CPUs CPUSet `json:"-"`
}

// The commands a parent sends a tier relay child, one a line, and the
// prefixes of their answers. Ledger samples come on lines of their own
// (ledgerVersionLine, ledgerACKLine) between answers.
const (
	// tierStats answers "stats <TierRelayStats as JSON>".
	tierStats = "stats"
	// tierConvergence gathers the tier's ledger from this relay (as
	// `relayctl` would) and answers "tier <TierConvergence as JSON>".
	tierConvergence = "tier"
	// tierLedgerOn starts the ledger sampler every interval (a Go
	// duration), answering "ledger on"; tierLedgerOff polls once more,
	// stops it, and answers "ledger off <LedgerSamplerStats as JSON>".
	tierLedgerOn  = "ledger on"
	tierLedgerOff = "ledger off"
	// tierHeap collects garbage and answers "heap <bytes>", the live heap
	// (runtime.MemStats.HeapAlloc): what the relay holds, where RSS also
	// counts what the collector has not yet freed or returned.
	tierHeap = "heap"
	// childProfileStart PATH and childProfileStop (fanout's relay child's
	// commands) write a CPU profile; they are not answered.
)

// Ledger sample lines: a key's view of a type became root
// ("V <key> <type> <root> <received unix ns> <1 if this relay is the
// key's origin, else 0>"), and an Envoy's ACKed view of a type became root
// ("A <key> <node> <type> <root> <acked unix ns>"). Roots are the first 8
// bytes of the Merkle root, in hex; types the last part of their type URL.
const (
	ledgerVersionLine = "V"
	ledgerACKLine     = "A"
)

// TierRelayStats is what a tier relay child reports of itself.
type TierRelayStats struct {
	ID    string `json:"id"`
	Ready bool   `json:"ready"`
	// Members is how many live relays its ring holds, itself included.
	Members int `json:"members"`
	// Stats are the relay's own figures (relay.Relay.Stats).
	Stats relay.Stats `json:"stats"`
	// Converged is meshrelay_proxy_convergence_time_seconds, every type
	// summed: the ledger's upstream receipt → Envoy ACK, as the relay
	// exports it.
	Converged Histogram `json:"converged"`
}

// Histogram is a Prometheus histogram: cumulative counts by upper bound.
type Histogram struct {
	Bounds     []float64 `json:"bounds_s"`
	Cumulative []uint64  `json:"cumulative"`
	Count      uint64    `json:"count"`
	SumS       float64   `json:"sum_s"`
}

// Sub returns h - prev: what was observed between them.
func (h Histogram) Sub(prev Histogram) Histogram {
	out := Histogram{Bounds: h.Bounds, Cumulative: make([]uint64, len(h.Cumulative)), Count: h.Count - prev.Count, SumS: h.SumS - prev.SumS}
	for i := range h.Cumulative {
		out.Cumulative[i] = h.Cumulative[i]
		if i < len(prev.Cumulative) {
			out.Cumulative[i] -= prev.Cumulative[i]
		}
	}
	return out
}

// Add returns h + o (same bounds).
func (h Histogram) Add(o Histogram) Histogram {
	if len(h.Bounds) == 0 {
		return o
	}
	out := Histogram{Bounds: h.Bounds, Cumulative: make([]uint64, len(h.Cumulative)), Count: h.Count + o.Count, SumS: h.SumS + o.SumS}
	for i := range h.Cumulative {
		out.Cumulative[i] = h.Cumulative[i]
		if i < len(o.Cumulative) {
			out.Cumulative[i] += o.Cumulative[i]
		}
	}
	return out
}

// ShareWithin is the share of observations ≤ bound (which must be one of
// Bounds; otherwise the nearest bound below it), and that bound.
func (h Histogram) ShareWithin(bound float64) (share, at float64) {
	if h.Count == 0 {
		return 1, bound
	}
	var n uint64
	for i, b := range h.Bounds {
		if b > bound*(1+1e-9) {
			break
		}
		n, at = h.Cumulative[i], b
	}
	return float64(n) / float64(h.Count), at
}

// Quantile returns the bucket that holds quantile q: its lower and upper
// bounds (upper +Inf past the last bound). It is all a histogram can say.
func (h Histogram) Quantile(q float64) (lo, hi float64) {
	if h.Count == 0 {
		return 0, 0
	}
	rank := q * float64(h.Count)
	for i, b := range h.Bounds {
		if float64(h.Cumulative[i]) >= rank {
			if i > 0 {
				lo = h.Bounds[i-1]
			}
			return lo, b
		}
	}
	if n := len(h.Bounds); n > 0 {
		lo = h.Bounds[n-1]
	}
	return lo, float64(1<<63 - 1)
}

// TierConvergence is the tier's ledger as one relay gathered it.
type TierConvergence struct {
	Envoys     int `json:"envoys"`
	Current    int `json:"current"`
	Stragglers int `json:"stragglers"`
	// Missing counts relays that did not answer the gather.
	Missing int    `json:"missing"`
	Err     string `json:"error,omitempty"`
}

// LedgerSamplerStats is what sampling the ledger cost a relay.
type LedgerSamplerStats struct {
	Polls int `json:"polls"`
	// CPUS is the CPU time of the sampler's thread (locked to it), from
	// /proc/thread-self/stat, 10 ms ticks; -1 if unknown.
	CPUS float64 `json:"cpu_s"`
	// Lines is how many sample lines it wrote.
	Lines int `json:"lines"`
}

// convergedMetric is the relay's histogram of upstream receipt → Envoy ACK.
const convergedMetric = "meshrelay_proxy_convergence_time_seconds"

// RunTierRelayChild is the main of a tier relay child process: it starts
// a shard.Node for cfg (a relay with `meshrelay serve`'s defaults but for
// loopback listeners and a 2 s rejoin), prints "xds <addr>" on out once
// the relay listens, answers the commands read from in (tierStats and the
// others), and stops the node (leaving the ring, draining for 2 s) when
// ctx ends or in reaches EOF. Relay warnings go to logw. Call it only as a
// process's main.
func RunTierRelayChild(ctx context.Context, cfg TierRelayChildConfig, in io.Reader, out, logw io.Writer) error {
	if cfg.ID == "" || cfg.Upstream == "" || cfg.Gossip == "" {
		return errors.New("loadtest: tier relay child: fields ID, Upstream and Gossip are required")
	}
	rcfg := relay.DefaultConfig()
	rcfg.ID, rcfg.Upstream.Addr, rcfg.XDS.Listen, rcfg.Admin.Listen = cfg.ID, cfg.Upstream, "127.0.0.1:0", ""
	if cfg.UpstreamProtocol != "" {
		rcfg.Upstream.Protocol = cfg.UpstreamProtocol
	}
	rcfg.Logger = slog.New(slog.NewTextHandler(logw, &slog.HandlerOptions{Level: slog.LevelWarn})).With("relay", cfg.ID)
	reg := prometheus.NewRegistry()
	rcfg.Registerer, rcfg.Gatherer = reg, reg
	ring := shard.DefaultConfig()
	ring.Logger, ring.Join, ring.RejoinInterval = rcfg.Logger, cfg.Join, 2*time.Second
	host, port, err := net.SplitHostPort(cfg.Gossip)
	if err != nil {
		return fmt.Errorf("loadtest: tier relay child: gossip address: %w", err)
	}
	if ring.BindPort, err = strconv.Atoi(port); err != nil {
		return fmt.Errorf("loadtest: tier relay child: gossip port: %w", err)
	}
	ring.BindAddr = host
	node, err := shard.NewNode(shard.NodeConfig{Relay: rcfg, Ring: &ring, DrainPeriod: 2 * time.Second})
	if err != nil {
		return err
	}
	if err := node.Start(ctx); err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := node.Stop(sctx); err != nil {
			fmt.Fprintf(logw, "tier relay child %s: stop: %v\n", cfg.ID, err)
		}
	}()
	r := node.Relay()
	w := &lineWriter{w: bufio.NewWriter(out)}
	if err := w.print(readyPrefix + r.Addr().String()); err != nil {
		return fmt.Errorf("loadtest: report address: %w", err)
	}

	cmds, eof := readCommands(ctx, in)
	var stopProf func() error // of the CPU profile running, if one is
	stopProfile := func() {
		if stopProf != nil {
			if err := stopProf(); err != nil {
				fmt.Fprintf(logw, "tier relay child %s: cpuprofile: %v\n", cfg.ID, err)
			}
			stopProf = nil
		}
	}
	defer stopProfile()
	var sampler *ledgerSampler
	defer func() {
		if sampler != nil {
			sampler.stop()
		}
	}()
	for {
		var c string
		select {
		case <-ctx.Done():
			return nil
		case <-eof:
			return nil
		case c = <-cmds:
		}
		switch {
		case c == tierStats:
			st := TierRelayStats{ID: cfg.ID, Ready: r.Ready(), Members: len(node.Ring().Members()), Stats: r.Stats()}
			st.Converged, err = gatherHistogram(reg, convergedMetric)
			if err != nil {
				fmt.Fprintf(logw, "tier relay child %s: %v\n", cfg.ID, err)
			}
			err = w.printJSON(tierStats, st)
		case c == tierConvergence:
			gctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			tl := r.TierLedger(gctx, ledger.Scope{}, ledger.Brief)
			cancel()
			conv := tl.Convergence()
			tc := TierConvergence{Envoys: conv.Envoys, Current: conv.Current, Stragglers: len(tl.Stragglers(0)), Missing: len(tl.Missing)}
			for addr, err := range tl.Missing {
				tc.Err = fmt.Sprintf("%s: %v", addr, err)
			}
			err = w.printJSON(tierConvergence, tc)
		case strings.HasPrefix(c, tierLedgerOn):
			every, perr := time.ParseDuration(strings.TrimSpace(strings.TrimPrefix(c, tierLedgerOn)))
			if perr != nil || every <= 0 {
				every = 20 * time.Millisecond
			}
			if sampler == nil {
				sampler = startLedgerSampler(r.Ledger(), every, w)
			}
			err = w.print(tierLedgerOn)
		case c == tierHeap:
			err = w.print(fmt.Sprintf("%s %d", tierHeap, liveHeap()))
		case strings.HasPrefix(c, childProfileStart+" "):
			// No answer: a profile is best effort, and says so on logw.
			if stopProf == nil {
				if stopProf, err = ProfileCPU(strings.TrimPrefix(c, childProfileStart+" ")); err != nil {
					fmt.Fprintf(logw, "tier relay child %s: cpuprofile: %v\n", cfg.ID, err)
					err = nil
				}
			}
		case c == childProfileStop:
			stopProfile()
		case c == tierLedgerOff:
			var st LedgerSamplerStats
			if sampler != nil {
				st = sampler.stop()
				sampler = nil
			}
			err = w.printJSON(tierLedgerOff, st)
		default:
			fmt.Fprintf(logw, "tier relay child %s: unknown command %q\n", cfg.ID, c)
		}
		if err != nil {
			return fmt.Errorf("loadtest: tier relay child: answer: %w", err)
		}
	}
}

// lineWriter writes whole lines to a child's stdout from several
// goroutines.
type lineWriter struct {
	mu sync.Mutex
	w  *bufio.Writer
}

func (l *lineWriter) print(line string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.w.WriteString(line)
	l.w.WriteByte('\n')
	return l.w.Flush()
}

func (l *lineWriter) printJSON(prefix string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return l.print(prefix + " " + string(b))
}

// gatherHistogram sums the histogram name over its labels.
func gatherHistogram(g prometheus.Gatherer, name string) (Histogram, error) {
	mfs, err := g.Gather()
	if err != nil {
		return Histogram{}, fmt.Errorf("gather metrics: %w", err)
	}
	var h Histogram
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			ph := m.GetHistogram()
			one := Histogram{Count: ph.GetSampleCount(), SumS: ph.GetSampleSum()}
			for _, b := range ph.GetBucket() {
				one.Bounds = append(one.Bounds, b.GetUpperBound())
				one.Cumulative = append(one.Cumulative, b.GetCumulativeCount())
			}
			h = h.Add(one)
		}
	}
	return h, nil
}

// ledgerSampler reads its relay's ledger every interval and writes what
// changed since the last read as sample lines: each key's current view of
// each type, and each Envoy's ACKed view of each type. What the ledger
// recorded between two reads and replaced before the second (a version
// current for less than the interval, two ACKs of one Envoy within it) is
// not seen; the parent counts what it resolves against the relays' own
// histogram.
type ledgerSampler struct {
	tr    *ledger.Tracker
	every time.Duration
	w     *lineWriter

	cancel context.CancelFunc
	done   chan LedgerSamplerStats
}

type sampleKey struct{ who, typeURL string }

type sampleState struct {
	root ledger.Hash
	at   time.Time
}

func startLedgerSampler(tr *ledger.Tracker, every time.Duration, w *lineWriter) *ledgerSampler {
	ctx, cancel := context.WithCancel(context.Background())
	s := &ledgerSampler{tr: tr, every: every, w: w, cancel: cancel, done: make(chan LedgerSamplerStats, 1)}
	go s.run(ctx)
	return s
}

// stop polls a last time, ends the sampler and returns what it cost.
func (s *ledgerSampler) stop() LedgerSamplerStats {
	s.cancel()
	return <-s.done
}

func (s *ledgerSampler) run(ctx context.Context) {
	// One thread, so that its CPU time is the sampler's own.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cpu0, cpuErr := threadCPU()
	versions := map[sampleKey]ledger.Hash{}
	acks := map[sampleKey]sampleState{}
	var st LedgerSamplerStats
	var buf strings.Builder
	poll := func() {
		buf.Reset()
		sum := s.tr.Summary(ledger.Scope{}, time.Now(), ledger.Full) // every ACK time
		st.Polls++
		for _, ks := range sum.Keys {
			origin := "0"
			if ks.Origin() {
				origin = "1"
			}
			for _, tv := range ks.Types {
				k := sampleKey{ks.Key, tv.Type}
				if tv.Version.Root.IsZero() || versions[k] == tv.Version.Root {
					continue
				}
				versions[k] = tv.Version.Root
				fmt.Fprintf(&buf, "%s %s %s %s %d %s\n", ledgerVersionLine, ks.Key, shortType(tv.Type),
					shortRoot(tv.Version.Root), tv.Version.Received.UnixNano(), origin)
				st.Lines++
			}
			for _, es := range ks.Envoys {
				for _, et := range es.Types {
					if et.Acked.IsZero() {
						continue
					}
					k := sampleKey{es.Node, et.Type}
					if prev, ok := acks[k]; ok && prev.root == et.Acked && prev.at.Equal(et.AckedAt) {
						continue
					}
					acks[k] = sampleState{et.Acked, et.AckedAt}
					fmt.Fprintf(&buf, "%s %s %s %s %s %d\n", ledgerACKLine, ks.Key, es.Node, shortType(et.Type),
						shortRoot(et.Acked), et.AckedAt.UnixNano())
					st.Lines++
				}
			}
		}
		if buf.Len() > 0 {
			_ = s.w.print(strings.TrimSuffix(buf.String(), "\n"))
		}
	}
	t := time.NewTicker(s.every)
	defer t.Stop()
	for {
		poll()
		select {
		case <-ctx.Done():
			poll() // what the last interval recorded
			st.CPUS = -1
			if cpu1, err := threadCPU(); err == nil && cpuErr == nil {
				st.CPUS = (cpu1 - cpu0).Seconds()
			}
			s.done <- st
			return
		case <-t.C:
		}
	}
}

// liveHeap collects garbage, returns what is freed to the OS, and
// returns the live heap in bytes.
func liveHeap() uint64 {
	debug.FreeOSMemory() // a collection, then the scavenger
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// threadCPU is the calling thread's user and system time.
func threadCPU() (time.Duration, error) {
	b, err := os.ReadFile("/proc/thread-self/stat")
	if err != nil {
		return 0, err
	}
	return parseProcStat(b)
}

// shortType is the last part of a type URL ("ClusterLoadAssignment").
func shortType(typeURL string) string {
	if i := strings.LastIndexByte(typeURL, '.'); i >= 0 {
		return typeURL[i+1:]
	}
	return typeURL
}

// shortRoot is the first 8 bytes of a root, in hex: enough to tell a
// key's versions apart.
func shortRoot(h ledger.Hash) string { return hex.EncodeToString(h[:8]) }

// StartTierRelayFunc starts a tier relay child for cfg; onLine receives
// every line it prints but its ready line. The caller must Stop it.
type StartTierRelayFunc func(ctx context.Context, cfg TierRelayChildConfig, onLine func(string)) (*Child, error)

// ExecTierRelay returns a StartTierRelayFunc that runs path with args
// followed by "--config" and the config as JSON; cmd/loadtest passes its
// own executable and "tier-relay-child". The child's stderr goes to
// stderr (nil: discarded).
func ExecTierRelay(path string, stderr io.Writer, args ...string) StartTierRelayFunc {
	return func(ctx context.Context, cfg TierRelayChildConfig, onLine func(string)) (*Child, error) {
		b, err := json.Marshal(cfg)
		if err != nil {
			return nil, err
		}
		return StartChild(ctx, ChildConfig{
			Path:   path,
			Args:   append(append([]string(nil), args...), "--config", string(b)),
			Stderr: stderr,
			CPUs:   cfg.CPUs,
			OnLine: onLine,
		})
	}
}

// freeLoopbackPort returns a port free on 127.0.0.1 for both TCP and UDP
// now (gossip listens on both): another process may take it before its
// user does, which then fails to start and says so.
func freeLoopbackPort() (int, error) {
	for range 20 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		u, err := net.ListenPacket("udp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		l.Close()
		if err == nil {
			u.Close()
			return port, nil
		}
	}
	return 0, errors.New("loadtest: no port free for both TCP and UDP on 127.0.0.1")
}
