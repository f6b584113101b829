//go:debug randseednop=0

package sim

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	mathrand "math/rand"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/cryptotest"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

var (
	flagSeeds   = flag.Int("sim.seeds", 0, "run this many seeds, from -sim.first (0: the short default, fewer under -race)")
	flagFirst   = flag.Uint64("sim.first", 1, "the first seed -sim.seeds runs")
	flagSeed    = flag.Uint64("sim.seed", 0, "replay this one seed, printing its plan, event log and violations")
	flagLogs    = flag.Bool("sim.logs", false, "with -sim.seed: print the relays' logs (debug level) in the event log")
	flagTrace   = flag.Bool("sim.trace", false, "with -sim.seed: print every delivery of the network in the event log")
	flagWorkers = flag.Int("sim.workers", 0, "processes running seeds side by side (0: one per CPU, at most 4)")
	flagReplays = flag.Int("sim.replays", 0, "run every seed this many more times and compare the event logs (replay fidelity)")
	flagTries   = flag.Int("sim.tries", 1, "with -sim.seed: play the seed up to this many times, and print the first run that fails (a run does not always replay: see loadtest/README.md)")
	flagWant    = flag.String("sim.want", "", "with -sim.tries: stop at the first run with a violation that contains this text")
	flagWorker  = flag.Int("sim.worker", -1, "internal: the index of this worker process")
	flagUntil   = flag.Int64("sim.until", 0, "internal: a worker starts no seed after this time (Unix nanoseconds; 0: no bound)")

	// Wider than the default: the envelope the short run plays is not the
	// only one a fault can hide in.
	flagRelays = flag.Int("sim.relays", 0, "relays in the tier (0: DefaultConfig's)")
	flagEnvoys = flag.Int("sim.envoys", 0, "simulated Envoys (0: DefaultConfig's)")
	flagKeys   = flag.Int("sim.keys", 0, "aggregation keys the Envoys spread over (0: DefaultConfig's)")
	flagFaults = flag.Int("sim.faults", 0, "faults per seed (0: DefaultConfig's)")
	flagKinds  = flag.String("sim.kinds", "", "fault kinds drawn from, comma-separated (empty: every kind)")
)

// simConfig is DefaultConfig widened by the -sim.relays, -sim.envoys,
// -sim.keys, -sim.faults and -sim.kinds flags.
func simConfig() Config {
	cfg := DefaultConfig()
	if *flagRelays > 0 {
		cfg.Relays = *flagRelays
	}
	if *flagEnvoys > 0 {
		cfg.Envoys = *flagEnvoys
	}
	if *flagKeys > 0 {
		cfg.Keys = *flagKeys
	}
	if *flagFaults > 0 {
		cfg.Faults = *flagFaults
	}
	if *flagKinds != "" {
		cfg.Kinds = nil
		for _, k := range strings.Split(*flagKinds, ",") {
			kind := FaultKind(strings.TrimSpace(k))
			if !slices.Contains(AllFaults, kind) {
				panic(fmt.Sprintf("-sim.kinds: no fault kind %q (kinds: %v)", kind, AllFaults))
			}
			cfg.Kinds = append(cfg.Kinds, kind)
		}
	}
	return cfg
}

