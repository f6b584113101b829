package loadtest

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/traffic"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// FleetChildConfig is the fleet a fleet child process runs (`loadtest
// fleet-child`): the part of FleetConfig that crosses a process boundary.
// It travels as JSON and holds no secret: a TLS fleet's tokens stay in a
// file.
type FleetChildConfig struct {
	Scenario upstream.Scenario `json:"scenario"`
	// Envoys, Keys, EnvoysPerConn, StartRate and MaxMsgSize are
	// FleetConfig's, with its defaults.
	Envoys        int     `json:"envoys"`
	Keys          int     `json:"keys"`
	EnvoysPerConn int     `json:"envoys_per_conn,omitempty"`
	StartRate     float64 `json:"start_rate,omitempty"`
	MaxMsgSize    int     `json:"max_msg_size,omitempty"`
	// Protocol is the Envoys' ADS variant: "delta" or "sotw".
	Protocol string `json:"protocol"`
	// Target is the gRPC address the Envoys connect to; Targets, if set,
	// replaces it (FleetConfig's). One of them is required.
	Target  string   `json:"target,omitempty"`
	Targets []string `json:"targets,omitempty"`
	// Light and MaxSyncing are FleetConfig's.
	Light      bool `json:"light,omitempty"`
	MaxSyncing int  `json:"max_syncing,omitempty"`
	// TLS, if set, has every Envoy dial Target with TLS and present its
	// node's service-account token.
	TLS *FleetChildTLS `json:"tls,omitempty"`
}

// FleetChildTLS is how a fleet child's Envoys reach a relay's TLS port:
// the files MeshCredentials.FleetTLS writes.
type FleetChildTLS struct {
	// CAFile holds the PEM root the relay's certificate chains to.
	CAFile string `json:"ca"`
	// TokensFile holds a JSON object mapping "namespace/serviceaccount"
	// to that service account's token (mode 0600). The child reads it and
	// never prints or logs a token.
	TokensFile string `json:"tokens"`
}

// validate checks c and returns its protocol.
func (c FleetChildConfig) validate() (envoy.Protocol, error) {
	if c.Envoys <= 0 || c.Keys <= 0 || (c.Target == "") == (len(c.Targets) == 0) || c.Scenario.Namespaces <= 0 {
		return 0, errors.New("loadtest: fleet child: fields Envoys, Keys, Target or Targets, and the scenario's namespaces are required")
	}
	if c.TLS != nil && len(c.Targets) > 0 {
		return 0, errors.New("loadtest: fleet child: TLS needs one Target, not Targets")
	}
	switch c.Protocol {
	case envoy.Delta.String():
		return envoy.Delta, nil
	case envoy.SotW.String():
		return envoy.SotW, nil
	}
	return 0, fmt.Errorf("loadtest: fleet child: unknown protocol %q (want delta or sotw)", c.Protocol)
}

