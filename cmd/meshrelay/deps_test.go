package main

import (
	"os/exec"
	"path"
	"strings"
	"testing"
)

// demoPackages are the packages of loadtest/ the production binary may
// link: what `meshrelay demo` runs (the synthetic upstream, the simulated
// and real Envoys, the in-process tier and its fleet and report). The
// benchmark drivers, the installers and the simulation stay out.
var demoPackages = map[string]bool{
	"cluster": true, "demo": true, "envoy": true, "realenvoy": true,
	"report": true, "traffic": true, "upstream": true,
}

// TestBinaryLinksNoTestCode fails when the shipped relay links a test
// helper, a plotting library, an installer or a benchmark driver: what
// `go list -deps ./cmd/meshrelay` names is what the binary carries.
func TestBinaryLinksNoTestCode(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	const mod = "github.com/meshrelay/meshrelay/"
	deps := strings.Fields(string(out))
	if len(deps) < 100 {
		t.Fatalf("go list -deps named %d packages, want the relay's hundreds", len(deps))
	}
	for _, p := range deps {
		var why string
		switch {
		case strings.HasPrefix(p, mod) && strings.HasSuffix(path.Base(p), "test"):
			why = "a test helper package"
		case p == mod+"loadtest" || strings.HasPrefix(p, mod+"loadtest/") && !demoPackages[strings.Split(strings.TrimPrefix(p, mod+"loadtest/"), "/")[0]]:
			why = "loadtest code the demo does not run"
		case strings.HasPrefix(p, mod+"loadtest/") && strings.Count(strings.TrimPrefix(p, mod+"loadtest/"), "/") > 0:
			why = "below a demo package (installers live there)"
		case strings.HasPrefix(p, "gonum.org/"):
			why = "a plotting library"
		case p == "net/http/httptest" || p == "go.uber.org/goleak" || strings.HasPrefix(p, "github.com/stretchr/testify"):
			why = "a test library"
		}
		if why != "" {
			t.Errorf("cmd/meshrelay links %s: %s", p, why)
		}
	}
}
