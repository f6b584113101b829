package envoy

import (
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"
)

// TestLightHoldsWhatFullHolds runs a light Envoy (with a DecodeCache)
// beside a full one on the same upstream through a sync, an endpoint
// change, a cluster removal and a reconnect: both hold the same names,
// versions, hashes and generations at every step, the light one no body,
// and neither records a violation.
// (TestViolations runs every protocol rule in light mode too.)
func TestLightHoldsWhatFullHolds(t *testing.T) {
	matrix(t, func(t *testing.T, p Protocol, kind string) {
		w := baseWorld()
		u := newUpstream(t, kind, w)
		full := newTestEnvoy(t, u.conn, p, func(c *Config) { c.Generation = generationOf })
		var mu sync.Mutex
		declared := map[string][]string{}
		light := newTestEnvoy(t, u.conn, p, func(c *Config) {
			c.Generation, c.Light, c.DecodeCache = generationOf, true, NewDecodeCache()
			c.OnEvent = func(ev Event) {
				if ev.Kind == Declared {
					mu.Lock()
					declared[ev.TypeURL] = append(declared[ev.TypeURL], ev.Names...)
					mu.Unlock()
				}
			}
		})
		// same waits until both hold the same (a SotW server may still be
		// sending one of them an unchanged type under a new version) and
		// fails with the difference if they do not within 10 s.
		same := func(step string) {
			t.Helper()
			var diff []string
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				if diff = lightDiff(full, light); len(diff) == 0 || time.Now().After(deadline) {
					break
				}
			}
			for _, d := range diff {
				t.Errorf("%s: %s", step, d)
			}
			noViolations(t, full)
			noViolations(t, light)
		}
		waitFor(t, full, "initial sync", synced(w))
		waitFor(t, light, "initial sync", synced(w))
		same("initial sync")

		w2 := w.clone()
		w2.clusters["c1"] = 9001
		u.set(w2)
		waitFor(t, full, "c1 on port 9001", func(v View) bool {
			h, ok := v.Get(EndpointType, "c1")
			return ok && portOf(t, h) == 9001
		})
		moved, _ := full.Resources(EndpointType)["c1"]
		waitFor(t, light, "c1 moved", func(v View) bool {
			h, ok := v.Get(EndpointType, "c1")
			return ok && h.Hash == moved.Hash
		})
		same("endpoint change")

		w3 := w2.clone()
		delete(w3.clusters, "c2")
		u.set(w3)
		waitFor(t, full, "c2 removed", synced(w3))
		waitFor(t, light, "c2 removed", synced(w3))
		same("cluster removal")

		u.stop()
		waitFor(t, light, "disconnected", func(v View) bool { return !v.Stats().Connected })
		u.start()
		for _, e := range []*Envoy{full, light} {
			waitFor(t, e, "reconnected", func(v View) bool {
				return v.Stats().Connected && v.Stats().Reconnects > 0 && synced(w3)(v)
			})
		}
		same("reconnect")
		// The declaration goes out with the new stream's first request,
		// which may follow its opening by a moment.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			mu.Lock()
			got := slices.Sorted(slices.Values(declared[ClusterType]))
			mu.Unlock()
			if slices.Equal(got, []string{"c1"}) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("light Envoy declared clusters %q on reconnect, want [c1]", got)
			}
		}
	})
}

// lightDiff lists how what light holds differs from what full holds
// (names, versions, hashes, generations; light has no bodies, full's
// hashes are of its bytes).
func lightDiff(full, light *Envoy) []string {
	var out []string
	for _, typeURL := range []string{ClusterType, EndpointType, ListenerType, RouteType} {
		f, l := full.Resources(typeURL), light.Resources(typeURL)
		if got, want := slices.Sorted(maps.Keys(l)), slices.Sorted(maps.Keys(f)); !slices.Equal(got, want) {
			out = append(out, fmt.Sprintf("light holds %s %q, full %q", short(typeURL), got, want))
			continue
		}
		for n, fh := range f {
			lh := l[n]
			if lh.Resource != nil {
				out = append(out, fmt.Sprintf("light %s %q has a body", short(typeURL), n))
			}
			if sum := contentHash(fh.Resource.GetValue()); fh.Hash != sum {
				out = append(out, fmt.Sprintf("full %s %q: Hash %x, want the hash of its bytes %x", short(typeURL), n, fh.Hash, sum))
			}
			if lh.Hash != fh.Hash || lh.Version != fh.Version || lh.Generation != fh.Generation {
				out = append(out, fmt.Sprintf("%s %q: light {%q %x %d}, full {%q %x %d}", short(typeURL), n,
					lh.Version, lh.Hash, lh.Generation, fh.Version, fh.Hash, fh.Generation))
			}
		}
	}
	return out
}