// fleetConfig is the FleetConfig of c, and the TLS transport its Envoys
// dial through (nil without TLS; close it after the fleet stopped).
func (c FleetChildConfig) fleetConfig() (traffic.FleetConfig, *tlsTransport, error) {
	p, err := c.validate()
	if err != nil {
		return traffic.FleetConfig{}, nil, err
	}
	fc := traffic.FleetConfig{
		Scenario: c.Scenario, Envoys: c.Envoys, Keys: c.Keys, Protocol: p, Target: c.Target, Targets: c.Targets,
		EnvoysPerConn: c.EnvoysPerConn, StartRate: c.StartRate, MaxMsgSize: c.MaxMsgSize,
		Light: c.Light, MaxSyncing: c.MaxSyncing,
	}
	if c.TLS == nil {
		return fc, nil, nil
	}
	pem, err := os.ReadFile(c.TLS.CAFile)
	if err != nil {
		return traffic.FleetConfig{}, nil, fmt.Errorf("loadtest: fleet child: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return traffic.FleetConfig{}, nil, fmt.Errorf("loadtest: fleet child: no certificate in %s", c.TLS.CAFile)
	}
	raw, err := os.ReadFile(c.TLS.TokensFile)
	if err != nil {
		return traffic.FleetConfig{}, nil, fmt.Errorf("loadtest: fleet child: %w", err)
	}
	var tokens map[string]string
	if err := json.Unmarshal(raw, &tokens); err != nil {
		// Not %w: the decoder's error may quote the file.
		return traffic.FleetConfig{}, nil, fmt.Errorf("loadtest: fleet child: %s is not a JSON object of tokens", c.TLS.TokensFile)
	}
	t := newTLSTransportWith(meshClientTLS(pool), func(node *core.Node) (string, error) {
		ns, sa := nodeAccount(node)
		tok, ok := tokens[ns+"/"+sa]
		if !ok {
			return "", fmt.Errorf("loadtest: fleet child: no token for %s/%s in %s", ns, sa, c.TLS.TokensFile)
		}
		return tok, nil
	}, c.Target, c.EnvoysPerConn, c.MaxMsgSize)
	fc.Configure = t.configure
	return fc, t, nil
}

// meshClientTLS is what a simulated Envoy dials a relay's TLS port with:
// the mesh root, the relay's name, no session cache (every connection is
// a full handshake, as a new pod's is).
func meshClientTLS(roots *x509.CertPool) *tls.Config {
	return &tls.Config{RootCAs: roots, ServerName: relayServerName, MinVersion: tls.VersionTLS12}
}

// The commands a parent sends a fleet child on its stdin, one a line, as
// "<seq> <command> [<argument>]"; the child answers each, in order, on its
// stdout with "<seq> ok [<result>]" or "<seq> error <message>".
const (
	// fleetStart starts the fleet (StartFleet: the paced ramp) and
	// answers once every Envoy has started.
	fleetStart = "start"
	// fleetTrack sets the floor of the observation stream: from then on,
	// the names of ACKed and Declared events with a generation above it
	// are sent to the parent.
	fleetTrack = "track"
	// fleetWant sets what WaitSynced waits for: a JSON object mapping
	// each upstream group to the digest (holdings) of its clusters and
	// endpoints. It forgets which Envoys were seen synced.
	fleetWant = "want"
	// fleetSynced answers how many Envoys have been seen holding their
	// group's wanted digest (each is checked until it does once).
	fleetSynced = "synced"
	// fleetStats answers FleetFigures, as JSON.
	fleetStats = "stats"
	// fleetPerEnvoy answers EnvoyCounters, as JSON.
	fleetPerEnvoy = "per-envoy"
	// fleetHeap collects garbage (returning what it frees to the OS) and
	// answers the bytes of live heap (runtime.MemStats.HeapAlloc): what
	// the Envoys hold.
	fleetHeap = "heap"
	// fleetProfile starts a CPU profile to the file named; fleetProfileStop
	// ends it.
	fleetProfile     = "profile"
	fleetProfileStop = "profile-stop"
)

// RunFleetChild is the main of a fleet child process (`loadtest
// fleet-child`): it prints "xds -" on out once it is ready for commands
// (see fleetStart and the others), obeys the ones read from in, streams
// its Envoys' observations to obs (see readObservations), and stops its
// fleet when ctx ends (SIGTERM) or in reaches EOF (the parent is gone).
// It returns once its Envoys have stopped; a goroutine reading in may
// remain until in is closed, so call it only as a process's main.
func RunFleetChild(ctx context.Context, cfg FleetChildConfig, in io.Reader, out, obs io.Writer) error {
	fcfg, tlsConns, err := cfg.fleetConfig()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	cmds := make(chan string)
	go func() {
		defer cancel() // EOF: the parent stopped us, or died
		sc := bufio.NewScanner(in)
		sc.Buffer(make([]byte, 0, 64<<10), maxChildLine)
		for sc.Scan() {
			select {
			case cmds <- sc.Text():
			case <-ctx.Done():
				return
			}
		}
	}()
	c := &fleetChild{cfg: fcfg, tls: tlsConns, stream: newObsWriter(obs)}
	c.cfg.OnEvent = c.stream.event
	defer c.stop()
	if _, err := fmt.Fprintf(out, "%s-\n", readyPrefix); err != nil {
		return fmt.Errorf("loadtest: fleet child: report ready: %w", err)
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case line := <-cmds:
			seq, rest, _ := strings.Cut(line, " ")
			cmd, arg, _ := strings.Cut(rest, " ")
			result, err := c.do(ctx, cmd, arg)
			if err != nil {
				// One line, whatever the error says.
				result = "error " + strings.ReplaceAll(err.Error(), "\n", "; ")
			} else {
				result = strings.TrimSuffix("ok "+result, " ")
			}
			if _, err := fmt.Fprintf(out, "%s %s\n", seq, result); err != nil {
				return fmt.Errorf("loadtest: fleet child: answer: %w", err)
			}
		}
	}
}

