package shard

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestNewNodeIsTheOneCompositionRoot: outside package relay's own files,
// relay.New is called from NewNode only, so that listeners, the store, the
// ring and their lifecycle are wired one way for meshrelay serve, the
// demo, the loadtest children and the tests of a whole relay.
func TestNewNodeIsTheOneCompositionRoot(t *testing.T) {
	const relayPkg = "github.com/meshrelay/meshrelay/relay"
	root := filepath.Join("..")
	fset := token.NewFileSet()
	var callers []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != root && (strings.HasPrefix(name, ".") || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || filepath.Dir(path) == filepath.Join(root, "relay") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		local := ""
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); p == relayPkg {
				local = "relay"
				if imp.Name != nil {
					local = imp.Name.Name
				}
			}
		}
		if local == "" {
			return nil
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			if sel, ok := call.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "New" {
				if x, ok := sel.X.(*ast.Ident); ok && x.Name == local {
					callers = append(callers, fset.Position(call.Pos()).String())
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := filepath.Join(root, "shard", "node.go")
	if len(callers) != 1 || !strings.HasPrefix(callers[0], want+":") {
		t.Errorf("relay.New is called from %q, want from %s (NewNode) only: build a shard.Node instead", callers, want)
	}
}
