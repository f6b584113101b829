package ledger

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

const (
	cds = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
)

// fixture is one relay's Tracker with the histories of its keys.
type fixture struct {
	t     *testing.T
	tr    *Tracker
	hists map[string]*History[int] // by key|type
	views map[string]map[string]Hash
	now   time.Time

	mu        sync.Mutex
	converged []time.Duration
}

func newFixture(t *testing.T, relay string) *fixture {
	t.Helper()
	f := &fixture{t: t, hists: map[string]*History[int]{}, views: map[string]map[string]Hash{}, now: time.Unix(1_700_000_000, 0)}
	cfg := DefaultTrackerConfig()
	cfg.Relay = relay
	cfg.Converged = func(_ string, d time.Duration) {
		f.mu.Lock()
		f.converged = append(f.converged, d)
		f.mu.Unlock()
	}
	tr, err := NewTracker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	f.tr = tr
	return f
}

func (f *fixture) tick() time.Time { f.now = f.now.Add(time.Second); return f.now }

// record makes key's view of typeURL hold pairs (name → content label).
func (f *fixture) record(key, typeURL string, pairs map[string]string) Hash {
	id := key + "|" + typeURL
	hist := f.hists[id]
	if hist == nil {
		hist = newHistory(f.t, DefaultHistoryConfig())
		f.hists[id] = hist
	}
	m := map[string]Hash{}
	for n, c := range pairs {
		m[n] = h(c)
	}
	f.views[id] = m
	v, _ := hist.Record(build(m), f.tick(), Order{})
	f.tr.Recorded(key, typeURL, hist, v)
	return v.Root
}

// sync sends e the key's current view of typeURL (answered or not).
func (f *fixture) sync(e *Envoy, key, typeURL string) Hash {
	root := f.hists[key+"|"+typeURL].Current().Root
	e.Sent(typeURL, f.tick())
	e.Synced(typeURL, root, f.now)
	return root
}

func (f *fixture) ack(e *Envoy, typeURL string) {
	e.Answered(typeURL, Answer{Version: "v", Latest: true, At: f.tick()})
}
func (f *fixture) nack(e *Envoy, typeURL, detail string) {
	e.Answered(typeURL, Answer{Version: "v", Detail: detail, Latest: true, At: f.tick()})
}