// fleetChild is the state of RunFleetChild; only its main loop uses it.
type fleetChild struct {
	cfg    traffic.FleetConfig
	tls    *tlsTransport
	stream *obsWriter
	fleet  *traffic.Fleet
	want   map[string]holdings
	synced []bool
	nSync  int
	// stopProf ends the CPU profile running, if one is.
	stopProf func() error
}

func (c *fleetChild) do(ctx context.Context, cmd, arg string) (string, error) {
	if c.fleet == nil && cmd != fleetStart && cmd != fleetTrack && cmd != fleetProfile && cmd != fleetProfileStop {
		return "", fmt.Errorf("%s before %s", cmd, fleetStart)
	}
	switch cmd {
	case fleetStart:
		if c.fleet != nil {
			return "", errors.New("already started")
		}
		f, err := traffic.StartFleet(ctx, c.cfg)
		if err != nil {
			return "", err
		}
		c.fleet = f
		if c.tls != nil {
			if err := c.tls.Err(); err != nil {
				return "", err
			}
		}
		return "", nil
	case fleetTrack:
		floor, err := strconv.ParseUint(arg, 10, 64)
		if err != nil {
			return "", fmt.Errorf("track: %w", err)
		}
		c.stream.floor.Store(floor)
		return "", nil
	case fleetWant:
		var want map[string]holdings
		if err := json.Unmarshal([]byte(arg), &want); err != nil {
			return "", fmt.Errorf("want: %w", err)
		}
		c.want, c.synced, c.nSync = want, make([]bool, len(c.fleet.Envoys())), 0
		return "", nil
	case fleetSynced:
		if c.want == nil {
			return "", fmt.Errorf("%s before %s", fleetSynced, fleetWant)
		}
		for i, e := range c.fleet.Envoys() {
			if w, ok := c.want[c.fleet.Groups()[i]]; ok && !c.synced[i] && envoyHoldings(e) == w {
				c.synced[i] = true
				c.nSync++
			}
		}
		return strconv.Itoa(c.nSync), nil
	case fleetStats:
		fig := c.fleet.Figures(traffic.MaxViolationSamples)
		if c.tls != nil {
			fig.Tokens = c.tls.Tokens()
		}
		b, err := json.Marshal(fig)
		return string(b), err
	case fleetPerEnvoy:
		b, err := json.Marshal(c.fleet.Counters())
		return string(b), err
	case fleetHeap:
		return strconv.FormatUint(liveHeap(), 10), nil
	case fleetProfile:
		if c.stopProf != nil {
			return "", errors.New("a profile is running")
		}
		stop, err := ProfileCPU(arg)
		if err != nil {
			return "", err
		}
		c.stopProf = stop
		return "", nil
	case fleetProfileStop:
		return "", c.stopProfile()
	}
	return "", fmt.Errorf("unknown command %q", cmd)
}

func (c *fleetChild) stopProfile() error {
	if c.stopProf == nil {
		return nil
	}
	err := c.stopProf()
	c.stopProf = nil
	return err
}

// stop stops the fleet, then closes its connections and the stream.
func (c *fleetChild) stop() {
	_ = c.stopProfile()
	if c.fleet != nil {
		ctx, cancel := context.WithTimeout(context.Background(), stopTimeout)
		c.fleet.Stop(ctx)
		cancel()
	}
	if c.tls != nil {
		c.tls.Close()
	}
	_ = c.stream.Close()
}

