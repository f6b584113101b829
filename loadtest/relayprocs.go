package loadtest

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/relay"
)

// RelayProcsConfig describes a tier of `meshrelay serve` processes on one
// machine: relay i listens on Host(i) (xDS :15010, admin :15014, gossip
// :7946), joins the others' gossip, and sits behind one Service that
// sends new connections to the ready ones, as Kubernetes would.
type RelayProcsConfig struct {
	// Meshrelay is the meshrelay binary. Required.
	Meshrelay string
	// Relays is the number of relay slots. Required.
	Relays int
	// Host returns relay i's loopback address (each relay its own, so
	// the fixed ports do not collide and faults can tell them apart).
	// Required.
	Host func(i int) string
	// Upstream is the upstream's address, spoken to in UpstreamProtocol
	// (default Delta).
	Upstream         string
	UpstreamProtocol relay.Protocol
	// Etcd lists an external etcd's client URLs for snapshots; empty:
	// none, the relays start cold.
	Etcd []string
	// LogLevel is each relay's --log-level. Default info.
	LogLevel string
	// Dir is the relays' working directory.
	Dir string
	// Log returns where relay i's stderr goes; nil: discarded.
	Log func(i int) io.Writer
	// User, if set, returns the user relay i runs as (root only).
	User func(i int) *ChildUser
	// Exited, if set, is called when a relay exits without being told
	// to: a process failure the run should report.
	Exited func(i int)
}

// RelayProcs is a tier of `meshrelay serve` processes (RelayProcsConfig):
// the real binaries a cluster.Cluster scenario drives end to end, and the
// relays of the chaos suite.
type RelayProcs struct {
	cfg  RelayProcsConfig
	svc  *cluster.Service
	stop context.CancelFunc
	wg   sync.WaitGroup

	mu     sync.Mutex
	relays []*Child // nil while down
	ready  []bool
}

var _ cluster.Cluster = (*RelayProcs)(nil)

// StartRelayProcs starts every relay and the Service in front of them, and
// polls each relay's /readyz every 200 ms, as a Kubernetes readiness probe
// does, until Stop. It does not wait for the relays to be ready.
func StartRelayProcs(ctx context.Context, cfg RelayProcsConfig) (*RelayProcs, error) {
	if cfg.Meshrelay == "" || cfg.Relays < 1 || cfg.Host == nil {
		return nil, fmt.Errorf("loadtest: relay processes need Meshrelay, Relays and Host")
	}
	if cfg.LogLevel == "" {
		cfg.LogLevel = "info"
	}
	if cfg.UpstreamProtocol == "" {
		cfg.UpstreamProtocol = relay.ProtocolDelta
	}
	p := &RelayProcs{cfg: cfg, relays: make([]*Child, cfg.Relays), ready: make([]bool, cfg.Relays)}
	for i := range cfg.Relays {
		if err := p.Start(ctx, i); err != nil {
			p.Stop(ctx)
			return nil, err
		}
	}
	var err error
	if p.svc, err = cluster.NewService(p.readyAddrs); err != nil {
		p.Stop(ctx)
		return nil, err
	}
	pollCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	p.stop = cancel
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.pollReady(pollCtx)
	}()
	return p, nil
}

// Addr is the Service's address.
func (p *RelayProcs) Addr() string { return p.svc.Addr() }

// Slots is the number of relay slots.
func (p *RelayProcs) Slots() int { return p.cfg.Relays }

// Ready reports whether relay i runs and its last /readyz answered 200.
func (p *RelayProcs) Ready(i int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ready[i]
}

// ReadyN counts the ready relays.
func (p *RelayProcs) ReadyN() int { return len(p.readyAddrs()) }

// Child returns relay i's process, nil while it is down.
func (p *RelayProcs) Child(i int) *Child {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.relays[i]
}