// TestTrackerAnswers: Envoys of every kind (current, NACKing, silent, never
// sent, gone) give exactly the expected convergence, stragglers, NACK rows
// and delivery answers.
func TestTrackerAnswers(t *testing.T) {
	f := newFixture(t, "relay-a")
	f.record("k1", cds, map[string]string{"a": "1", "b": "1"})
	f.record("k1", eds, map[string]string{"a": "1"})
	f.tr.SetSource("k1", SourceUpstream, false)
	envoys := map[string]*Envoy{}
	for _, n := range []string{"e1", "e2", "e3", "e4", "e5", "e6"} {
		envoys[n] = f.tr.Connect(n, "k1", f.tick())
		envoys[n].Subscribe(cds)
		envoys[n].Subscribe(eds)
	}
	for _, n := range []string{"e1", "e2", "e3", "e5", "e6"} {
		f.sync(envoys[n], "k1", cds)
		f.sync(envoys[n], "k1", eds)
		f.ack(envoys[n], eds)
	}
	f.ack(envoys["e1"], cds)
	f.ack(envoys["e5"], cds)
	f.nack(envoys["e2"], cds, `Proto constraint validation failed: name: "outbound|80||a.ns.svc" at 10.0.0.1:80 (line 12)`)
	f.nack(envoys["e6"], cds, `Proto constraint validation failed:   name: "outbound|80||b.ns.svc" at 10.9.8.7:8080 (line 3)`)
	// e3 never answers CDS; e4 is sent nothing; e5 goes away.
	envoys["e5"].Disconnect(f.tick())

	if got, want := f.tr.Convergence(Scope{}, f.now), (Convergence{Envoys: 6, Current: 1}); got != want {
		t.Fatalf("Convergence() = %+v, want %+v", got, want)
	}
	sum := f.tr.Summary(Scope{}, f.now, Full)
	if got := sum.Convergence(); got != (Convergence{Envoys: 6, Current: 1}) {
		t.Fatalf("Summary().Convergence() = %+v", got)
	}
	want := map[string]Reason{"e2": NACKed, "e3": NotACKed, "e4": NotSent, "e5": NotConnected, "e6": NACKed}
	checkStragglers(t, sum.Stragglers(0), want)

	rows := f.tr.NACKs()
	if len(rows) != 1 || rows[0].Envoys != 2 || rows[0].Type != cds {
		t.Fatalf("NACKs() = %+v, want one CDS row of 2 Envoys", rows)
	}
	if e2 := stragglerOf(sum.Stragglers(0), "e2"); e2.NACK.Fingerprint != rows[0].Fingerprint {
		t.Fatalf("e2's NACK fingerprint %s, row %s", e2.NACK.Fingerprint, rows[0].Fingerprint)
	}

	// A new version of b: e1 is behind until it ACKs it.
	f.record("k1", cds, map[string]string{"a": "1", "b": "2"})
	if got := f.tr.Convergence(Scope{}, f.now); got.Current != 0 {
		t.Fatalf("after a new version Convergence() = %+v, want none current", got)
	}
	d, err := f.tr.Delivery(Scope{}, cds, "b", h("2"), f.now)
	if err != nil {
		t.Fatal(err)
	}
	if env, del, known := d.Counts(); env != 6 || del != 0 || !known {
		t.Fatalf("Delivery(b@2) before any ACK = %d/%d known %v, want 0/6 known", del, env, known)
	}
	f.sync(envoys["e1"], "k1", cds)
	f.ack(envoys["e1"], cds)
	// e2 fixes itself on the new version (its NACK clears).
	f.sync(envoys["e2"], "k1", cds)
	f.ack(envoys["e2"], cds)
	if got := f.tr.Convergence(Scope{}, f.now); got != (Convergence{Envoys: 6, Current: 2}) {
		t.Fatalf("Convergence() = %+v, want 2 of 6", got)
	}
	if rows := f.tr.NACKs(); len(rows) != 1 || rows[0].Envoys != 1 {
		t.Fatalf("NACKs() after e2's ACK = %+v, want one row of 1 Envoy", rows)
	}
	d, err = f.tr.Delivery(Scope{}, cds, "b", h("2"), f.now)
	if err != nil {
		t.Fatal(err)
	}
	if env, del, _ := d.Counts(); env != 6 || del != 2 || d.Done() {
		t.Fatalf("Delivery(b@2) = %d/%d done %v, want 2/6 not done", del, env, d.Done())
	}
	missing := map[string]Reason{}
	for _, s := range d.Keys[0].Missing {
		missing[s.Node] = s.Reason
	}
	wantMissing := map[string]Reason{"e3": NotACKed, "e4": NotSent, "e5": NotConnected, "e6": NACKed}
	if !maps.Equal(missing, wantMissing) {
		t.Fatalf("Delivery missing = %v, want %v", missing, wantMissing)
	}
	// a@1 is older content every Envoy that ACKed any version holds: the
	// ones that ACKed CDS at all.
	d, err = f.tr.Delivery(Scope{}, cds, "a", h("1"), f.now)
	if err != nil {
		t.Fatal(err)
	}
	if _, del, _ := d.Counts(); del != 3 { // e1, e2 (v2) and e5 (v1, gone but it ACKed)
		t.Fatalf("Delivery(a@1) delivered %d, want 3", del)
	}
	// A resource the view does not hold concerns nobody.
	if d, _ := f.tr.Delivery(Scope{}, cds, "zz", h("1"), f.now); len(d.Keys) != 0 {
		t.Fatalf("Delivery(absent name) keys = %+v, want none", d.Keys)
	}

	f.mu.Lock()
	n := len(f.converged)
	f.mu.Unlock()
	// ACKs of a version: e1,e2,e3,e5,e6 EDS v1; e1,e5 CDS v1; e1,e2 CDS v2.
	if n != 9 {
		t.Fatalf("Converged observed %d times, want 9", n)
	}

	// Forgotten after ForgetAfter.
	later := f.now.Add(DefaultTrackerConfig().ForgetAfter + time.Second)
	if got := f.tr.Summary(Scope{}, later, Full).Convergence(); got.Envoys != 5 {
		t.Fatalf("after ForgetAfter: %d Envoys, want 5", got.Envoys)
	}
}