// FleetCommand returns the command line of a fleet child for cfg: the
// executable, its arguments, and what to add to its environment. ExecFleet
// makes cmd/loadtest's; tests re-execute their own binary.
type FleetCommand func(cfg FleetChildConfig) (path string, args, env []string, err error)

// ExecFleet returns the FleetCommand that runs path with args followed by
// "--config" and cfg as JSON; cmd/loadtest passes its own executable and
// "fleet-child".
func ExecFleet(path string, args ...string) FleetCommand {
	return func(cfg FleetChildConfig) (string, []string, []string, error) {
		b, err := json.Marshal(cfg)
		if err != nil {
			return "", nil, nil, err
		}
		return path, append(append([]string(nil), args...), "--config", string(b)), nil, nil
	}
}

// FleetProcessConfig configures StartFleetProcess.
type FleetProcessConfig struct {
	// Fleet is what the child runs. Required.
	Fleet FleetChildConfig
	// Command runs the child. Required.
	Command FleetCommand
	// CPUs, if set, pins the child (ChildConfig.CPUs).
	CPUs CPUSet
	// Tracker, if set, sees the observations the child streams (see
	// Track), as it would see an in-process fleet's events.
	Tracker *traffic.Tracker
	// Stderr receives the child's stderr. Nil: discarded.
	Stderr io.Writer
	// ReadyTimeout bounds the child's start (not its fleet's). Default 30s.
	ReadyTimeout time.Duration
}

// FleetProcess is a fleet of simulated Envoys in a child process of its
// own, so that their CPU is not the measuring process's and it can be
// pinned apart: the parent drives it over the child's stdin and stdout,
// and the child streams its Envoys' ACKs back over a pipe of their own
// into the parent's Tracker. Its methods are safe for concurrent use
// (requests are answered one at a time). Whoever starts it must call
// Stop; the child never outlives the parent (see Child).
type FleetProcess struct {
	cfg      FleetProcessConfig
	child    *Child
	replies  chan string
	reqMu    sync.Mutex
	seq      int
	observed atomic.Uint64
	obsR     *os.File
	obsDone  chan struct{}
	obsErr   atomic.Pointer[error] // the first error reading the stream
}

// StartFleetProcess starts the child and returns once it is ready for
// commands; its Envoys start with Start.
func StartFleetProcess(ctx context.Context, cfg FleetProcessConfig) (*FleetProcess, error) {
	if cfg.Command == nil {
		return nil, errors.New("loadtest: field FleetProcessConfig.Command is nil")
	}
	if _, err := cfg.Fleet.validate(); err != nil {
		return nil, err // the child would say the same, later
	}
	path, args, env, err := cfg.Command(cfg.Fleet)
	if err != nil {
		return nil, fmt.Errorf("loadtest: fleet child command: %w", err)
	}
	obsR, obsW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("loadtest: fleet child observations: %w", err)
	}
	fp := &FleetProcess{cfg: cfg, replies: make(chan string, 16), obsR: obsR, obsDone: make(chan struct{})}
	if cfg.Tracker != nil {
		for i := range cfg.Fleet.Envoys {
			cfg.Tracker.AddEnvoy(i, fp.group(i))
		}
	}
	fp.child, err = StartChild(ctx, ChildConfig{
		Path: path, Args: args, Env: env, Stderr: cfg.Stderr,
		ExtraFiles: []*os.File{obsW}, NoListen: true, CPUs: cfg.CPUs,
		OnLine: fp.onLine, ReadyTimeout: cfg.ReadyTimeout,
	})
	if err != nil {
		obsR.Close()
		return nil, fmt.Errorf("loadtest: fleet child: %w", err)
	}
	go fp.readObservations()
	return fp, nil
}

// group is the upstream group of Envoy i, as StartFleet names it.
func (fp *FleetProcess) group(i int) string {
	k := max(fp.cfg.Fleet.Keys, 1)
	return fp.cfg.Fleet.Scenario.Group(traffic.KeyNode(fp.cfg.Fleet.Scenario, i%k, i/k))
}

