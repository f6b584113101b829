// Package docs holds the project's documentation; its test keeps the
// generated parts (flags.md) in step with the binaries.
package docs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// binaries are the commands flags.md documents, in its order.
var binaries = []string{"meshrelay", "relayctl", "loadtest"}

// TestFlagsDoc fails when flags.md is not what the binaries print: it
// builds them, asks each for its commands and each command for --help.
// MESHRELAY_UPDATE_DOCS=1 rewrites the file instead.
func TestFlagsDoc(t *testing.T) {
	if testing.Short() {
		t.Skip("builds three binaries")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	dir := t.TempDir()
	pkgs := make([]string, len(binaries))
	for i, b := range binaries {
		pkgs[i] = "github.com/meshrelay/meshrelay/cmd/" + b
	}
	build := exec.CommandContext(ctx, "go", append([]string{"build", "-o", dir + string(filepath.Separator)}, pkgs...)...)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	got, err := flagsDoc(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	if os.Getenv("MESHRELAY_UPDATE_DOCS") != "" {
		if err := os.WriteFile("flags.md", got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile("flags.md")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("docs/flags.md differs from what the binaries print (first difference at line %d); regenerate it: MESHRELAY_UPDATE_DOCS=1 go test ./docs -run TestFlagsDoc", firstDiffLine(got, want))
	}
}

// flagsDoc renders flags.md from the binaries in dir.
func flagsDoc(ctx context.Context, dir string) ([]byte, error) {
	var b bytes.Buffer
	b.WriteString(`# Flags

Every command of meshrelay's three binaries, as its ` + "`--help`" + ` prints it.
All take ` + "`--flag value`" + ` or ` + "`--flag=value`" + ` (a bool flag alone means true);
a single dash is for one-letter shorthands only (` + "`relayctl -o json`" + `).

Generated from the binaries; ` + "`go test ./docs`" + ` fails when this file
drifts from them. Regenerate it with:

` + "```sh" + `
MESHRELAY_UPDATE_DOCS=1 go test ./docs -run TestFlagsDoc
` + "```" + `
`)
	for _, bin := range binaries {
		path := filepath.Join(dir, bin)
		top, err := help(ctx, path)
		if err != nil {
			return nil, err
		}
		cmds := commands(bin, top)
		if len(cmds) == 0 {
			return nil, fmt.Errorf("%s --help names no commands:\n%s", bin, top)
		}
		fmt.Fprintf(&b, "\n## %s\n\n```text\n%s```\n", bin, top)
		for _, c := range cmds {
			out, err := help(ctx, path, c)
			if err != nil {
				return nil, err
			}
			fmt.Fprintf(&b, "\n### %s %s\n\n```text\n%s```\n", bin, c, out)
		}
	}
	return b.Bytes(), nil
}

// help runs "path args... --help" and returns what it printed, which
// must end in a newline.
func help(ctx context.Context, path string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, path, append(args, "--help")...)
	// Defaults must not depend on the machine that renders them.
	cmd.Env = []string{"HOME=/home/user", "PATH=/usr/bin:/bin"}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s %s --help: %w\n%s", filepath.Base(path), strings.Join(args, " "), err, out)
	}
	s := strings.TrimRight(string(out), "\n") + "\n"
	if strings.Contains(s, "```") {
		return "", errors.New(filepath.Base(path) + ": help text holds a code fence")
	}
	return s, nil
}

// commands returns the commands a top-level help lists: "  bin cmd …"
// lines (meshrelay, loadtest) or cobra's "Available Commands:" (relayctl,
// less cobra's own help and completion).
func commands(bin, top string) []string {
	var cmds []string
	own := regexp.MustCompile(`^  ` + regexp.QuoteMeta(bin) + ` ([a-z][a-z-]*)\b`)
	cobra := false
	for line := range strings.Lines(top) {
		line = strings.TrimRight(line, "\n")
		switch {
		case line == "Available Commands:":
			cobra = true
			continue
		case cobra && line == "":
			cobra = false
		case cobra:
			if f := strings.Fields(line); len(f) > 0 && f[0] != "help" && f[0] != "completion" {
				cmds = append(cmds, f[0])
			}
		}
		if m := own.FindStringSubmatch(line); m != nil && !slices.Contains(cmds, m[1]) {
			cmds = append(cmds, m[1])
		}
	}
	return cmds
}

func firstDiffLine(a, b []byte) int {
	la, lb := bytes.Split(a, []byte("\n")), bytes.Split(b, []byte("\n"))
	for i := range min(len(la), len(lb)) {
		if !bytes.Equal(la[i], lb[i]) {
			return i + 1
		}
	}
	return min(len(la), len(lb)) + 1
}