func stragglerOf(ss []Straggler, node string) Straggler {
	for _, s := range ss {
		if s.Node == node {
			return s
		}
	}
	return Straggler{}
}

func checkStragglers(t *testing.T, got []Straggler, want map[string]Reason) {
	t.Helper()
	m := map[string]Reason{}
	for _, s := range got {
		m[s.Node] = s.Reason
	}
	if !maps.Equal(m, want) {
		t.Fatalf("stragglers = %v, want %v", m, want)
	}
}

// TestTierMerge: three relays; the key's owner is the reference, an Envoy
// on a relay whose view lags is behind with a stale source, and an Envoy
// that moved counts once, where it is connected.
func TestTierMerge(t *testing.T) {
	owner, peer, other := newFixture(t, "relay-0"), newFixture(t, "relay-1"), newFixture(t, "relay-2")
	v1 := map[string]string{"a": "1"}
	v2 := map[string]string{"a": "2"}
	owner.record("k", cds, v1)
	owner.record("k", cds, v2)
	owner.tr.SetSource("k", SourceUpstream, false)
	peer.record("k", cds, v1) // it has not received v2 yet
	other.record("k", cds, v2)

	on := func(f *fixture, node string) *Envoy {
		e := f.tr.Connect(node, "k", f.tick())
		f.sync(e, "k", cds)
		f.ack(e, cds)
		return e
	}
	on(owner, "o1")
	on(peer, "p1")
	on(other, "x1")
	// "m" was on the peer, left, and is now on the other relay.
	m := on(peer, "m")
	m.Disconnect(peer.tick())
	on(other, "m")

	rep := Merge(owner.tr.Summary(Scope{}, owner.now, Full), peer.tr.Summary(Scope{}, peer.now, Full), other.tr.Summary(Scope{}, other.now, Full))
	if got := rep.Convergence(); got != (Convergence{Envoys: 4, Current: 3}) {
		t.Fatalf("tier Convergence() = %+v, want 3 of 4", got)
	}
	checkStragglers(t, rep.Stragglers(0), map[string]Reason{"p1": StaleSource})
	byRelay := rep.ByRelay()
	if byRelay["relay-1"] != (Convergence{Envoys: 1, Current: 0}) || byRelay["relay-2"] != (Convergence{Envoys: 2, Current: 2}) {
		t.Fatalf("ByRelay() = %v", byRelay)
	}
	if ref, _ := rep.Reference("k", cds); ref.Root != build(map[string]Hash{"a": h("2")}).Root() {
		t.Fatalf("Reference = %v, want v2", ref.Root)
	}
	// Ledger versions are content: the owner and the relay-2, holding the
	// same views, agree; the lagging peer does not; an Envoy on the
	// current version ACKed the key's ledger version.
	ko, kp, kx := owner.tr.Summary(Scope{}, owner.now, Full).Keys[0], peer.tr.Summary(Scope{}, peer.now, Full).Keys[0], other.tr.Summary(Scope{}, other.now, Full).Keys[0]
	if ko.LedgerVersion() != kx.LedgerVersion() || ko.LedgerVersion() == kp.LedgerVersion() {
		t.Fatalf("ledger versions: owner %v, relay-2 %v (want equal), peer %v (want different)", ko.LedgerVersion(), kx.LedgerVersion(), kp.LedgerVersion())
	}
	for _, e := range ko.Envoys {
		if e.LedgerVersion() != ko.LedgerVersion() {
			t.Fatalf("Envoy %s ACKed ledger version %v, key's is %v", e.Node, e.LedgerVersion(), ko.LedgerVersion())
		}
	}
	// On the peer alone, its Envoy is on its relay's current version.
	if got := peer.tr.Convergence(Scope{}, peer.now); got != (Convergence{Envoys: 2, Current: 1}) {
		t.Fatalf("peer Convergence() = %+v, want 1 of 2 (m is not connected there)", got)
	}

	// Delivery of a@2 across the tier: the peer does not know it.
	var vs []Verdicts
	for _, f := range []*fixture{owner, peer, other} {
		v, err := f.tr.Verdicts(Scope{}, cds, "a", h("2"))
		if err != nil {
			t.Fatal(err)
		}
		vs = append(vs, v...)
	}
	all := rep.Delivery(cds, "a", h("2"), vs)
	if env, del, known := all.Counts(); env != 4 || del != 3 || !known {
		// o1, x1 and m (on relay-2) have it; p1's relay has not received it.
		t.Fatalf("tier Delivery(a@2) = %d/%d known %v, want 3/4 known", del, env, known)
	}
	checkStragglers(t, all.Keys[0].Missing, map[string]Reason{"p1": StaleSource})
}