// widening returns the -sim flags that widen the run, those set: a worker
// process plays the run's seeds with them, and a seed's replay needs them
// (its plan is drawn from the configuration).
func widening() []string {
	var out []string
	for _, f := range []struct {
		name string
		n    int
	}{{"relays", *flagRelays}, {"envoys", *flagEnvoys}, {"keys", *flagKeys}, {"faults", *flagFaults}} {
		if f.n > 0 {
			out = append(out, fmt.Sprintf("-sim.%s=%d", f.name, f.n))
		}
	}
	if *flagKinds != "" {
		out = append(out, "-sim.kinds="+*flagKinds)
	}
	return out
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// defaultSeeds is the short form that `go test ./...` runs: about a
// minute on 2 cores (see loadtest/README.md, "loadtest sim").
func defaultSeeds() int {
	if raceEnabled {
		return 60
	}
	return 200
}

// runSeed plays one seed in a bubble of its own, with the process's global
// random sources (crypto/rand, which names ring members; math/rand, which
// memberlist draws from) seeded from it, so that a seed run among others
// and the same seed run alone start alike.
func runSeed(t *testing.T, cfg Config, seed uint64) *Result {
	var res *Result
	t.Run(fmt.Sprintf("seed-%d", seed), func(t *testing.T) {
		cryptotest.SetGlobalRandom(t, seed)
		mathrand.Seed(int64(seed))
		synctest.Test(t, func(*testing.T) { res = Run(cfg, seed) })
	})
	return res
}

// TestSim runs the simulation: the short default, -sim.seeds N seeds in
// worker processes, or one seed replayed (-sim.seed K).
func TestSim(t *testing.T) {
	if *flagWorker >= 0 {
		t.Skip("a worker runs TestSimWorker")
	}
	if *flagSeed > 0 {
		replay(t, *flagSeed)
		return
	}
	n := *flagSeeds
	if n == 0 {
		if testing.Short() {
			n = defaultSeeds() / 4
		} else {
			n = defaultSeeds()
		}
	}
	workers := *flagWorkers
	if workers == 0 {
		workers = min(runtime.NumCPU(), 4)
	}
	workers = max(1, min(workers, n))
	start := time.Now()
	results, cut := runWorkers(t, workers, *flagFirst, n)
	wall := time.Since(start)
	var failed []seedLine
	var sim time.Duration
	var cpu float64
	for _, r := range results {
		sim += r.Simulated
		cpu += r.Wall.Seconds()
		switch {
		case len(r.Violations) == 0 && r.Err == "":
		default:
			failed = append(failed, r)
		}
	}
	if cut && len(results) < n {
		t.Logf("the test's deadline stopped the run: %d of %d seeds played", len(results), n)
		if len(results) < min(n, minSeedsBeforeDeadline) {
			t.Errorf("only %d seeds played before the test's deadline, want at least %d: run with a longer -timeout", len(results), min(n, minSeedsBeforeDeadline))
		}
	}
	t.Logf("%d seeds (%d…%d) in %v on %d workers: %.0f seeds a minute, %.2f s a seed, %v simulated; %d failed",
		len(results), *flagFirst, *flagFirst+uint64(n)-1, wall.Round(time.Second), workers,
		float64(len(results))/wall.Minutes(), cpu/float64(max(1, len(results))), sim.Round(time.Second), len(failed))
	byRule := map[string][]uint64{}
	for _, r := range failed {
		for _, rule := range rules(append(r.Violations, r.Err)) {
			byRule[rule] = append(byRule[rule], r.Seed)
		}
	}
	for _, rule := range slices.Sorted(maps.Keys(byRule)) {
		seeds := byRule[rule]
		t.Logf("%-28s %3d seeds: %v", rule, len(seeds), seeds[:min(len(seeds), 20)])
	}
	if len(results) != n && !cut {
		t.Errorf("%d of %d seeds reported", len(results), n)
	}
	for _, r := range failed {
		t.Errorf("seed %d failed: %s\n  %s\n  replay: go test -run 'TestSim$' ./loadtest/sim/ -sim.seed=%d%s -v",
			r.Seed, r.Plan, strings.Join(firstN(append(r.Violations, r.Err), 5), "\n  "), r.Seed,
			strings.Join(append([]string{""}, widening()...), " "))
	}
	if *flagReplays > 0 {
		fidelity(t, results)
	}
}

func firstN(s []string, n int) []string {
	s = slices.DeleteFunc(s, func(x string) bool { return x == "" })
	if len(s) > n {
		return append(s[:n:n], fmt.Sprintf("… and %d more", len(s)-n))
	}
	return s
}

// seedLine is what a worker reports of a seed.
type seedLine struct {
	Seed       uint64
	Plan       string
	Violations []string
	Err        string
	Wall       time.Duration
	Simulated  time.Duration
	Deliveries uint64
	Changes    int
	// Replays: for each rerun, how many leading event log lines (and
	// whether all) matched the first run, and whether its violation rules
	// were the first run's.
	Lines   int
	Replays []replayLine
}

type replayLine struct {
	Same       int
	Identical  bool
	SameRules  bool
	Violations int
}

const resultPrefix = "SIMRESULT "

// deadlineReserve is how long before the test's deadline the workers start
// no more seeds: a seed under -race on a loaded machine takes tens of
// seconds.
const deadlineReserve = 2 * time.Minute

// minSeedsBeforeDeadline is how many seeds must have run when the deadline
// stops a run short.
const minSeedsBeforeDeadline = 10

// seedsPerProcess bounds the seeds one worker process plays, so that
// whatever one seed leaves behind (a goroutine the bubble did not own, a
// cache of a dependency) cannot grow with the run: a fresh process every
// few dozen seeds. (A stopped relay.Relay is collected:
// TestStoppedRelayIsCollected.)
const seedsPerProcess = 40

// runWorkers runs seeds first … first+n-1 in worker processes (the test
// binary again), workers at a time, each playing a few seeds one after
// another, and gathers their reports.
func runWorkers(t *testing.T, workers int, first uint64, n int) (_ []seedLine, cut bool) {
	// On a machine slower than the short form was sized for (a loaded CI
	// runner, -race) the workers stop starting seeds well before the
	// test's deadline, and the seeds played are checked; TestSim says how
	// many.
	var until int64
	if dl, ok := t.Deadline(); ok {
		until = dl.Add(-deadlineReserve).UnixNano()
	}
	var (
		mu     sync.Mutex
		out    []seedLine
		wg     sync.WaitGroup
		chunks = make(chan [2]int, (n+seedsPerProcess-1)/seedsPerProcess)
	)
	for i := 0; i < n; i += seedsPerProcess {
		chunks <- [2]int{i, min(seedsPerProcess, n-i)}
	}
	close(chunks)
	env := os.Environ()
	if os.Getenv("GOGC") == "" {
		env = append(env, "GOGC=200") // measured: a quarter less CPU a seed than 100
	}
	if os.Getenv("GOMAXPROCS") == "" && workers >= runtime.NumCPU() {
		env = append(env, "GOMAXPROCS=1") // a core each: the network delivers one thing at a time anyway
	}
	for range workers {
		wg.Go(func() {
			for c := range chunks {
				lines, err := runProcess(env, first+uint64(c[0]), c[1], until)
				mu.Lock()
				out = append(out, lines...)
				mu.Unlock()
				if err != nil {
					t.Errorf("worker for seeds %d…%d: %v", first+uint64(c[0]), first+uint64(c[0]+c[1]-1), err)
				}
			}
		})
	}
	wg.Wait()
	slices.SortFunc(out, func(a, b seedLine) int { return cmp.Compare(a.Seed, b.Seed) })
	return out, until > 0 && time.Now().UnixNano() > until
}

// runProcess plays seeds first … first+n-1 in a worker process, starting
// none after until (Unix nanoseconds; 0: no bound).
func runProcess(env []string, first uint64, n int, until int64) ([]seedLine, error) {
	args := append([]string{"-test.run=^TestSimWorker$", "-test.count=1", "-test.timeout=0",
		"-sim.worker=0", "-sim.workers=1", fmt.Sprintf("-sim.first=%d", first), fmt.Sprintf("-sim.seeds=%d", n),
		fmt.Sprintf("-sim.replays=%d", *flagReplays), fmt.Sprintf("-sim.until=%d", until)}, widening()...)
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	var out []seedLine
	var other []string
	sc := bufio.NewScanner(stdout)
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), resultPrefix)
		if !ok {
			other = append(other, sc.Text())
			continue
		}
		var r seedLine
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			return out, err
		}
		out = append(out, r)
	}
	if err := cmd.Wait(); err != nil {
		return out, fmt.Errorf("%w\n%s\n%s", err, strings.Join(other[max(0, len(other)-40):], "\n"), stderr.String())
	}
	return out, nil
}

