package ledger

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"testing"
	"time"
)

func newHistory(t *testing.T, cfg HistoryConfig) *History[int] {
	t.Helper()
	h, err := NewHistory[int](cfg)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// TestHistoryRebuildsEveryVersion: under random churn, every kept version
// is rebuilt with exactly the content it had, its proofs verify against its
// root, and FirstWith agrees with a brute-force scan.
func TestHistoryRebuildsEveryVersion(t *testing.T) {
	for seed := range uint64(10) {
		r := rand.New(rand.NewPCG(seed, 13))
		hist := newHistory(t, DefaultHistoryConfig())
		model := randomModel(r, 100)
		names := make([]string, 0, len(model))
		for n := range model {
			names = append(names, n)
		}
		tree := build(model)
		var models []map[string]Hash
		var roots []Hash
		t0 := time.Unix(1e9, 0)
		for step := range 120 {
			b := tree.Edit()
			for range 1 + r.IntN(5) {
				n := names[r.IntN(len(names))]
				if r.IntN(4) == 0 {
					b.Delete(n)
					delete(model, n)
				} else {
					hv := h(fmt.Sprint(r.IntN(6)))
					b.Set(n, hv, step)
					model[n] = hv
				}
			}
			tree = b.Tree()
			at := t0.Add(time.Duration(step) * time.Second)
			order := Order{Session: StampAt(t0), At: StampAt(at)}
			v, _ := hist.Record(tree, at, order)
			if v.Root != tree.Root() || v.Order != order {
				t.Fatalf("Record returned root %v order %v, want %v and %v (a view seen again takes the later order)", v.Root, v.Order, tree.Root(), order)
			}
			if len(roots) == 0 || roots[len(roots)-1] != tree.Root() {
				models = append(models, maps.Clone(model))
				roots = append(roots, tree.Root())
			}
		}
		for i, root := range roots {
			if hist.indexLockedForTest(root) != i && !repeated(roots, i) {
				t.Fatalf("seed %d: version %d not found at its place", seed, i)
			}
			if repeated(roots, i) {
				continue // a root seen again later is looked up at its latest
			}
			got, err := hist.TreeAt(root)
			if err != nil {
				t.Fatalf("seed %d: TreeAt(version %d): %v", seed, i, err)
			}
			if c := contents(got); !maps.Equal(c, models[i]) {
				t.Fatalf("seed %d: TreeAt(version %d) = %v, want %v", seed, i, c, models[i])
			}
			for _, n := range names[:10] {
				p, err := hist.Prove(root, n)
				if err != nil {
					t.Fatal(err)
				}
				hv, ok, err := p.Verify(root)
				want, wantOK := models[i][n]
				if err != nil || ok != wantOK || hv != want {
					t.Fatalf("seed %d: version %d: proof of %q = %v, %v, %v; want %v, %v", seed, i, n, hv, ok, err, want, wantOK)
				}
			}
		}
		// Back walks every version, newest first, with its content, and
		// stops when asked.
		k := len(models) - 1
		hist.Back(len(models)+5, func(v Version, got Tree[int]) bool {
			if v.Root != roots[k] || got.Root() != roots[k] || !maps.Equal(contents(got), models[k]) {
				t.Fatalf("seed %d: Back at version %d = root %v, %v; want %v, %v", seed, k, got.Root(), contents(got), roots[k], models[k])
			}
			k--
			return true
		})
		if k != -1 {
			t.Fatalf("seed %d: Back walked %d versions, want %d", seed, len(models)-1-k, len(models))
		}
		walked := 0
		hist.Back(len(models), func(Version, Tree[int]) bool { walked++; return walked < 3 })
		if walked != 3 {
			t.Fatalf("seed %d: Back went on after fn returned false: %d calls, want 3", seed, walked)
		}
		// FirstWith against a scan of the models, for every name and hash.
		vs := hist.Versions()
		for _, n := range names {
			for c := range 6 {
				hv := h(fmt.Sprint(c))
				// The first version of the latest run holding hv.
				var want uint64
				for i := len(models) - 1; i >= 0; i-- {
					if models[i][n] == hv {
						want = vs[i].Seq
					} else if want != 0 {
						break
					}
				}
				if got, ok := hist.FirstWith(n, hv); got != want || ok != (want != 0) {
					t.Fatalf("seed %d: FirstWith(%q, %d) = %d, %v; want %d", seed, n, c, got, ok, want)
				}
			}
		}
	}
}

func repeated(roots []Hash, i int) bool {
	for _, r := range roots[i+1:] {
		if r == roots[i] {
			return true
		}
	}
	return false
}

func (h *History[V]) indexLockedForTest(root Hash) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.indexLocked(root)
}

// TestHistoryBounds: under long churn the History holds no more than its
// bounds, whichever is reached first, and what it dropped is reported as
// unknown rather than answered wrongly.
func TestHistoryBounds(t *testing.T) {
	tests := []struct {
		name         string
		cfg          HistoryConfig
		perStep      int // names changed per version
		wantVersions int
	}{
		{"count", HistoryConfig{MaxVersions: 50, MaxAge: time.Hour, MaxChanges: 1e6}, 1, 50},
		{"changes", HistoryConfig{MaxVersions: 1000, MaxAge: time.Hour, MaxChanges: 300}, 10, 31},
		{"age", HistoryConfig{MaxVersions: 1000, MaxAge: 20 * time.Second, MaxChanges: 1e6}, 1, 21},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			hist := newHistory(t, tt.cfg)
			tree := Tree[int]{}
			t0 := time.Unix(1e9, 0)
			var first Hash
			for step := range 10_000 {
				b := tree.Edit()
				for j := range tt.perStep {
					b.Set(fmt.Sprint("svc-", j), h(fmt.Sprint(step)), step)
				}
				tree = b.Tree()
				hist.Record(tree, t0.Add(time.Duration(step)*time.Second), Order{})
				if step == 0 {
					first = tree.Root()
				}
				if v, c := hist.Held(); v > tt.cfg.MaxVersions || c > tt.cfg.MaxChanges {
					t.Fatalf("step %d: holds %d versions, %d changes; bounds %d, %d", step, v, c, tt.cfg.MaxVersions, tt.cfg.MaxChanges)
				}
			}
			if v, _ := hist.Held(); v != tt.wantVersions {
				t.Fatalf("holds %d versions, want %d", v, tt.wantVersions)
			}
			if _, err := hist.TreeAt(first); !errors.Is(err, ErrUnknownVersion) {
				t.Fatalf("TreeAt(expired) err = %v, want ErrUnknownVersion", err)
			}
			vs := hist.Versions()
			if _, err := hist.TreeAt(vs[0].Root); err != nil {
				t.Fatalf("TreeAt(oldest kept): %v", err)
			}
		})
	}
}

func TestHistoryConfigValidated(t *testing.T) {
	for _, cfg := range []HistoryConfig{{}, {MaxVersions: 1, MaxAge: time.Second}, {MaxVersions: 1, MaxChanges: 1}} {
		if _, err := NewHistory[int](cfg); err == nil {
			t.Errorf("NewHistory(%+v) = nil error, want one", cfg)
		}
	}
}
