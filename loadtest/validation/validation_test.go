package validation

import (
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestCheck gives the checker hand-made histories: a clean one, and
// one each with a version regression, an unexpected removal, a late change,
// a change never delivered, a reused nonce and a wrong end state. Each must
// be found, at the right event, and nothing else.
func TestCheck(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	const eds = envoy.EndpointType
	a := traffic.ResourceKeyOf(eds, "a")
	b := traffic.ResourceKeyOf(eds, "b")
	initial := map[string]map[traffic.ResourceKey]uint64{"ns-0": {a: 1, b: 1}}
	open := envoy.Event{Kind: envoy.Opened, At: at(0)}
	recv := func(ms int, nonce string, names []string, gens []uint64) envoy.Event {
		return envoy.Event{Kind: envoy.Received, TypeURL: eds, Names: names, Generations: gens, Nonce: nonce, At: at(ms), ControlPlane: "relay-0"}
	}
	ack := func(ms int, nonce string, names []string, gens []uint64) envoy.Event {
		return envoy.Event{Kind: envoy.ACKed, TypeURL: eds, Names: names, Generations: gens, Nonce: nonce, At: at(ms)}
	}
	removed := func(ms int, names ...string) envoy.Event {
		return envoy.Event{Kind: envoy.Removed, TypeURL: eds, Names: names, At: at(ms)}
	}
	// The initial sync, then "a" moves to generation 2 at 1 s.
	sync := []envoy.Event{open, recv(10, "1", []string{"a", "b"}, []uint64{1, 1}), ack(11, "1", []string{"a", "b"}, []uint64{1, 1})}
	pubs := []Published{{At: at(1000), Group: "ns-0", Key: a, Generation: 2}}
	cfg := Config{DeliveryBound: 2 * time.Second}

	tests := []struct {
		name   string
		events []envoy.Event
		pubs   []Published
		want   []string // rules, in order
		event  int      // the first violation's event index
	}{
		{
			name:   "clean",
			events: append(sync, recv(1100, "2", []string{"a"}, []uint64{2}), ack(1101, "2", []string{"a"}, []uint64{2})),
			pubs:   pubs,
		},
		{
			name: "regression",
			events: append(sync, recv(1100, "2", []string{"a"}, []uint64{2}), ack(1101, "2", []string{"a"}, []uint64{2}),
				recv(1500, "3", []string{"a"}, []uint64{1}), ack(1501, "3", []string{"a"}, []uint64{1})),
			pubs: pubs,
			// Going back also leaves the wrong generation at the end.
			want:  []string{RuleRegression, RuleEndState},
			event: 5,
		},
		{
			name: "unexpected removal",
			events: append(sync, recv(1100, "2", []string{"a"}, []uint64{2}), ack(1101, "2", []string{"a"}, []uint64{2}),
				removed(1200, "b")),
			pubs:  pubs,
			want:  []string{RuleRemoval, RuleEndState},
			event: 5,
		},
		{
			name: "expected removal",
			events: append(sync, recv(1100, "2", []string{"a"}, []uint64{2}), ack(1101, "2", []string{"a"}, []uint64{2}),
				removed(2100, "b")),
			pubs: append(pubs, Published{At: at(2000), Group: "ns-0", Key: b, Removed: true}),
		},
		{
			name:   "late change",
			events: append(sync, recv(3500, "2", []string{"a"}, []uint64{2}), ack(3501, "2", []string{"a"}, []uint64{2})),
			pubs:   pubs,
			want:   []string{RuleLate},
			event:  -1,
		},
		{
			name:   "never delivered",
			events: sync,
			pubs:   pubs,
			want:   []string{RuleUndeliver, RuleEndState},
			event:  -1,
		},
		{
			name:   "nonce reused",
			events: append(sync, recv(1100, "1", []string{"a"}, []uint64{2}), ack(1101, "1", []string{"a"}, []uint64{2})),
			pubs:   pubs,
			want:   []string{RuleNonce},
			event:  3,
		},
		{
			name: "nonces restart on a new stream",
			events: append(sync, envoy.Event{Kind: envoy.Opened, At: at(1050)},
				recv(1100, "1", []string{"a"}, []uint64{2}), ack(1101, "1", []string{"a"}, []uint64{2})),
			pubs: pubs,
		},
		{
			name: "declared on reconnect counts as delivered",
			events: append(sync, envoy.Event{Kind: envoy.Opened, At: at(1050)},
				envoy.Event{Kind: envoy.Declared, TypeURL: eds, Names: []string{"a", "b"}, Generations: []uint64{2, 1}, At: at(1060)}),
			pubs: pubs,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := History{
				Initial:   initial,
				Published: tt.pubs,
				Envoys:    []EnvoyHistory{{ID: "envoy-0", Group: "ns-0", Events: tt.events}},
				End:       at(10_000),
			}
			res := Check(h, cfg)
			var got []string
			for _, v := range res.Violations {
				got = append(got, v.Rule)
			}
			if strings.Join(got, ",") != strings.Join(tt.want, ",") {
				t.Fatalf("violations %v, want rules %v", res.Violations, tt.want)
			}
			if len(tt.want) > 0 && res.Violations[0].Event != tt.event {
				t.Errorf("first violation at event %d, want %d: %v", res.Violations[0].Event, tt.event, res.Violations[0])
			}
			if len(res.Changes) != len(tt.pubs) {
				t.Fatalf("%d changes, want %d", len(res.Changes), len(tt.pubs))
			}
		})
	}

	// The late change's delivery is measured.
	h := History{Initial: initial, Published: pubs, End: at(10_000), Envoys: []EnvoyHistory{{ID: "e", Group: "ns-0",
		Events: append(sync, recv(3500, "2", []string{"a"}, []uint64{2}), ack(3501, "2", []string{"a"}, []uint64{2}))}}}
	if got := Check(h, cfg).Changes[0].Last; got != 2501*time.Millisecond {
		t.Errorf("change → last ACK = %v, want 2.501s", got)
	}
}
