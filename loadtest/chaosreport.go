package loadtest

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/validation"
)

// explain prints what a failing seed needs to be understood and rerun:
// the seed, its schedule, the first violating event (with the events
// before it) and every relay's log around it.
func (r *chaosRun) explain(h *validation.History, hv []validation.Violation, schedule []Fault, all []string) {
	w := r.out
	fmt.Fprintf(w, "\nseed %d FAILED: %d violations; rerun with: loadtest chaos --seed %d\n", r.seed, len(all), r.seed)
	fmt.Fprintf(w, "schedule:\n")
	for i, f := range schedule {
		fmt.Fprintf(w, "  %d. %s\n", i+1, f)
	}
	for _, v := range all[:min(len(all), 10)] {
		fmt.Fprintf(w, "  - %s\n", v)
	}
	var at time.Time
	switch ev := r.envoyViolations(); {
	case len(hv) > 0:
		first := hv[0]
		at = first.At
		fmt.Fprintf(w, "first violation: %s\n", first)
		for _, e := range h.Envoys {
			if e.ID != first.Envoy || first.Event < 0 || first.Event >= len(e.Events) {
				continue
			}
			for i := max(0, first.Event-5); i <= first.Event; i++ {
				fmt.Fprintf(w, "  event %d: %s\n", i, formatEvent(e.Events[i]))
			}
		}
	case len(ev) > 0:
		// Only a simulated Envoy's own check failed: its events up to the
		// response it refused to take as valid.
		first := ev[0]
		at = first.v.At
		fmt.Fprintf(w, "first violation: envoy %s at %s: %v\n", first.id, at.Format("15:04:05.000"), first.v)
		for _, e := range h.Envoys {
			if e.ID != first.id {
				continue
			}
			last := -1
			for i, x := range e.Events {
				if !x.At.After(at) {
					last = i
				}
			}
			for i := max(0, last-7); i <= min(last+2, len(e.Events)-1); i++ {
				fmt.Fprintf(w, "  event %d: %s\n", i, formatEvent(e.Events[i]))
			}
		}
	default:
		return
	}
	for i := range r.cfg.Relays {
		lines := logAround(filepath.Join(r.dir, fmt.Sprintf("relay-%d.log", i)), at, 3*time.Second, 25)
		fmt.Fprintf(w, "relay-%d log around %s (%d lines):\n", i, at.Format("15:04:05.000"), len(lines))
		for _, l := range lines {
			fmt.Fprintf(w, "  %s\n", l)
		}
	}
}

// envoyViolation is a violation a simulated Envoy's own checks found.
type envoyViolation struct {
	id string
	v  *envoy.Violation
}

// envoyViolations returns every simulated Envoy's violations, earliest
// first.
func (r *chaosRun) envoyViolations() []envoyViolation {
	var out []envoyViolation
	if r.fleet == nil {
		return nil
	}
	for _, e := range r.fleet.Envoys() {
		for _, err := range e.Violations() {
			var v *envoy.Violation
			if errors.As(err, &v) {
				out = append(out, envoyViolation{e.ID(), v})
			}
		}
	}
	slices.SortStableFunc(out, func(a, b envoyViolation) int { return a.v.At.Compare(b.v.At) })
	return out
}

func formatEvent(ev envoy.Event) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s %s nonce=%q version=%q", ev.At.Format("15:04:05.000"), ev.Kind, ev.TypeURL, ev.Nonce, ev.Version)
	if ev.ControlPlane != "" {
		fmt.Fprintf(&b, " from=%s", ev.ControlPlane)
	}
	for i, n := range ev.Names {
		if i == 8 {
			fmt.Fprintf(&b, " … (%d in all)", len(ev.Names))
			break
		}
		g := uint64(0)
		if i < len(ev.Generations) {
			g = ev.Generations[i]
		}
		fmt.Fprintf(&b, " %s@%d", n, g)
	}
	return b.String()
}

// logAround returns up to n lines of a JSON log (slog's "time" field)
// within d of at, those closest to at.
func logAround(path string, at time.Time, d time.Duration, n int) []string {
	f, err := os.Open(path)
	if err != nil {
		return []string{err.Error()}
	}
	defer f.Close()
	type line struct {
		text string
		dist time.Duration
	}
	var in []line
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var rec struct {
			Time time.Time `json:"time"`
		}
		if json.Unmarshal(sc.Bytes(), &rec) != nil || rec.Time.IsZero() {
			continue
		}
		dist := rec.Time.Sub(at)
		if dist < 0 {
			dist = -dist
		}
		if dist <= d {
			in = append(in, line{sc.Text(), dist})
		}
	}
	// Keep the n closest, in file order.
	for len(in) > n {
		far := 0
		for i := range in {
			if in[i].dist > in[far].dist {
				far = i
			}
		}
		in = append(in[:far], in[far+1:]...)
	}
	out := make([]string, len(in))
	for i, l := range in {
		out[i] = l.text
	}
	return out
}
