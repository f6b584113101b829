package ledgerpb

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func sampleSummary() *ledger.Summary {
	at := time.Unix(1_700_000_000, 123)
	root := ledger.HashBytes([]byte("v1"))
	return &ledger.Summary{Relay: "relay-0", At: at, Keys: []ledger.KeySummary{{
		Key: "sidecar/ns/wl", Relay: "relay-0", Source: ledger.SourceUpstream, Splits: []string{"metadata.INSTANCE_IPS like sidecar~10.0.0.3~a.ns~ns.svc.cluster.local"},
		Types: []ledger.TypeVersion{{Type: "cds", Version: ledger.Version{Seq: 3, Root: root, Received: at, Len: 10}}},
		Envoys: []ledger.EnvoyState{
			{Node: "a", Meta: ledger.NodeMeta{Namespace: "ns", Cluster: "Kubernetes", Version: "1.31.0"}, ConnectedAt: at,
				Types: []ledger.EnvoyType{{Type: "cds", Sent: root, SentAt: at, Acked: root, AckedAt: at}}},
			{Node: "b", ConnectedAt: at, DisconnectedAt: at.Add(time.Second), Types: []ledger.EnvoyType{{Type: "cds", Sent: root, Pending: true,
				NACK: &ledger.NACKState{Fingerprint: "f00d", Version: "x", Detail: "bad", At: at}}}},
			// As a ledger.Brief summary gives a settled Envoy: sent as brief.
			{Node: "c", Meta: ledger.NodeMeta{Namespace: "ns", Version: "1.30.2"}, ConnectedAt: at, Types: []ledger.EnvoyType{{Type: "cds", Sent: root, Acked: root}}},
		},
	}}}
}

// TestRoundTrip: what a relay sends is what the other decodes.
func TestRoundTrip(t *testing.T) {
	s := sampleSummary()
	pk := FromSummary(s)
	if k := pk.GetKeys()[0]; k.GetEnvoyCount() != 2 || k.GetBriefCount() != 1 {
		t.Fatalf("FromSummary sent %d Envoys in full and %d in brief, want 2 and 1 (c)", k.GetEnvoyCount(), k.GetBriefCount())
	}
	b, err := proto.Marshal(pk)
	if err != nil {
		t.Fatal(err)
	}
	var p Summary
	if err := proto.Unmarshal(b, &p); err != nil {
		t.Fatal(err)
	}
	got, err := ToSummary(&p)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, s) {
		t.Fatalf("ToSummary(FromSummary(s)) = %+v, want %+v", got, s)
	}

	vs := []ledger.Verdicts{{Key: "k", References: true, Known: true, Roots: map[ledger.Hash]bool{
		ledger.HashBytes([]byte("v1")): false, ledger.HashBytes([]byte("v2")): true, {}: false,
	}}}
	gv, err := ToVerdicts(FromVerdicts(vs))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(gv, vs) {
		t.Fatalf("ToVerdicts(FromVerdicts(v)) = %+v, want %+v", gv, vs)
	}
}