// TestWait: Wait returns once the share is reached, and with the stragglers
// when its deadline passes first.
func TestWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, "r")
		f.record("k", cds, map[string]string{"a": "1"})
		e1 := f.tr.Connect("e1", "k", time.Now())
		e2 := f.tr.Connect("e2", "k", time.Now())
		for _, e := range []*Envoy{e1, e2} {
			e.Sent(cds, time.Now())
			e.Synced(cds, f.hists["k|"+cds].Current().Root, time.Now())
		}

		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		c, ss, err := f.tr.Wait(ctx, Scope{}, 1)
		if err == nil || c != (Convergence{Envoys: 2}) || len(ss) != 2 {
			t.Fatalf("Wait before ACKs = %+v, %v, %v; want a deadline error, 0 of 2 and 2 stragglers", c, ss, err)
		}

		done := make(chan Convergence, 1)
		go func() {
			c, _, err := f.tr.Wait(context.Background(), Scope{Key: "k"}, 1)
			if err != nil {
				t.Error(err)
			}
			done <- c
		}()
		synctest.Wait() // the waiter is blocked
		e1.Answered(cds, Answer{Version: "v", Latest: true, At: time.Now()})
		synctest.Wait()
		select {
		case c := <-done:
			t.Fatalf("Wait returned %+v at 1 of 2", c)
		default:
		}
		e2.Answered(cds, Answer{Version: "v", Latest: true, At: time.Now()})
		if c := <-done; c != (Convergence{Envoys: 2, Current: 2}) {
			t.Fatalf("Wait = %+v, want 2 of 2", c)
		}
		if _, _, err := f.tr.Wait(context.Background(), Scope{}, 0); err != ErrBadShare {
			t.Fatalf("Wait(share 0) err = %v, want ErrBadShare", err)
		}
	})
}

// TestConvergenceFastPathAgrees: the Tracker's Convergence agrees with the
// one built from its Summary under random operations.
func TestConvergenceFastPathAgrees(t *testing.T) {
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 17))
		f := newFixture(t, "r")
		keys := []string{"k0", "k1", "k2"}
		types := []string{cds, eds}
		for _, k := range keys {
			for _, ty := range types {
				f.record(k, ty, map[string]string{"a": "0"})
			}
		}
		var es []*Envoy
		for step := range 400 {
			switch op := r.IntN(10); {
			case op == 0 || len(es) == 0:
				e := f.tr.Connect(fmt.Sprint("n", r.IntN(30)), keys[r.IntN(3)], f.tick())
				es = append(es, e)
			case op == 1:
				f.record(keys[r.IntN(3)], types[r.IntN(2)], map[string]string{"a": fmt.Sprint(step)})
			case op == 2:
				es[r.IntN(len(es))].Disconnect(f.tick())
			case op < 6:
				e := es[r.IntN(len(es))]
				f.sync(e, e.k.key, types[r.IntN(2)])
			case op < 9:
				f.ack(es[r.IntN(len(es))], types[r.IntN(2)])
			default:
				f.nack(es[r.IntN(len(es))], types[r.IntN(2)], "bad")
			}
			if fast, slow := f.tr.Convergence(Scope{}, f.now), f.tr.Summary(Scope{}, f.now, Full).Convergence(); fast != slow {
				t.Fatalf("seed %d step %d: Convergence() = %+v, Summary().Convergence() = %+v", seed, step, fast, slow)
			}
		}
		// NACK rows count exactly the Envoys that hold a NACK now.
		holding := 0
		for _, k := range keys {
			for _, es := range f.tr.Summary(Scope{Key: k}, f.now, Full).Keys {
				for _, e := range es.Envoys {
					for _, et := range e.Types {
						if et.NACK != nil {
							holding++
						}
					}
				}
			}
		}
		total := 0
		for _, row := range f.tr.NACKs() {
			total += row.Envoys
		}
		if total != holding {
			t.Fatalf("seed %d: NACK rows count %d Envoys, %d hold one", seed, total, holding)
		}
	}
}

