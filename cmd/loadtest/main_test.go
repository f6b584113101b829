package main

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"go.uber.org/goleak"

	"github.com/meshrelay/meshrelay/loadtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestDocumentedFlags checks that each command takes the flags
// loadtest/README.md documents for it: a flag it lacks fails the parse
// before --help is reached.
func TestDocumentedFlags(t *testing.T) {
	for _, tc := range []struct {
		name string
		run  func(context.Context, []string) error
		args []string
	}{
		{"warmstart", warmstart, []string{"--quiet", "3s", "--changes", "1", "--etcd-dir", "/nonexistent", "--warm-only", "--relay-memory-limit", "1536Mi"}},
		{"fanout", fanout, []string{"--services", "1", "--endpoints", "1", "--namespaces", "1", "--local-fraction", "0", "--upstream-protocol", "delta",
			"--fleet-process=false", "--envoys", "1", "--keys", "1", "--start-rate", "1", "--envoys-per-conn", "1", "--settle", "1s", "--changes", "1",
			"--change-gap", "1s", "--change-timeout", "1s", "--sync-timeout", "1s", "--target-p99", "1s", "--target-rss-mib", "1", "--json", "x",
			"--relay-profile", "x", "--cpuprofile", "x", "--relay-cpus", "0", "--fleet-cpus", "0", "--real-envoys", "0", "--tls=compare",
			"--tls-verifier", "local", "--tokenreview-latency", "1ms", "--admit-streams", "1", "--admit-concurrency", "1", "--protocols", "delta", "--modes", "relayed", "--seed", "1"}},
		{"scale", scale, []string{"--relays", "2", "--envoys", "1", "--keys", "1", "--start-rate", "1", "--fleet-process=false", "--relay-cpus", "0", "--fleet-cpus", "0",
			"--changes", "1", "--change-gap", "1s", "--tolerance", "0.2", "--tls", "--tls-verifier", "local", "--phase-timeout", "1s"}},
		{"ledger", ledgerBench, []string{"--relays", "1", "--envoys", "1", "--keys", "1", "--resources", "1", "--versions", "1", "--queries", "1", "--peers-apart", "--json", "x", "--cpuprofile", "x"}},
		{"keys", keyBench, []string{"--clients", "1", "--endpoints", "1", "--pushes", "1", "--profile", "per-node", "--upstream-protocol", "sotw",
			"--clients-per-conn", "1", "--relay-cpus", "0", "--relay-profile", "x", "--json", "x"}},
		{"proxystatus", proxyStatus, []string{"--relays", "1", "--envoys", "1", "--keys", "1", "--queries", "1", "--json", "x", "--cpuprofile", "x"}},
		{"ctrip", ctrip, []string{"--services", "1", "--endpoints", "1", "--namespaces", "1", "--local-fraction", "0", "--relays", "1", "--envoys", "1", "--keys", "1",
			"--protocol", "delta", "--upstream-protocol", "delta", "--incremental-upstream", "--churn-rate", "1", "--duration", "1s", "--churn-add-remove", "0",
			"--seed", "1", "--start-rate", "1", "--max-syncing", "1", "--sync-timeout", "1s", "--change-timeout", "1s", "--settle", "1s", "--ledger-interval", "1s",
			"--target-p95", "1s", "--target-p99", "1s", "--relay-cpus", "0", "--fleet-cpus", "0", "--interval", "1s", "--min-available-gib", "0", "--json", "x",
			"--plot", "x", "--cpuprofile", "x", "--child-cpuprofile", "x", "--quick"}},
		{"upstream", serveUpstream, []string{"--listen", "127.0.0.1:0", "--services", "1", "--endpoints", "1", "--namespaces", "1", "--local-fraction", "0",
			"--churn-rate", "0", "--churn-duration", "1s", "--churn-count", "0", "--churn-add-remove", "0", "--seed", "1", "--max-msg-size", "1"}},
		{"chaos", chaos, []string{"--seeds", "1", "--seed", "1", "--faults", "1", "--kinds", "kill-relay", "--relays", "2", "--etcd-members", "1", "--envoys", "1",
			"--keys", "1", "--services", "1", "--endpoints", "1", "--namespaces", "1", "--protocols", "delta", "--upstream-protocol", "delta", "--upstream-protocols", "delta,sotw", "--starve-signals",
			"--churn-rate", "1", "--delivery-bound", "1s", "--recover-timeout", "1s", "--dir", "x", "--meshrelay", "x", "--relay-log-level", "warn", "--json", "x"}},
		{"attack", attack, []string{"--meshrelay", "before=/a,after=/b", "--attacks", "baseline,handshakes", "--duration", "1s", "--good-interval", "10ms",
			"--good-timeout", "1s", "--flooders", "1", "--large-streams", "1", "--large-bytes", "1", "--large-cap", "1", "--large-entries", "1",
			"--million-names", "1", "--handshakes", "1", "--handshake-concurrency", "1", "--rss-limit-gib", "1", "--services", "3", "--endpoints", "3",
			"--namespaces", "3", "--relay-args", "--x", "--relay-log", "--json", "x"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.run(context.Background(), append(tc.args, "--help"))
			if !errors.Is(err, pflag.ErrHelp) {
				t.Errorf("%s %q --help = %v, want pflag.ErrHelp", tc.name, tc.args, err)
			}
		})
	}
}

