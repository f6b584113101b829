package realistio

import (
	"slices"
	"strings"
	"testing"
)

// stagingModules reads the modules k8s.io/kubernetes points at its own
// staging directories (block and single-line replaces), not the others.
func TestStagingModules(t *testing.T) {
	mods, goVersion, err := stagingModules("testdata/kubernetes.go.mod")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"k8s.io/api", "k8s.io/client-go", "k8s.io/kms"}; !slices.Equal(mods, want) || goVersion != "1.25.0" {
		t.Fatalf("stagingModules = %q, go %q; want %q, go 1.25.0", mods, goVersion, want)
	}
	if _, _, err := stagingModules("build.go"); err == nil || !strings.Contains(err.Error(), "not k8s.io/kubernetes") {
		t.Fatalf("a file that is no such go.mod: %v, want an error saying so", err)
	}
}

// Find names the command that builds what it does not find.
func TestFindSaysHowToBuild(t *testing.T) {
	t.Setenv("MESHRELAY_ISTIO_CACHE", t.TempDir())
	_, err := Find()
	if err == nil || !strings.Contains(err.Error(), BuildCommand) {
		t.Fatalf("Find in an empty cache: %v, want an error naming %q", err, BuildCommand)
	}
}