// TestBriefAnswersAsFull: a tier's Brief summaries, merged, give the
// answers its Full ones give (convergence by key and relay, stragglers,
// every Envoy's status of every type, delivery), under random operations
// on two relays that see the same nodes and now and then differ in
// content; only a stale-source straggler's Since may differ. And Brief is
// brief: the settled Envoys of a key share one Types slice with no times.
func TestBriefAnswersAsFull(t *testing.T) {
	keys := []string{"k0", "k1"}
	types := []string{cds, eds}
	briefed := 0
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 23))
		relays := []*fixture{newFixture(t, "a"), newFixture(t, "b")}
		relays[0].tr.SetSource("k0", SourceUpstream, false)
		relays[1].tr.SetSource("k1", SourceUpstream, false)
		for _, f := range relays {
			for _, k := range keys {
				for _, ty := range types {
					f.record(k, ty, map[string]string{"a": "0"})
				}
			}
		}
		var es []*Envoy
		for step := range 300 {
			f := relays[r.IntN(2)]
			switch op := r.IntN(12); {
			case op == 0 || len(es) == 0:
				es = append(es, f.tr.Connect(fmt.Sprint("n", r.IntN(20)), keys[r.IntN(2)], f.tick()))
			case op == 1:
				// Mostly the same content on both relays, now and then
				// not: the relay that lags serves stale-source stragglers.
				k, ty, c := keys[r.IntN(2)], types[r.IntN(2)], fmt.Sprint(step)
				for _, g := range relays {
					if g == f || r.IntN(4) > 0 {
						g.record(k, ty, map[string]string{"a": c})
					}
				}
			case op == 2:
				es[r.IntN(len(es))].Disconnect(f.tick())
			case op < 7:
				e := es[r.IntN(len(es))]
				fe := relays[0]
				if e.t == relays[1].tr {
					fe = relays[1]
				}
				fe.sync(e, e.k.key, types[r.IntN(2)])
			case op < 11:
				e := es[r.IntN(len(es))]
				e.Answered(types[r.IntN(2)], Answer{Version: "v", Latest: true, At: f.tick()})
			default:
				f.nack(es[r.IntN(len(es))], types[r.IntN(2)], "bad")
			}
			if step%5 != 0 {
				continue
			}
			var full, brief []*Summary
			for _, g := range relays {
				full = append(full, g.tr.Summary(Scope{}, g.now, Full))
				b := g.tr.Summary(Scope{}, g.now, Brief)
				brief = append(brief, b)
				briefed += countBrief(t, b)
			}
			checkSameAnswers(t, fmt.Sprintf("seed %d step %d", seed, step), Merge(full...), Merge(brief...), relays)
		}
	}
	if briefed == 0 {
		t.Fatal("no Brief summary gave an Envoy in brief")
	}
}

// countBrief returns how many of s's Envoys are given in brief, checking
// that those of one key and set of types share one Types slice.
func countBrief(t *testing.T, s *Summary) int {
	t.Helper()
	n := 0
	for _, ks := range s.Keys {
		shared := map[string]*EnvoyType{}
		for _, e := range ks.Envoys {
			if len(e.Types) == 0 || !e.Types[0].SentAt.IsZero() || e.Types[0].Acked.IsZero() {
				continue // in full: every type sent has its time
			}
			n++
			id := fmt.Sprint(len(e.Types), e.Types[0].Type)
			if p, ok := shared[id]; ok && p != &e.Types[0] {
				t.Fatalf("key %s: Envoys in brief with the same types do not share them", ks.Key)
			}
			shared[id] = &e.Types[0]
		}
	}
	return n
}

