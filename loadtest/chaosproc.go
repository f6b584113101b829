package loadtest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// ChaosUpstreamConfig is the synthetic upstream of a chaos run, in a
// process of its own (RunChaosUpstream). Its churn is stepped by the
// driver ("step" on stdin), so the driver knows exactly what was
// published and when, and a restarted upstream replays the steps its
// predecessor made before it serves: generations only grow, across
// processes, as they do on a real istiod's resources.
type ChaosUpstreamConfig struct {
	Listen            string
	Scenario          upstream.Scenario
	Seed              int64
	AddRemoveFraction float64
	// Replay is the number of churn steps applied before serving.
	Replay int
}

// Args returns the child's flags (chaos-upstream-child).
func (c ChaosUpstreamConfig) Args() []string {
	b, _ := json.Marshal(c)
	return []string{"--config", string(b)}
}

// RunChaosUpstream is the main of a chaos run's upstream process. It
// prints "xds <addr>" once it serves, then answers commands on in, one a
// line: "step" applies the churn's next step and prints "stepped <n>";
// "streams" prints "streams <json>", the open streams by node id. It runs
// until ctx ends or in reaches EOF.
func RunChaosUpstream(ctx context.Context, cfg ChaosUpstreamConfig, in io.Reader, out io.Writer) error {
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario, ucfg.Listen = cfg.Scenario, cfg.Listen
	u, err := upstream.New(ucfg)
	if err != nil {
		return err
	}
	ch := u.NewChurner(cfg.Seed, cfg.AddRemoveFraction)
	for range cfg.Replay {
		if _, err := ch.Step(); err != nil {
			return err
		}
	}
	if err := u.Start(ctx); err != nil {
		return err
	}
	defer u.Stop(context.WithoutCancel(ctx))
	if _, err := fmt.Fprintf(out, "%s%s\n", readyPrefix, u.Addr()); err != nil {
		return err
	}
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(in)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	for {
		var line string
		var ok bool
		select {
		case <-ctx.Done():
			return nil
		case line, ok = <-lines:
			if !ok {
				return nil
			}
		}
		switch line {
		case "step":
			if _, err := ch.Step(); err != nil {
				return err
			}
			fmt.Fprintf(out, "stepped %d\n", ch.Steps())
		case "streams":
			b, _ := json.Marshal(u.StreamsByNode())
			fmt.Fprintf(out, "streams %s\n", b)
		default:
			return fmt.Errorf("loadtest: chaos upstream: unknown command %q", line)
		}
	}
}

// StartChaosUpstreamFunc starts the upstream process; log receives its
// stderr.
type StartChaosUpstreamFunc func(ctx context.Context, cfg ChaosUpstreamConfig, log io.Writer, onLine func(string)) (*Child, error)

// ExecChaosUpstream returns a StartChaosUpstreamFunc that runs path with
// args followed by the child's flags; cmd/loadtest passes its own
// executable and "chaos-upstream-child".
func ExecChaosUpstream(path string, args ...string) StartChaosUpstreamFunc {
	return func(ctx context.Context, cfg ChaosUpstreamConfig, log io.Writer, onLine func(string)) (*Child, error) {
		return StartChild(ctx, ChildConfig{
			Path:   path,
			Args:   append(append([]string(nil), args...), cfg.Args()...),
			Stderr: log,
			OnLine: onLine,
		})
	}
}

// chaosUpstream is the driver's handle on the upstream process: it asks
// and waits for the answer. Safe for concurrent use.
type chaosUpstream struct {
	start StartChaosUpstreamFunc
	cfg   ChaosUpstreamConfig
	log   io.Writer

	mu      sync.Mutex // one question at a time; guards child, replies
	child   *Child
	replies chan string
}

func (u *chaosUpstream) run(ctx context.Context, replay int) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	cfg := u.cfg
	cfg.Replay = replay
	replies := make(chan string, 16)
	child, err := u.start(ctx, cfg, u.log, func(line string) {
		select {
		case replies <- line:
		default: // nobody asked: dropped
		}
	})
	if err != nil {
		return fmt.Errorf("start upstream: %w", err)
	}
	u.child, u.replies = child, replies
	if u.cfg.Listen == "" || strings.HasSuffix(u.cfg.Listen, ":0") {
		u.cfg.Listen = child.Addr() // the same address after a restart
	}
	return nil
}

func (u *chaosUpstream) kill() {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.child != nil {
		u.child.Kill()
		u.child = nil
	}
}

// ask sends cmd and returns the answer that starts with prefix.
func (u *chaosUpstream) ask(cmd, prefix string) (string, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.child == nil {
		return "", errors.New("upstream down")
	}
	if err := u.child.Send(cmd); err != nil {
		return "", err
	}
	timer := time.NewTimer(30 * time.Second)
	defer timer.Stop()
	for {
		select {
		case line := <-u.replies:
			if rest, ok := strings.CutPrefix(line, prefix); ok {
				return rest, nil
			}
		case <-u.child.Exited():
			return "", errors.New("upstream exited")
		case <-timer.C:
			return "", fmt.Errorf("upstream did not answer %q in 30s", cmd)
		}
	}
}

func (u *chaosUpstream) step() (int, error) {
	s, err := u.ask("step", "stepped ")
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(s)
}

func (u *chaosUpstream) streams() (map[string]int, error) {
	s, err := u.ask("streams", "streams ")
	if err != nil {
		return nil, err
	}
	var m map[string]int
	return m, json.Unmarshal([]byte(s), &m)
}

// BuildMeshrelay builds cmd/meshrelay of the module in the working
// directory into dir (once per run: linking takes tens of seconds, a cold
// build minutes) and returns the binary's path. The compiler's output goes
// to log.
func BuildMeshrelay(ctx context.Context, dir string, log io.Writer) (string, error) {
	bin := filepath.Join(dir, "meshrelay")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/meshrelay/meshrelay/cmd/meshrelay")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("loadtest: go build meshrelay: %w", err)
	}
	return bin, nil
}
