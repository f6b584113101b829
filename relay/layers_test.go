package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// layers ranks the module's packages from the bottom up: a package may
// import its own layer and those below it, never one above. Within
// "relay leaves" the leaves import one another (xds below wire, and so
// on), but none imports package relay itself. The longest prefix wins.
var layers = []struct {
	prefix string // path below the module; ending in "/": what is under it only
	rank   int
	name   string
}{
	{"ledger", 0, "ledger"},
	{"relay/", 1, "relay leaves"},
	{"relay", 2, "relay"},
	{"shard", 3, "shard"},
	{"loadtest", 4, "loadtest"},
	{"deploy", 4, "deploy"},
	{"docs", 5, "docs"},
	{"cmd", 5, "cmd"},
}

const module = "github.com/meshrelay/meshrelay"

// layerOf returns the layer of a module package (ok false for others).
func layerOf(path string) (rank int, name string, ok bool) {
	rel, in := strings.CutPrefix(path, module+"/")
	if !in {
		return 0, "", false
	}
	best := -1
	for i, l := range layers {
		match := strings.HasPrefix(rel, l.prefix)
		if !strings.HasSuffix(l.prefix, "/") {
			match = rel == l.prefix || strings.HasPrefix(rel, l.prefix+"/")
		}
		if match && (best < 0 || len(l.prefix) > len(layers[best].prefix)) {
			best = i
		}
	}
	if best < 0 {
		return 0, "", false
	}
	return layers[best].rank, layers[best].name, true
}

// TestLayersImportDownward fails when a package imports one of a higher
// layer (see layers): ledger stays pure, relay's leaves never reach back
// into relay, relay knows nothing of the tier's membership, and nothing
// but the binaries imports the benchmarks. It checks what packages build
// into (go list's Imports); tests may reach up, as shard's use the
// in-process tier of loadtest/cluster.
func TestLayersImportDownward(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "list", "-e", "-json=ImportPath,Imports,Error", module+"/...")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.Bytes())
	}
	dec := json.NewDecoder(bytes.NewReader(out))
	checked := 0
	for {
		var p struct {
			ImportPath string
			Imports    []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decode go list output: %v", err)
		}
		from, fromName, ok := layerOf(p.ImportPath)
		if !ok {
			t.Errorf("%s is in no layer: add its folder to layers", p.ImportPath)
			continue
		}
		checked++
		for _, imp := range p.Imports {
			to, toName, ok := layerOf(imp)
			if ok && to > from {
				t.Errorf("%s (%s) imports %s (%s, a higher layer)", p.ImportPath, fromName, imp, toName)
			}
		}
	}
	if checked < 20 {
		t.Fatalf("checked %d packages, want the whole module", checked)
	}
}

func TestLayerOf(t *testing.T) {
	for _, tt := range []struct {
		path string
		want string
	}{
		{module + "/ledger", "ledger"},
		{module + "/ledger/ledgerpb", "ledger"},
		{module + "/relay", "relay"},
		{module + "/relay/xds", "relay leaves"},
		{module + "/relay/auth/authtest", "relay leaves"},
		{module + "/shard/memnet", "shard"},
		{module + "/loadtest/cluster", "loadtest"},
		{module + "/cmd/meshrelay", "cmd"},
		{module + "/relayx", ""},
		{"google.golang.org/grpc", ""},
	} {
		if _, got, _ := layerOf(tt.path); got != tt.want {
			t.Errorf("layerOf(%q) = %q, want %q", tt.path, got, tt.want)
		}
	}
}

// maxFileLines bounds the length of a file of this package: a newcomer
// reads one part at a time (the package comment names each file's part).
const maxFileLines = 700

// TestFilesStayReadable fails when a non-test file of package relay grows
// past maxFileLines (split it along what it does) or when the package
// comment, a newcomer's map of the files, does not name it.
func TestFilesStayReadable(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile("relay.go")
	if err != nil {
		t.Fatal(err)
	}
	doc, _, _ := strings.Cut(string(src), "\npackage relay\n")
	checked := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		checked++
		if n := bytes.Count(b, []byte("\n")); n > maxFileLines {
			t.Errorf("%s has %d lines, more than %d", f, n, maxFileLines)
		}
		if !strings.Contains(doc, " "+f) {
			t.Errorf("the package comment (relay.go) names no %s: say what part it holds", f)
		}
	}
	if checked < 10 {
		t.Fatalf("checked %d files, want the package's", checked)
	}
}