func (fp *FleetProcess) readObservations() {
	defer close(fp.obsDone)
	envoys := fp.cfg.Fleet.Envoys
	err := readObservations(fp.obsR, envoys, func(i int, ev envoy.Event) {
		fp.observed.Add(1)
		if fp.cfg.Tracker != nil {
			fp.cfg.Tracker.Observe(i, ev)
		}
	})
	if err != nil && !errors.Is(err, os.ErrClosed) {
		fp.obsErr.Store(&err)
		// Keep the child from blocking on a full pipe until it exits.
		_, _ = io.Copy(io.Discard, fp.obsR)
	}
	fp.obsR.Close()
}

func (fp *FleetProcess) onLine(line string) {
	select {
	case fp.replies <- line:
	default: // only answers to requests given up on can pile up
	}
}

// request sends one command and returns the child's result.
func (fp *FleetProcess) request(ctx context.Context, cmd, arg string) (string, error) {
	fp.reqMu.Lock()
	defer fp.reqMu.Unlock()
	for len(fp.replies) > 0 { // answers to requests given up on
		<-fp.replies
	}
	fp.seq++
	seq := strconv.Itoa(fp.seq)
	line := seq + " " + cmd
	if arg != "" {
		line += " " + arg
	}
	if err := fp.child.Send(line); err != nil {
		return "", fmt.Errorf("loadtest: fleet child: %s: %w", cmd, err)
	}
	for {
		select {
		case line := <-fp.replies:
			got, rest, _ := strings.Cut(line, " ")
			if got != seq {
				continue
			}
			status, result, _ := strings.Cut(rest, " ")
			if status != "ok" {
				return "", fmt.Errorf("loadtest: fleet child: %s: %s", cmd, result)
			}
			return result, nil
		case <-fp.child.Exited():
			return "", fmt.Errorf("loadtest: fleet child: %s: the child exited (%v)", cmd, fp.child.exitErr())
		case <-ctx.Done():
			return "", fmt.Errorf("loadtest: fleet child: %s: %w", cmd, ctx.Err())
		}
	}
}

// Start starts the Envoys (the paced ramp) and returns once every one has
// started.
func (fp *FleetProcess) Start(ctx context.Context) error {
	_, err := fp.request(ctx, fleetStart, "")
	return err
}

// Track has the child stream, from now on, every ACK and declaration of
// a resource at a generation above floor. A Tracker times changes by
// their generation and ignores older ones, so with floor the upstream's
// generation before the first timed change (upstream.Upstream.Generation)
// it sees every observation that can count, and nothing of the initial
// sync. It returns once the child applies it.
func (fp *FleetProcess) Track(ctx context.Context, floor uint64) error {
	_, err := fp.request(ctx, fleetTrack, strconv.FormatUint(floor, 10))
	return err
}

// WaitSynced waits until every Envoy holds its group's clusters and
// endpoints as up serves them now (as Fleet.WaitSynced; checked in the
// child by digest every 200 ms), or ctx ends.
func (fp *FleetProcess) WaitSynced(ctx context.Context, up *upstream.Upstream) error {
	want := map[string]holdings{}
	for _, g := range up.Groups() {
		want[g] = digestOf(traffic.Expected(up.Snapshot(g)))
	}
	b, err := json.Marshal(want)
	if err != nil {
		return err
	}
	if _, err := fp.request(ctx, fleetWant, string(b)); err != nil {
		return err
	}
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	n, total := 0, fp.cfg.Fleet.Envoys
	for ctx.Err() == nil {
		res, err := fp.request(ctx, fleetSynced, "")
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			return err
		}
		if n, err = strconv.Atoi(res); err != nil {
			return fmt.Errorf("loadtest: fleet child: synced: %q", res)
		}
		if n == total {
			return nil
		}
		select {
		case <-ctx.Done():
		case <-t.C:
		}
	}
	return fmt.Errorf("loadtest: %d of %d Envoys synced: %w", n, total, ctx.Err())
}

// Figures returns the fleet's counters.
func (fp *FleetProcess) Figures(ctx context.Context) (traffic.FleetFigures, error) {
	var fig traffic.FleetFigures
	res, err := fp.request(ctx, fleetStats, "")
	if err == nil {
		err = json.Unmarshal([]byte(res), &fig)
	}
	return fig, err
}