// TestSimWorker is a worker process's part of TestSim: seeds first+w,
// first+w+workers, …, one after another, each reported on a line of its
// own.
func TestSimWorker(t *testing.T) {
	if *flagWorker < 0 {
		t.Skip("run by TestSim in a worker process")
	}
	cfg := simConfig()
	for i := *flagWorker; i < *flagSeeds; i += *flagWorkers {
		if *flagUntil > 0 && time.Now().UnixNano() > *flagUntil {
			break // the test's deadline is near: the seeds played are reported
		}
		seed := *flagFirst + uint64(i)
		start := time.Now()
		res := runSeed(t, cfg, seed)
		line := seedLine{Seed: seed, Plan: res.Plan.String(), Violations: res.Violations, Wall: time.Since(start),
			Simulated: res.Simulated, Deliveries: res.Deliveries, Changes: res.Changes, Lines: len(res.Log)}
		if res.Err != nil {
			line.Err = res.Err.Error()
		}
		for range *flagReplays {
			again := runSeed(t, cfg, seed)
			same := 0
			for same < len(res.Log) && same < len(again.Log) && res.Log[same] == again.Log[same] {
				same++
			}
			line.Replays = append(line.Replays, replayLine{
				Same: same, Identical: same == len(res.Log) && same == len(again.Log),
				SameRules: slices.Equal(rules(res.Violations), rules(again.Violations)), Violations: len(again.Violations),
			})
		}
		if os.Getenv("SIMHEAP") != "" {
			var ms runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&ms)
			fmt.Fprintf(os.Stderr, "seed %d: live heap %d MB, goroutines %d\n", seed, ms.HeapAlloc>>20, runtime.NumGoroutine())
		}
		b, err := json.Marshal(line)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("%s%s\n", resultPrefix, b)
	}
}