func TestBadMessagesRefused(t *testing.T) {
	bad := []*Summary{
		{Keys: []*KeySummary{{Types: []*TypeVersion{{Version: &Version{Root: []byte{1, 2, 3}}}}}}},
		{Keys: []*KeySummary{{Types: []*TypeVersion{{Version: &Version{Len: -1}}}}}},
		{Keys: []*KeySummary{{Roots: [][]byte{make([]byte, 31)}}}},
		// Records that point outside their tables, or run short or long.
		{Keys: []*KeySummary{{EnvoyCount: 1, Envoys: []byte{1, 'a', 0, 0, 1, 0, 0, 0, 0, 0, 0}}}},
		{Keys: []*KeySummary{{EnvoyCount: 1, TypeUrls: []string{"t"}, Envoys: []byte{1, 'a', 0, 0, 1, 0, 0, 5, 0, 0, 0}}}},
		{Keys: []*KeySummary{{EnvoyCount: 1, TypeUrls: []string{"t"}, Envoys: []byte{1, 'a', 0, 0, 1, 0, 2, 0, 0, 0, 0, 0}}}},
		{Keys: []*KeySummary{{EnvoyCount: 1, TypeUrls: []string{"t"}, Envoys: []byte{1, 'a', 0, 0, 1, 0, 8, 0, 0, 0, 0}}}},
		{Keys: []*KeySummary{{EnvoyCount: 1, Envoys: []byte{9, 'a', 0, 0, 0}}}},
		{Keys: []*KeySummary{{EnvoyCount: 1, Envoys: []byte{1, 'a', 0, 0, 0, 7}}}},
		{Keys: []*KeySummary{{EnvoyCount: 3, Envoys: []byte{1, 'a', 0, 0, 0}}}},
		// Envoys in brief: a type set out of its table, of no type, of a
		// type the key has no version of; a record that names no set, runs
		// long, or is counted more than it is.
		briefKey([]uint32{1}, 1, []byte{1, 'a', 0, 0}),
		briefKey(nil, 1, []byte{1, 'a', 0, 0}),
		{Keys: []*KeySummary{{TypeUrls: []string{"t"}, TypeSets: []*TypeSet{{Types: []uint32{0}}}, BriefCount: 1, BriefEnvoys: []byte{1, 'a', 0, 0}}}},
		briefKey([]uint32{0}, 1, []byte{1, 'a', 0, 1}),
		briefKey([]uint32{0}, 1, []byte{1, 'a', 0, 0, 0}),
		briefKey([]uint32{0}, 2, []byte{1, 'a', 0, 0, 1}),
		briefKey([]uint32{0}, 1, []byte{3, 'a', 0, 0}),
		// Node metadata: an index out of its table, one entry short, one
		// too many.
		{Keys: []*KeySummary{{EnvoyCount: 1, Envoys: []byte{1, 'a', 0, 0, 0}, Metas: []*NodeMeta{{Namespace: "ns"}}, NodeMetas: []byte{2}}}},
		{Keys: []*KeySummary{{EnvoyCount: 2, Envoys: []byte{1, 'a', 0, 0, 0, 1, 'b', 0, 0, 0}, Metas: []*NodeMeta{{Namespace: "ns"}}, NodeMetas: []byte{1}}}},
		{Keys: []*KeySummary{{EnvoyCount: 1, Envoys: []byte{1, 'a', 0, 0, 0}, Metas: []*NodeMeta{{Namespace: "ns"}}, NodeMetas: []byte{1, 0}}}},
	}
	for i, p := range bad {
		if _, err := ToSummary(p); !errors.Is(err, ErrBadMessage) {
			t.Errorf("ToSummary(bad %d) err = %v, want ErrBadMessage", i, err)
		}
	}
	if _, err := ToVerdicts(&DeliveryVerdicts{Keys: []*KeyVerdicts{{Delivered: [][]byte{{1}}}}}); !errors.Is(err, ErrBadMessage) {
		t.Errorf("ToVerdicts(a 1-byte root) err = %v, want ErrBadMessage", err)
	}
}

// briefKey is a summary of one key of type "t" at a root, whose Envoys in
// brief are n records in b, of one type set.
func briefKey(set []uint32, n uint32, b []byte) *Summary {
	root := ledger.HashBytes([]byte("v1"))
	return &Summary{Keys: []*KeySummary{{TypeUrls: []string{"t"}, Types: []*TypeVersion{{Type: "t", Version: &Version{Root: root[:]}}},
		TypeSets: []*TypeSet{{Types: set}}, BriefCount: n, BriefEnvoys: b}}}
}

// FuzzDecode: any bytes another relay sends decode into a Summary or
// delivery verdicts, or are refused with an error; never a panic, and what decodes
// encodes back to the same.
func FuzzDecode(f *testing.F) {
	b, _ := proto.Marshal(FromSummary(sampleSummary()))
	f.Add(b)
	f.Add([]byte{})
	f.Add([]byte{0x1a, 0x03, 0x22, 0x01, 0x00})
	f.Fuzz(func(t *testing.T, b []byte) {
		var p Summary
		if proto.Unmarshal(b, &p) == nil {
			if s, err := ToSummary(&p); err == nil {
				again, err := ToSummary(FromSummary(s))
				// An Envoy that can be sent in brief is, and comes after
				// those sent in full: compare in one order.
				if err != nil || !reflect.DeepEqual(sortedEnvoys(again), sortedEnvoys(s)) {
					t.Fatalf("summary does not round-trip: %v", err)
				}
			}
		}
		var v DeliveryVerdicts
		if proto.Unmarshal(b, &v) == nil {
			if got, err := ToVerdicts(&v); err == nil {
				again, err := ToVerdicts(FromVerdicts(got))
				if err != nil || !reflect.DeepEqual(again, got) {
					t.Fatalf("verdicts do not round-trip: %v", err)
				}
			}
		}
	})
}

// sortedEnvoys orders every key's Envoys by what they hold, in place.
func sortedEnvoys(s *ledger.Summary) *ledger.Summary {
	for i := range s.Keys {
		slices.SortStableFunc(s.Keys[i].Envoys, func(a, b ledger.EnvoyState) int {
			return strings.Compare(describe(a), describe(b))
		})
	}
	return s
}