// Counters returns the per-Envoy counters.
func (fp *FleetProcess) Counters(ctx context.Context) (traffic.EnvoyCounters, error) {
	var c traffic.EnvoyCounters
	res, err := fp.request(ctx, fleetPerEnvoy, "")
	if err == nil {
		err = json.Unmarshal([]byte(res), &c)
	}
	if err == nil && (len(c.Bytes) != fp.cfg.Fleet.Envoys || len(c.Reconnects) != fp.cfg.Fleet.Envoys) {
		err = fmt.Errorf("loadtest: fleet child: counters of %d and %d Envoys, want %d", len(c.Bytes), len(c.Reconnects), fp.cfg.Fleet.Envoys)
	}
	return c, err
}

// Heap collects the child's garbage and returns its live heap, in bytes:
// what its Envoys hold (and the Go runtime's own).
func (fp *FleetProcess) Heap(ctx context.Context) (uint64, error) {
	res, err := fp.request(ctx, fleetHeap, "")
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(res, 10, 64)
}

// Profile has the child write a CPU profile to path until StopProfile.
func (fp *FleetProcess) Profile(ctx context.Context, path string) error {
	_, err := fp.request(ctx, fleetProfile, path)
	return err
}

// StopProfile ends the child's CPU profile, if one runs.
func (fp *FleetProcess) StopProfile(ctx context.Context) error {
	_, err := fp.request(ctx, fleetProfileStop, "")
	return err
}

// Observed is how many observations the child has streamed so far.
func (fp *FleetProcess) Observed() uint64 { return fp.observed.Load() }

// Pid is the child's process id.
func (fp *FleetProcess) Pid() int { return fp.child.Pid() }

// Stat reads the child's CPU time and memory (Linux only).
func (fp *FleetProcess) Stat() (ProcStat, error) { return fp.child.Stat() }

// Err returns the observation stream's error, if it met one: a malformed
// stream means the Tracker may have missed ACKs.
func (fp *FleetProcess) Err() error {
	if err := fp.obsErr.Load(); err != nil {
		return *err
	}
	return nil
}

// Stop stops the child (its Envoys first: see RunFleetChild), killing it
// if it has not exited when ctx ends, and returns once the observation
// stream is read to its end. It is idempotent.
func (fp *FleetProcess) Stop(ctx context.Context) error {
	err := fp.child.Stop(ctx)
	select {
	case <-fp.obsDone:
	case <-ctx.Done():
		fp.obsR.Close() // something else holds the pipe's other end
		<-fp.obsDone
	}
	return errors.Join(err, fp.Err())
}

// FleetTLS writes what a fleet child needs to reach a relay's TLS port
// into the credentials' directory: the mesh root, and the tokens of the
// service accounts of the keys' nodes, in a file only this user can read.
// It returns their names.
func (m *MeshCredentials) FleetTLS(sc upstream.Scenario, keys int) (*FleetChildTLS, error) {
	tokens := map[string]string{}
	for k := range keys {
		ns, sa := nodeAccount(traffic.KeyNode(sc, k, 0))
		tok, err := m.Token(ns, sa)
		if err != nil {
			return nil, err
		}
		tokens[ns+"/"+sa] = tok
	}
	b, err := json.Marshal(tokens)
	if err != nil {
		return nil, err
	}
	c := &FleetChildTLS{CAFile: filepath.Join(m.dir, "fleet-ca.pem"), TokensFile: filepath.Join(m.dir, "fleet-tokens.json")}
	if err := os.WriteFile(c.CAFile, m.rootPEM, 0o600); err != nil {
		return nil, err
	}
	if err := os.WriteFile(c.TokensFile, b, 0o600); err != nil {
		return nil, err
	}
	return c, nil
}

// nodeAccount is node's namespace and service account (its NAMESPACE and
// SERVICE_ACCOUNT metadata).
func nodeAccount(node *core.Node) (ns, sa string) {
	f := node.GetMetadata().GetFields()
	return f["NAMESPACE"].GetStringValue(), f["SERVICE_ACCOUNT"].GetStringValue()
}