// rules are the distinct rules a seed's violations broke, sorted.
func rules(violations []string) []string {
	var out []string
	for _, v := range violations {
		if v == "" {
			continue
		}
		r, _, _ := strings.Cut(v, ":")
		if r == "envoy" { // "envoy: <node>: envoy: <rule> violation …"
			if _, after, ok := strings.Cut(v, ": envoy: "); ok {
				r, _, _ = strings.Cut(after, " violation")
				r = "envoy " + r
			}
		}
		if !slices.Contains(out, r) {
			out = append(out, r)
		}
	}
	slices.Sort(out)
	return out
}

// fidelity reports how often a seed's reruns replayed its first run.
func fidelity(t *testing.T, results []seedLine) {
	var runs, identical, sameRules, failing, failingSame int
	var prefix float64
	for _, r := range results {
		for _, rp := range r.Replays {
			runs++
			if rp.Identical {
				identical++
			}
			if rp.SameRules {
				sameRules++
			}
			if len(r.Violations) > 0 {
				failing++
				if rp.SameRules {
					failingSame++
				}
			}
			prefix += float64(rp.Same) / float64(max(1, r.Lines))
		}
	}
	t.Logf("replay fidelity over %d reruns of %d seeds: %d identical event logs (%.0f%%); mean identical prefix %.0f%% of the log; same violated rules %d (%.0f%%); of reruns of failing seeds, %d of %d found the same rules",
		runs, len(results), identical, 100*float64(identical)/float64(max(1, runs)), 100*prefix/float64(max(1, runs)),
		sameRules, 100*float64(sameRules)/float64(max(1, runs)), failingSame, failing)
}

// replay plays one seed and prints its event log.
func replay(t *testing.T, seed uint64) {
	var (
		mu    sync.Mutex
		extra []string // relay logs and network deliveries
		res   *Result
	)
	for try := 1; try <= max(1, *flagTries); try++ {
		cfg := simConfig()
		extra = nil
		add := func(s string) {
			mu.Lock()
			extra = append(extra, s)
			mu.Unlock()
		}
		if *flagLogs {
			cfg.Logger = slog.New(slog.NewTextHandler(lineWriter(add), &slog.HandlerOptions{Level: slog.LevelDebug}))
		}
		if *flagTrace {
			cfg.Trace = add
		}
		res = runSeed(t, cfg, seed)
		if res.Failed() && (*flagWant == "" || slices.ContainsFunc(res.Violations, func(v string) bool { return strings.Contains(v, *flagWant) })) {
			t.Logf("seed %d failed on try %d", seed, try)
			break
		}
	}
	for _, l := range res.Log {
		t.Log(l)
	}
	if len(extra) > 0 {
		t.Logf("--- relay logs and network deliveries (%d lines)", len(extra))
		for _, l := range extra {
			t.Log(l)
		}
	}
	t.Logf("%s: %d changes, %d deliveries, %v simulated", res.Plan, res.Changes, res.Deliveries, res.Simulated.Round(time.Millisecond))
	if res.Err != nil {
		t.Error(res.Err)
	}
	for _, v := range res.Violations {
		t.Error(v)
	}
}

// lineWriter hands every line written to add.
type lineWriter func(string)

func (w lineWriter) Write(p []byte) (int, error) {
	for _, l := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		w(l)
	}
	return len(p), nil
}