// TestCheckPinning: --fleet-cpus needs a fleet child, and names what the
// fleet would share this process with.
func TestCheckPinning(t *testing.T) {
	if err := checkPinning(nil, nil, false, "the tier"); err != nil {
		t.Errorf("checkPinning(none, none, no fleet process) = %v, want nil", err)
	}
	err := checkPinning(nil, loadtest.CPUSet{0}, false, "the tier")
	if err == nil || !strings.Contains(err.Error(), "with the tier otherwise") {
		t.Errorf("checkPinning(none, 0, no fleet process) = %v, want an error naming the tier", err)
	}
}

// TestParseAttack: attack's flags reach its config, and bad ones are
// refused before anything starts.
func TestParseAttack(t *testing.T) {
	cfg, jsonOut, err := parseAttack([]string{"--meshrelay", "before=/tmp/b, after=/tmp/a", "--attacks", "baseline,large-requests",
		"--duration", "2s", "--flooders", "3", "--large-bytes", "1000", "--rss-limit-gib", "0.5", "--relay-args", "--a=1 --b", "--json", "r.json"})
	if err != nil {
		t.Fatalf("parseAttack = %v", err)
	}
	want := []loadtest.AttackBinary{{Label: "before", Path: "/tmp/b"}, {Label: "after", Path: "/tmp/a"}}
	if !slices.Equal(cfg.Binaries, want) {
		t.Errorf("Binaries = %+v, want %+v", cfg.Binaries, want)
	}
	if !slices.Equal(cfg.Attacks, []string{"baseline", "large-requests"}) || cfg.Duration != 2*time.Second || cfg.Flooders != 3 ||
		cfg.LargeBytes != 1000 || cfg.RSSLimit != 512<<20 || !slices.Equal(cfg.RelayArgs, []string{"--a=1", "--b"}) || jsonOut != "r.json" {
		t.Errorf("parseAttack = %+v, %q: a flag did not reach the config", cfg, jsonOut)
	}
	if cfg, _, err := parseAttack(nil); err != nil || len(cfg.Binaries) != 1 || cfg.Binaries[0].Path != "" || len(cfg.Attacks) != len(loadtest.AttackNames) {
		t.Errorf("parseAttack(no flags) = %+v, %v: want one binary to build and every attack", cfg, err)
	}
	for _, args := range [][]string{
		{"--attacks", "baseline,nope"},
		{"--meshrelay", "a=/x,a=/y"},
		{"--meshrelay", "a="},
		{"--namespaces", "2"},
		{"--rss-limit-gib", "0"},
		{"extra"},
	} {
		if _, _, err := parseAttack(args); err == nil {
			t.Errorf("parseAttack(%q) = nil error, want one", args)
		}
	}
}
