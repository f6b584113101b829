package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/meshrelay/meshrelay/loadtest"
)

// attack runs loadtest.RunAttack: flags → DefaultAttackConfig → run →
// the table.
func attack(ctx context.Context, args []string) error {
	cfg, jsonOut, err := parseAttack(args)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "loadtest-attack-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	cfg.Dir = dir
	for i, b := range cfg.Binaries {
		if b.Path == "" { // build this checkout's
			if cfg.Binaries[i].Path, err = loadtest.BuildMeshrelay(ctx, dir, os.Stderr); err != nil {
				return err
			}
		}
	}
	fmt.Printf("loadtest attack %s\n\n", strings.Join(args, " "))
	rep, err := loadtest.RunAttack(ctx, cfg, os.Stdout)
	if rep != nil {
		fmt.Printf("\nmachine: %s, memory %.1f GiB; each attack %s\n\n", rep.Machine, float64(rep.MemTotal)/(1<<30), rep.Duration)
		rep.WriteTable(os.Stdout)
		err = errors.Join(err, writeJSON(jsonOut, rep))
	}
	return err
}

// parseAttack parses attack's flags into a config (its Dir unset) and the
// --json path.
func parseAttack(args []string) (loadtest.AttackConfig, string, error) {
	cfg := loadtest.DefaultAttackConfig()
	fs := newFlagSet("attack")
	bins := fs.String("meshrelay", "", "meshrelay binaries to attack, each a PATH or LABEL=PATH, comma-separated, run one after another (before=/tmp/old,after=/tmp/new); default: go build ./cmd/meshrelay")
	attacks := fs.String("attacks", strings.Join(loadtest.AttackNames, ","), "rows to run, comma-separated, in this order")
	fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "how long each attack (and the good client) runs, against a fresh relay")
	fs.DurationVar(&cfg.GoodInterval, "good-interval", cfg.GoodInterval, "the good client opens a new connection and stream this often")
	fs.DurationVar(&cfg.GoodTimeout, "good-timeout", cfg.GoodTimeout, "bound on one good stream's admission (past it: a failed attempt)")
	fs.IntVar(&cfg.Flooders, "flooders", cfg.Flooders, "goroutines of each flood")
	fs.IntVar(&cfg.LargeStreams, "large-streams", cfg.LargeStreams, "parallel streams sending large requests (and the million names)")
	fs.IntVar(&cfg.LargeBytes, "large-bytes", 0, "size of a large request; 0: just under the binary's receive limit (--max-request-bytes, or --max-msg-size where it has none), at most --large-cap")
	fs.IntVar(&cfg.LargeCap, "large-cap", cfg.LargeCap, "largest large request, bytes")
	fs.IntVar(&cfg.LargeEntries, "large-entries", cfg.LargeEntries, "initial_resource_versions a large request declares (versions padded to its size)")
	fs.IntVar(&cfg.MillionNames, "million-names", cfg.MillionNames, "names the million-names request subscribes to")
	fs.IntVar(&cfg.Handshakes, "handshakes", cfg.Handshakes, "the handshakes row's streams, each a new TLS connection and token")
	fs.IntVar(&cfg.HandshakeConcurrency, "handshake-concurrency", cfg.HandshakeConcurrency, "handshakes at once")
	rssGiB := fs.Float64("rss-limit-gib", float64(cfg.RSSLimit)/(1<<30), "kill the relay and stop the attack past this RSS")
	fs.IntVar(&cfg.Scenario.Services, "services", cfg.Scenario.Services, "ServiceEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Endpoints, "endpoints", cfg.Scenario.Endpoints, "WorkloadEntries in the synthetic upstream")
	fs.IntVar(&cfg.Scenario.Namespaces, "namespaces", cfg.Scenario.Namespaces, "namespaces (at least 3)")
	relayArgs := fs.String("relay-args", "", "extra flags of every relay's meshrelay serve, space-separated")
	relayLog := fs.Bool("relay-log", false, "show the relays' stderr")
	jsonOut := fs.String("json", "", "also write the report as JSON to this file")
	if err := fs.Parse(args); err != nil {
		return cfg, "", err
	}
	if fs.NArg() > 0 {
		return cfg, "", fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var err error
	if cfg.Binaries, err = parseBinaries(*bins); err != nil {
		return cfg, "", err
	}
	cfg.Attacks = splitList(*attacks)
	for _, a := range cfg.Attacks {
		if !slices.Contains(loadtest.AttackNames, a) {
			return cfg, "", fmt.Errorf("--attacks: unknown %q (want %s)", a, strings.Join(loadtest.AttackNames, ", "))
		}
	}
	if *rssGiB <= 0 {
		return cfg, "", fmt.Errorf("--rss-limit-gib %v: want more than 0", *rssGiB)
	}
	cfg.RSSLimit = uint64(*rssGiB * (1 << 30))
	if cfg.Scenario.Namespaces < 3 {
		return cfg, "", fmt.Errorf("--namespaces %d: want at least 3 (the good client, the flood and the large requests are apart)", cfg.Scenario.Namespaces)
	}
	cfg.RelayArgs = strings.Fields(*relayArgs)
	if *relayLog {
		cfg.RelayLog = os.Stderr
	}
	return cfg, *jsonOut, nil
}

// parseBinaries parses --meshrelay: PATH or LABEL=PATH, comma-separated;
// a bare PATH is labelled by its position ("1", "2", …), "" is one binary
// to build (label "this").
func parseBinaries(s string) ([]loadtest.AttackBinary, error) {
	if strings.TrimSpace(s) == "" {
		return []loadtest.AttackBinary{{Label: "this"}}, nil
	}
	var out []loadtest.AttackBinary
	for i, f := range splitList(s) {
		label, path, ok := strings.Cut(f, "=")
		if !ok {
			label, path = fmt.Sprint(i+1), f
		}
		if label == "" || path == "" {
			return nil, fmt.Errorf("--meshrelay %q: want PATH or LABEL=PATH", f)
		}
		for _, b := range out {
			if b.Label == label {
				return nil, fmt.Errorf("--meshrelay: label %q twice", label)
			}
		}
		out = append(out, loadtest.AttackBinary{Label: label, Path: path})
	}
	return out, nil
}
