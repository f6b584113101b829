package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestServeFlags(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{"no upstream", []string{"--xds-listen", "127.0.0.1:0", "--admin-listen", ""}, "field Upstream is empty"},
		{"bad key profile", []string{"--upstream", "x:1", "--key-profile", "by-moon-phase"}, `unknown key profile "by-moon-phase"`},
		{"bad protocol", []string{"--upstream", "x:1", "--upstream-protocol", "rest"}, `unknown protocol "rest"`},
		{"bad log level", []string{"--upstream", "x:1", "--log-level", "loud"}, "--log-level"},
		{"extra metadata needs istio", []string{"--upstream", "x:1", "--key-profile", "per-node", "--key-metadata", "A"}, "needs the istio profile"},
		{"unknown flag", []string{"--upstrem", "x:1"}, "flag provided but not defined"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := serve(context.Background(), tt.args)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("serve(%q) = %v, want an error containing %q", tt.args, err, tt.wantErr)
			}
		})
	}
}

// TestServeStartsAndStops: a relay with valid flags serves until its
// context ends, then stops cleanly (goleak checks nothing is left).
func TestServeStartsAndStops(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err := serve(ctx, []string{"--upstream", "127.0.0.1:1", "--xds-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--log-level", "error"})
	if err != nil {
		t.Fatalf("serve = %v, want nil after the context ended", err)
	}
}

func TestDemoFlags(t *testing.T) {
	for _, args := range [][]string{{"--protocol", "rest"}, {"--upstream-protocol", "x"}} {
		if err := demo(context.Background(), args); err == nil {
			t.Errorf("demo(%q) = nil, want an error", args)
		}
	}
}