// describe renders e with its NACKs' contents, not their addresses.
func describe(e ledger.EnvoyState) string {
	out := fmt.Sprintf("%q %+v %d %d", e.Node, e.Meta, e.ConnectedAt.UnixNano(), e.DisconnectedAt.UnixNano())
	for _, et := range e.Types {
		n := et.NACK
		et.NACK = nil
		out += fmt.Sprintf(" %+v", et)
		if n != nil {
			out += fmt.Sprintf(" %+v", *n)
		}
	}
	return out
}

// BenchmarkWire is a relay's summary of 10,000 Envoys over 100 keys (two
// types each, 1% not settled) on the wire: encoded and marshalled by the
// relay asked, unmarshalled and decoded by the relay asking.
func BenchmarkWire(b *testing.B) {
	for _, d := range []struct {
		name   string
		detail ledger.Detail
	}{{"full", ledger.Full}, {"brief", ledger.Brief}} {
		s := benchSummary(10_000, 100, d.detail)
		b.Run(d.name, func(b *testing.B) {
			b.ReportAllocs()
			var size int
			for b.Loop() {
				m, err := proto.Marshal(FromSummary(s))
				if err != nil {
					b.Fatal(err)
				}
				size = len(m)
				var p Summary
				if err := proto.Unmarshal(m, &p); err != nil {
					b.Fatal(err)
				}
				if _, err := ToSummary(&p); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(size), "bytes/summary")
		})
	}
}

// benchSummary is a summary as a Tracker gives it in detail d.
func benchSummary(envoys, keys int, d ledger.Detail) *ledger.Summary {
	at := time.Unix(1_700_000_000, 0)
	cds, eds := "type.googleapis.com/envoy.config.cluster.v3.Cluster", "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
	s := &ledger.Summary{Relay: "relay-0", At: at}
	for k := range keys {
		rc, re := ledger.HashBytes(fmt.Appendf(nil, "c%d", k)), ledger.HashBytes(fmt.Appendf(nil, "e%d", k))
		ks := ledger.KeySummary{Key: fmt.Sprint("key-", k), Relay: "relay-0", Source: ledger.SourceUpstream,
			Types: []ledger.TypeVersion{{Type: cds, Version: ledger.Version{Seq: 1, Root: rc, Received: at}}, {Type: eds, Version: ledger.Version{Seq: 9, Root: re, Received: at}}}}
		settled := []ledger.EnvoyType{{Type: cds, Sent: rc, Acked: rc}, {Type: eds, Sent: re, Acked: re}}
		for i := k; i < envoys; i += keys {
			e := ledger.EnvoyState{Node: fmt.Sprintf("sidecar~10.0.%d.%d~app-%d.ns-%d~ns-%d.svc.cluster.local", i/256, i%256, i, k, k), ConnectedAt: at}
			if d == ledger.Brief && i%100 != 0 {
				e.Types = settled
			} else {
				e.Types = []ledger.EnvoyType{{Type: cds, Sent: rc, SentAt: at, Acked: rc, AckedAt: at}, {Type: eds, Sent: re, SentAt: at, Acked: re, AckedAt: at}}
			}
			ks.Envoys = append(ks.Envoys, e)
		}
		s.Keys = append(s.Keys, ks)
	}
	return s
}

// TestBriefNeedsTheWholeSlice: an Envoy whose Types begin where a brief
// one's do, but are fewer, is checked on its own, not taken for the same
// type set.
func TestBriefNeedsTheWholeSlice(t *testing.T) {
	at := time.Unix(1_700_000_000, 0)
	rc, re := ledger.HashBytes([]byte("c")), ledger.HashBytes([]byte("e"))
	settled := []ledger.EnvoyType{{Type: "cds", Sent: rc, Acked: rc}, {Type: "eds", Sent: re, Acked: re}}
	s := &ledger.Summary{Relay: "r", At: at, Keys: []ledger.KeySummary{{Key: "k", Relay: "r",
		Types:  []ledger.TypeVersion{{Type: "cds", Version: ledger.Version{Root: rc}}, {Type: "eds", Version: ledger.Version{Root: re}}},
		Envoys: []ledger.EnvoyState{{Node: "a", ConnectedAt: at, Types: settled}, {Node: "b", ConnectedAt: at, Types: settled[:1]}}}}}
	got, err := ToSummary(FromSummary(s))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(sortedEnvoys(got), sortedEnvoys(s)) {
		t.Fatalf("ToSummary(FromSummary(s)) = %+v, want %+v", got.Keys[0].Envoys, s.Keys[0].Envoys)
	}
}