func checkSameAnswers(t *testing.T, at string, full, brief *Report, relays []*fixture) {
	t.Helper()
	if f, b := full.Convergence(), brief.Convergence(); f != b {
		t.Fatalf("%s: Convergence: Full %+v, Brief %+v", at, f, b)
	}
	if f, b := full.ByKey(), brief.ByKey(); !maps.Equal(f, b) {
		t.Fatalf("%s: ByKey: Full %v, Brief %v", at, f, b)
	}
	if f, b := full.ByRelay(), brief.ByRelay(); !maps.Equal(f, b) {
		t.Fatalf("%s: ByRelay: Full %v, Brief %v", at, f, b)
	}
	fs, bs := full.Stragglers(0), brief.Stragglers(0)
	if len(fs) != len(bs) {
		t.Fatalf("%s: %d stragglers from Full, %d from Brief", at, len(fs), len(bs))
	}
	for i := range fs {
		if fs[i].Reason == StaleSource {
			fs[i].Since, bs[i].Since = time.Time{}, time.Time{}
		}
		if !reflect.DeepEqual(fs[i], bs[i]) {
			t.Fatalf("%s: straggler from Full %+v, from Brief %+v", at, fs[i], bs[i])
		}
	}
	fe, be := full.Envoys(), brief.Envoys()
	if len(fe) != len(be) {
		t.Fatalf("%s: %d Envoys from Full, %d from Brief", at, len(fe), len(be))
	}
	for i := range fe {
		if fe[i].State.Node != be[i].State.Node || len(fe[i].State.Types) != len(be[i].State.Types) {
			t.Fatalf("%s: Envoy %d: Full %+v, Brief %+v", at, i, fe[i].State, be[i].State)
		}
		for j, et := range fe[i].State.Types {
			if f, b := full.Status(fe[i], et), brief.Status(be[i], be[i].State.Types[j]); f != b {
				t.Fatalf("%s: %s's %s: Full %s, Brief %s", at, fe[i].State.Node, et.Type, f, b)
			}
		}
	}
	for _, ty := range []string{cds, eds} {
		var vs []Verdicts
		for _, g := range relays {
			v, err := g.tr.Verdicts(Scope{}, ty, "a", h("0"))
			if err != nil {
				t.Fatal(err)
			}
			vs = append(vs, v...)
		}
		f, b := full.Delivery(ty, "a", h("0"), vs), brief.Delivery(ty, "a", h("0"), vs)
		for _, d := range []*Delivery{f, b} {
			for _, k := range d.Keys {
				for i := range k.Missing {
					if k.Missing[i].Reason == StaleSource {
						k.Missing[i].Since = time.Time{}
					}
				}
			}
		}
		if !reflect.DeepEqual(f, b) {
			t.Fatalf("%s: Delivery of %s: Full %+v, Brief %+v", at, ty, f, b)
		}
	}
}

func TestNormalizeNACK(t *testing.T) {
	tests := []struct{ a, b string }{
		{`cluster "outbound|80||a" bad at 10.0.0.1:80`, `cluster "outbound|80||b" bad at 192.168.1.2:9090`},
		{"version 3fa2c9e1d0 rejected 12 times", "version 77aa00bbcc rejected 3 times"},
		{"a  b\n c", "a b c"},
	}
	for _, tt := range tests {
		if na, nb := NormalizeNACK(tt.a), NormalizeNACK(tt.b); na != nb {
			t.Errorf("NormalizeNACK(%q) = %q, NormalizeNACK(%q) = %q; want equal", tt.a, na, tt.b, nb)
		}
	}
	if FingerprintOf(cds, "x") == FingerprintOf(eds, "x") {
		t.Error("the same text of two types has one fingerprint")
	}
	if got := slices.Sorted(maps.Keys(map[string]int{})); len(got) != 0 {
		t.Fatal(got)
	}
}

// TestTrackerForgetsUnderChurn: pods replaced for hours (every stream ends
// and a new node connects) with nobody asking a query: the ledger holds no
// more than the Envoys connected and those gone for less than ForgetAfter,
// and its NACK rows count only those.
func TestTrackerForgetsUnderChurn(t *testing.T) {
	f := newFixture(t, "r")
	f.record("k0", cds, map[string]string{"a": "1"})
	f.record("k1", cds, map[string]string{"a": "1"})
	const live = 50
	forget := DefaultTrackerConfig().ForgetAfter
	var es []*Envoy
	for i := range 20_000 {
		key := fmt.Sprint("k", i%2)
		e := f.tr.Connect(fmt.Sprint("pod-", i), key, f.now)
		f.sync(e, key, cds)
		f.nack(e, cds, fmt.Sprintf("cluster %d rejected", i))
		es = append(es, e)
		if len(es) > live {
			es[0].Disconnect(f.now)
			es = es[1:]
		}
		// One connection a second.
		if nodes, envoys := f.held(); nodes > live+int(forget/time.Second)+2 || envoys != nodes {
			t.Fatalf("after %d pods: %d nodes and %d Envoys held, want at most %d", i+1, nodes, envoys, live+int(forget/time.Second)+2)
		}
	}
	total := 0
	for _, row := range f.tr.NACKs() {
		total += row.Envoys
	}
	if nodes, _ := f.held(); total != nodes {
		t.Fatalf("NACK rows count %d Envoys, %d are held", total, nodes)
	}
}

