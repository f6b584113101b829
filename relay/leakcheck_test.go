package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"
)

// TestEveryTestedPackageChecksLeaks keeps STYLE.md's promise that every
// package with tests runs goleak: each package in the module that has test
// files must have a TestMain that calls goleak.VerifyTestMain, so a goroutine
// a test leaves behind fails that package's run.
func TestEveryTestedPackageChecksLeaks(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "list", "-e",
		"-json=ImportPath,Dir,TestGoFiles,XTestGoFiles",
		"github.com/meshrelay/meshrelay/...")
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
			ImportPath   string
			Dir          string
			TestGoFiles  []string
			XTestGoFiles []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decode go list output: %v", err)
		}
		files := slices.Concat(p.TestGoFiles, p.XTestGoFiles)
		if len(files) == 0 {
			continue
		}
		checked++
		ok, err := verifiesLeaks(p.Dir, files)
		if err != nil {
			t.Errorf("%s: %v", p.ImportPath, err)
		} else if !ok {
			t.Errorf("%s has tests but no TestMain calling goleak.VerifyTestMain; add main_test.go with\n\tfunc TestMain(m *testing.M) { goleak.VerifyTestMain(m) }", p.ImportPath)
		}
	}
	if checked == 0 {
		t.Fatal("go list found no package with tests")
	}
}

// verifiesLeaks reports whether one of the test files in dir declares a
// TestMain whose body calls VerifyTestMain from go.uber.org/goleak.
func verifiesLeaks(dir string, files []string) (bool, error) {
	fset := token.NewFileSet()
	for _, name := range files {
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.SkipObjectResolution)
		if err != nil {
			return false, err
		}
		local := ""
		for _, imp := range f.Imports {
			if path, _ := strconv.Unquote(imp.Path.Value); path == "go.uber.org/goleak" {
				local = "goleak"
				if imp.Name != nil {
					local = imp.Name.Name
				}
			}
		}
		if local == "" {
			continue
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || fn.Name.Name != "TestMain" || fn.Body == nil {
				continue
			}
			found := false
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return !found
				}
				sel, ok := call.Fun.(*ast.SelectorExpr)
				if ok && sel.Sel.Name == "VerifyTestMain" {
					if x, ok := sel.X.(*ast.Ident); ok && x.Name == local {
						found = true
					}
				}
				return !found
			})
			if found {
				return true, nil
			}
		}
	}
	return false, nil
}
