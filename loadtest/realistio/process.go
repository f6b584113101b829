package realistio

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"time"
)

// process is a binary the tests run (kube-apiserver, istiod), its output
// to a log, and its end.
type process struct {
	name   string
	cmd    *exec.Cmd
	exited chan struct{}
}

// startProcess starts cmd, its output to log; it dies with the test
// process where the platform allows (childAttr).
func startProcess(name string, cmd *exec.Cmd, log io.Writer) (*process, error) {
	cmd.Stdout, cmd.Stderr, cmd.SysProcAttr = log, log, childAttr()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.exited) }()
	return p, nil
}

// waitHTTP polls url with hc until it answers 200, the process exits, or
// within passes; the error says what it last answered.
func (p *process) waitHTTP(ctx context.Context, hc *http.Client, url string, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	var last string
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := hc.Do(req)
		if err == nil {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("%s: %s", resp.Status, bytes.TrimSpace(b))
		} else {
			last = err.Error()
		}
		select {
		case <-p.exited:
			return fmt.Errorf("%s exited before it was ready: %v", p.name, p.cmd.ProcessState)
		case <-ctx.Done():
			return fmt.Errorf("%s not ready: %s", p.name, last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// stop interrupts the process and waits for it, killing it after grace.
// A nil process is already stopped.
func (p *process) stop(grace time.Duration) {
	if p == nil {
		return
	}
	_ = p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.exited:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}