// held returns the node ids and Envoy handles the Tracker holds.
func (f *fixture) held() (nodes, envoys int) {
	f.tr.mu.RLock()
	defer f.tr.mu.RUnlock()
	for _, k := range f.tr.keys {
		k.mu.Lock()
		envoys += len(k.envoys)
		k.mu.Unlock()
	}
	return len(f.tr.nodes), envoys
}

// TestWaitWakesWhenForgotten: a wait for every Envoy is done once the one
// that left is forgotten, though nothing else happens (in a synctest
// bubble: ForgetAfter passes on the fake clock).
func TestWaitWakesWhenForgotten(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tr, err := NewTracker(DefaultTrackerConfig())
		if err != nil {
			t.Fatal(err)
		}
		hist := newHistory(t, DefaultHistoryConfig())
		v, _ := hist.Record(build(map[string]Hash{"a": h("1")}), time.Now(), Order{})
		tr.Recorded("k", cds, hist, v)
		stay, gone := tr.Connect("stay", "k", time.Now()), tr.Connect("gone", "k", time.Now())
		for _, e := range []*Envoy{stay, gone} {
			e.Sent(cds, time.Now())
			e.Synced(cds, v.Root, time.Now())
		}
		stay.Answered(cds, Answer{Version: "v", Latest: true, At: time.Now()})
		gone.Disconnect(time.Now())
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
		defer cancel()
		if c, _, err := tr.Wait(ctx, Scope{}, 1); err != nil || c != (Convergence{Envoys: 1, Current: 1}) {
			t.Fatalf("Wait = %+v, %v; want 1 of 1 once the other is forgotten", c, err)
		}
		if d, forget := time.Since(start), DefaultTrackerConfig().ForgetAfter; d < forget || d > forget+time.Second {
			t.Fatalf("Wait returned after %v, want just after ForgetAfter (%v)", d, forget)
		}
	})
}

// TestDroppedKeyGoesWithItsLastEnvoy: a key the relay dropped while Envoys
// of it were listed leaves once they are forgotten, and a key dropped and
// held again at once is a live entry (its Envoys counted, its versions
// kept).
func TestDroppedKeyGoesWithItsLastEnvoy(t *testing.T) {
	f := newFixture(t, "r")
	f.record("k", cds, map[string]string{"a": "1"})
	e := f.tr.Connect("e", "k", f.now)
	e.Disconnect(f.now)
	f.tr.DropKey("k")
	if _, ok := f.tr.keys["k"]; !ok {
		t.Fatal("key dropped while an Envoy of it is listed")
	}
	// Long after: another key's Envoy connects, and the sweep forgets e.
	f.now = f.now.Add(time.Hour)
	f.tr.Connect("x", "other", f.now)
	if _, ok := f.tr.keys["k"]; ok {
		t.Fatal("dropped key still held after its last Envoy was forgotten")
	}
	// Dropped with no Envoy, then held again: one live entry.
	f.tr.DropKey("other2")
	f.record("k2", cds, map[string]string{"a": "1"})
	f.tr.DropKey("k2")
	f.record("k2", cds, map[string]string{"a": "2"})
	e2 := f.tr.Connect("e2", "k2", f.now)
	f.sync(e2, "k2", cds)
	f.ack(e2, cds)
	if c := f.tr.Convergence(Scope{Key: "k2"}, f.now); c != (Convergence{Envoys: 1, Current: 1}) {
		t.Fatalf("k2 after drop and reuse: %+v, want 1 of 1", c)
	}
}