// Start starts relay i. It does not wait until the relay is ready.
func (p *RelayProcs) Start(ctx context.Context, i int) error {
	var join []string
	for j := range p.cfg.Relays {
		if j != i {
			join = append(join, p.cfg.Host(j)+":7946")
		}
	}
	host := p.cfg.Host(i)
	args := []string{"serve", "--id", fmt.Sprintf("relay-%d", i),
		"--xds-listen", host + ":15010", "--admin-listen", host + ":15014", "--gossip-listen", host + ":7946",
		"--join", strings.Join(join, ","), "--rejoin-interval", "2s", "--drain-period", "2s",
		"--upstream", p.cfg.Upstream, "--upstream-protocol", string(p.cfg.UpstreamProtocol),
		"--log-level", p.cfg.LogLevel}
	if len(p.cfg.Etcd) > 0 {
		args = append(args, "--etcd-endpoints", strings.Join(p.cfg.Etcd, ","))
	}
	cc := ChildConfig{Path: p.cfg.Meshrelay, Args: args, Addr: host + ":15010", Dir: p.cfg.Dir, ReadyTimeout: 2 * time.Minute}
	if p.cfg.Log != nil {
		cc.Stderr = p.cfg.Log(i)
		fmt.Fprintf(cc.Stderr, "=== start relay-%d at %s\n", i, time.Now().Format(time.RFC3339Nano))
	}
	if p.cfg.User != nil {
		cc.User = p.cfg.User(i)
	}
	child, err := StartChild(ctx, cc)
	if err != nil {
		return fmt.Errorf("relay-%d: %w", i, err)
	}
	p.mu.Lock()
	p.relays[i] = child
	p.mu.Unlock()
	return nil
}

// take marks relay i down and returns its process (nil if it was down).
func (p *RelayProcs) take(i int) *Child {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.relays[i]
	p.relays[i], p.ready[i] = nil, false
	return c
}

// StopRelay stops relay i: with SIGTERM, killed if it has not exited
// within 30 s (graceful), or with SIGKILL.
func (p *RelayProcs) StopRelay(ctx context.Context, i int, graceful bool) error {
	c := p.take(i)
	if c == nil {
		return nil
	}
	if !graceful {
		c.Kill()
		return nil
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := c.Stop(sctx); err != nil {
		return fmt.Errorf("relay-%d on SIGTERM: %w", i, err)
	}
	return nil
}

// Stop kills every relay and closes the Service. It is safe on a
// half-started tier.
func (p *RelayProcs) Stop(context.Context) {
	if p.stop != nil {
		p.stop()
		p.wg.Wait()
	}
	if p.svc != nil {
		p.svc.Close()
	}
	for i := range p.cfg.Relays {
		if c := p.take(i); c != nil {
			c.Kill()
		}
	}
}

// pollReady asks every running relay's /readyz every 200 ms until ctx
// ends; it notes relays that exited on their own.
func (p *RelayProcs) pollReady(ctx context.Context) {
	client := &http.Client{Timeout: 500 * time.Millisecond}
	for traffic.SleepCtx(ctx, 200*time.Millisecond) {
		for i := range p.cfg.Relays {
			c := p.Child(i)
			ok := false
			if c != nil {
				select {
				case <-c.Exited():
					p.mu.Lock()
					mine := p.relays[i] == c // not stopped or restarted meanwhile
					if mine {
						p.relays[i], p.ready[i] = nil, false
					}
					p.mu.Unlock()
					if mine && p.cfg.Exited != nil {
						p.cfg.Exited(i)
					}
					continue
				default:
				}
				resp, err := client.Get("http://" + p.cfg.Host(i) + ":15014/readyz")
				if err == nil {
					ok = resp.StatusCode == http.StatusOK
					resp.Body.Close()
				}
			}
			p.mu.Lock()
			if p.relays[i] == c {
				p.ready[i] = ok
			}
			p.mu.Unlock()
		}
	}
}

// readyAddrs lists the ready relays' xDS addresses: the Service's endpoints.
func (p *RelayProcs) readyAddrs() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for i, ok := range p.ready {
		if ok {
			out = append(out, p.cfg.Host(i)+":15010")
		}
	}
	return out
}
