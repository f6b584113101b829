package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// layerOfFile places each file of package relay in the layer issue 30
// moves it to, bottom up: 0 a key's cache and its feed (what the key
// holds and how it is fed: views, subscriptions, members, the feed's
// requests and answers, the divergence check's schedule, credentials
// forwarded), 1 the downstream server (streams, pushes, holds,
// admission), 2 the tier and inspection (owners, peers, the divergence
// checks run, claims, gathers, dumps), 3 the relay
// that assembles them (its Config, ports, metrics, lifecycle). A file
// goes in the layer of most of what it holds; an arrow from a file to one
// of a higher layer is what keeps the layers from being packages.
var layerOfFile = map[string]int{
	"keystate.go": 0, "feed.go": 0, "feedrequests.go": 0, "feedanswers.go": 0,
	"persist.go": 0, "aggregation.go": 0, "versions.go": 0, "forward.go": 0,
	"splits.go": 0, "firstanswers.go": 0, "feedsource.go": 0, "backoff.go": 0,
	"session.go": 0, "keycache.go": 0, "keyconfig.go": 0,

	"stream.go": 1, "push.go": 1, "holds.go": 1, "sotw.go": 1, "delta.go": 1,
	"passthrough.go": 1, "mailbox.go": 1, "identity.go": 1, "admission.go": 1,
	"rekey.go": 1, "xdsconfig.go": 1, "server.go": 1,

	"tier.go": 2, "checks.go": 2, "claims.go": 2, "ledger.go": 2, "inspect.go": 2, "debugxds.go": 2,

	"relay.go": 3, "config.go": 3, "metrics.go": 3, "ports.go": 3, "insecure.go": 3,
}

// maxArrowsUp is the ratchet of TestCoreArrows: lower it as the layers
// come apart, never raise it.
const maxArrowsUp = 14

// TestCoreArrows measures how the files of package relay lean on each
// other: an arrow runs from a file to each other file whose declarations
// it uses (a package-level name, or a method or field whose name only one
// file declares). An arrow up runs from a file to one of a higher layer
// (layerOfFile): issue 30's "arrows running back up", each a tie to cut
// before the layers are packages. It fails when a file has no layer, or
// when arrows up grow past maxArrowsUp; with -v it prints the figures.
func TestCoreArrows(t *testing.T) {
	arrows, err := fileArrows(".")
	if err != nil {
		t.Fatal(err)
	}
	total, up := 0, 0
	byLayers := map[[2]int]int{}
	for from, tos := range arrows {
		lf, ok := layerOfFile[from]
		if !ok {
			t.Errorf("%s is in no layer: add it to layerOfFile", from)
			continue
		}
		for to := range tos {
			total++
			lt, ok := layerOfFile[to]
			if !ok {
				continue // reported as a from, or has no arrows of its own
			}
			if lt > lf {
				up++
				byLayers[[2]int{lf, lt}]++
				if testing.Verbose() {
					t.Logf("up: %s → %s", from, to)
				}
			}
		}
	}
	t.Logf("package relay: %d files, %d arrows, %d up (by layers from→to: %v)", len(arrows), total, up, byLayers)
	if total < 50 {
		t.Fatalf("found %d arrows: the measure is broken", total)
	}
	if up > maxArrowsUp {
		t.Errorf("%d arrows run up the layers, more than %d: a lower part reaches into one that should use it", up, maxArrowsUp)
	}
}

// fileArrows returns, for the non-test files of the package in dir, the
// files each uses: the package is type-checked (its imports read from the
// export data `go list -export` builds), and an arrow runs from a file to
// the file that declares each package-level name, method or field it
// uses.
func fileArrows(dir string) (map[string]map[string]bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "list", "-export", "-deps", "-json=ImportPath,Export,GoFiles,Dir", ".")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list -export: %w", err)
	}
	exports := map[string]string{}
	var self struct {
		ImportPath, Dir string
		GoFiles         []string
	}
	for dec := json.NewDecoder(bytes.NewReader(out)); ; {
		var p struct {
			ImportPath, Export, Dir string
			GoFiles                 []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, err
		}
		exports[p.ImportPath] = p.Export
		self.ImportPath, self.Dir, self.GoFiles = p.ImportPath, p.Dir, p.GoFiles // the package itself comes last
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range self.GoFiles {
		f, err := parser.ParseFile(fset, filepath.Join(self.Dir, name), nil, 0)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		if exports[path] == "" {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(exports[path])
	})
	info := &types.Info{Uses: make(map[*ast.Ident]types.Object)}
	pkg, err := (&types.Config{Importer: imp}).Check(self.ImportPath, fset, files, info)
	if err != nil {
		return nil, err
	}
	arrows := map[string]map[string]bool{}
	for id, obj := range info.Uses {
		if obj.Pkg() != pkg || !obj.Pos().IsValid() || obj.Parent() != nil && obj.Parent() != pkg.Scope() {
			continue // another package's, a builtin, or a local name
		}
		from := filepath.Base(fset.Position(id.Pos()).Filename)
		to := filepath.Base(fset.Position(obj.Pos()).Filename)
		if from == to {
			continue
		}
		if arrows[from] == nil {
			arrows[from] = map[string]bool{}
		}
		arrows[from][to] = true
	}
	return arrows, nil
}
