package aggkey

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

func TestDiffering(t *testing.T) {
	v2 := node("ns1", "reviews", 2)
	v2.Metadata.Fields["LABELS"].GetStructValue().Fields["version"] = structpb.NewStringValue("v2")
	dotted := node("ns1", "reviews", 0)
	dotted.Metadata.Fields["LABELS"].GetStructValue().Fields["app.kubernetes.io/name"] = structpb.NewStringValue("reviews")
	number := node("ns1", "reviews", 0)
	number.Metadata.Fields["CLUSTER_ID"] = structpb.NewNumberValue(1)
	for _, tc := range []struct {
		name string
		a, b *core.Node
		want []string
	}{
		{"same node", node("ns1", "reviews", 0), node("ns1", "reviews", 0), nil},
		{"two pods of a workload", node("ns1", "reviews", 0), node("ns1", "reviews", 1), []string{"id", "metadata.INSTANCE_IPS"}},
		{"a label inside LABELS", node("ns1", "reviews", 1), v2, []string{"id", "metadata.INSTANCE_IPS", "metadata.LABELS.version"}},
		{"a label named with dots", node("ns1", "reviews", 0), dotted, []string{"metadata.LABELS[app.kubernetes.io/name]"}},
		{"a string and a number", node("ns1", "reviews", 0), number, []string{"metadata.CLUSTER_ID"}},
		{"go-control-plane fleet", &core.Node{Id: "sidecar-1.bench", Cluster: "bench"}, &core.Node{Id: "sidecar-2.bench", Cluster: "bench", Locality: &core.Locality{Zone: "b"}}, []string{"id", "locality.zone"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Differing(tc.a, tc.b); !slices.Equal(got, tc.want) {
				t.Errorf("Differing = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestSplitMovesTheDivergingNodeAndItsLookAlikes(t *testing.T) {
	withVersion := func(i int, v string) *core.Node {
		n := &core.Node{Id: fmt.Sprintf("sidecar-%d.bench", i), Cluster: "bench"}
		n.Metadata, _ = structpb.NewStruct(map[string]any{"LABELS": map[string]any{"version": v}})
		return n
	}
	for _, tc := range []struct {
		name      string
		split     Split
		moved     []*core.Node
		stay      []*core.Node
		wantNames []string
	}{
		{
			name:      "a label: every node with the diverging value moves",
			split:     NewSplit(withVersion(2, "v2"), withVersion(1, "v1")),
			moved:     []*core.Node{withVersion(2, "v2"), withVersion(9, "v2")},
			stay:      []*core.Node{withVersion(1, "v1"), withVersion(3, "v3"), {Id: "sidecar-4.bench", Cluster: "bench"}},
			wantNames: []string{"metadata.LABELS.version"},
		},
		{
			name:      "ids alone: the node moves alone",
			split:     NewSplit(&core.Node{Id: "a", Cluster: "c"}, &core.Node{Id: "b", Cluster: "c"}),
			moved:     []*core.Node{{Id: "a", Cluster: "c"}, {Id: "a"}},
			stay:      []*core.Node{{Id: "b", Cluster: "c"}, {Id: "aa", Cluster: "c"}},
			wantNames: []string{"id"},
		},
		{
			name:      "Istio pods: its IP is its own",
			split:     NewSplit(node("ns1", "reviews", 3), node("ns1", "reviews", 1)),
			moved:     []*core.Node{node("ns1", "reviews", 3)},
			stay:      []*core.Node{node("ns1", "reviews", 1), node("ns1", "reviews", 2)},
			wantNames: []string{"metadata.INSTANCE_IPS"},
		},
		{
			name:      "a field the diverging node lacks",
			split:     NewSplit(&core.Node{Id: "a"}, &core.Node{Id: "b", Cluster: "c"}),
			moved:     []*core.Node{{Id: "x"}},
			stay:      []*core.Node{{Id: "a", Cluster: "c"}, {Id: "b", Cluster: "d"}},
			wantNames: []string{"cluster"},
		},
		{
			name:  "SplitAll",
			split: SplitAll,
			moved: []*core.Node{{Id: "a"}, node("ns1", "reviews", 1)},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.wantNames != nil && !slices.Equal(tc.split.FieldNames(), tc.wantNames) {
				t.Errorf("FieldNames = %q, want %q", tc.split.FieldNames(), tc.wantNames)
			}
			// The wire form moves the same nodes.
			back, err := DecodeSplits(EncodeSplits([]Split{tc.split}))
			if err != nil {
				t.Fatalf("DecodeSplits(EncodeSplits(%v)): %v", tc.split, err)
			}
			for _, s := range []Split{tc.split, back[0]} {
				for _, n := range tc.moved {
					if !s.Matches(n) {
						t.Errorf("%v: Matches(%q) = false, want true", s, n.GetId())
					}
				}
				for _, n := range tc.stay {
					if s.Matches(n) {
						t.Errorf("%v: Matches(%q) = true, want false", s, n.GetId())
					}
				}
			}
		})
	}
}

func TestMergeSplit(t *testing.T) {
	at := func(s Split, epoch uint64, merged bool) Split { s.Epoch, s.Merged = epoch, merged; return s }
	a := NewSplit(&core.Node{Id: "a"}, &core.Node{Id: "b"})
	splits, added := MergeSplit(nil, at(a, 10, false))
	if !added || len(splits) != 1 {
		t.Fatalf("MergeSplit(nil, a) = %v, %v", splits, added)
	}
	if _, added := MergeSplit(splits, at(NewSplit(&core.Node{Id: "a"}, &core.Node{Id: "c"}), 10, false)); added {
		t.Error("MergeSplit added a split that moves the same node again")
	}
	// Merged later: the node is the key's again; an older proof that
	// arrives after (another relay's record) does not bring it back; a
	// later one does.
	splits, changed := MergeSplit(splits, at(a, 20, true))
	if !changed || len(Active(splits)) != 0 {
		t.Fatalf("merged at 20: %v (changed %v), want no active split", splits, changed)
	}
	if _, changed := MergeSplit(splits, at(a, 15, false)); changed {
		t.Error("an older proof undid a later merge")
	}
	if splits, changed = MergeSplit(splits, at(a, 30, false)); !changed || len(Active(splits)) != 1 {
		t.Errorf("proven again at 30: %v (changed %v), want the split active", splits, changed)
	}
	for i := range MaxSplits - 1 {
		splits, _ = MergeSplit(splits, at(NewSplit(&core.Node{Id: fmt.Sprint("n", i)}, &core.Node{Id: "b"}), 40, false))
	}
	if len(splits) != MaxSplits {
		t.Fatalf("%d splits, want %d", len(splits), MaxSplits)
	}
	// Records past the bound go, merged ones and oldest first; active
	// ones do not.
	if more, _ := MergeSplit(splits, at(NewSplit(&core.Node{Id: "gone"}, &core.Node{Id: "b"}), 50, true)); len(more) != MaxSplits || len(Active(more)) != MaxSplits {
		t.Errorf("%d records (%d active) after a merged one past the bound, want %d active", len(more), len(Active(more)), MaxSplits)
	}
	splits, added = MergeSplit(splits, at(NewSplit(&core.Node{Id: "one-too-many"}, &core.Node{Id: "b"}), 60, false))
	if !added || len(splits) != 1 || !splits[0].Matches(&core.Node{Id: "anyone"}) || splits[0].Epoch != 60 {
		t.Errorf("past MaxSplits: %v, want SplitAll alone, at 60", splits)
	}
	if _, added := MergeSplit(splits, at(NewSplit(&core.Node{Id: "later"}, &core.Node{Id: "b"}), 70, false)); added {
		t.Error("a split added while SplitAll moves every node")
	}
}

func TestDecodeSplitsRefuses(t *testing.T) {
	for _, tc := range []struct{ name, in string }{
		{"not JSON", "{"},
		{"no id", `[{"fields":[{"name":"cluster","value":"x"}]}]`},
		{"a pattern", `[{"id":"a","fields":[{"name":"id~(a+)+$","value":"x"}]}]`},
		{"the id as a field", `[{"id":"a","fields":[{"name":"id","value":"x"}]}]`},
		{"unknown field", `[{"id":"a","fields":[{"name":"pod","value":"x"}]}]`},
		{"out of order", `[{"id":"a","fields":[{"name":"metadata.B"},{"name":"metadata.A"}]}]`},
		{"too many", "[" + strings.Repeat(`{"id":"a"},`, MaxSplits) + `{"id":"a"}]`},
		{"too long", `[{"id":"` + strings.Repeat("a", maxSplitsEncoded) + `"}]`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if s, err := DecodeSplits([]byte(tc.in)); err == nil {
				t.Errorf("DecodeSplits(%.40q) = %v, want an error", tc.in, s)
			}
		})
	}
}

// FuzzDecodeSplits decodes what a peer relay may send: no panic, and what
// decodes encodes back to a form that decodes to splits that move the same
// nodes.
func FuzzDecodeSplits(f *testing.F) {
	f.Add(EncodeSplits([]Split{NewSplit(node("ns1", "reviews", 3), node("ns1", "reviews", 1))}))
	f.Add(EncodeSplits([]Split{SplitAll}))
	f.Add([]byte(`[{"id":"a","fields":[{"name":"metadata.LABELS[app.kubernetes.io/name]","missing":true},{"name":"metadata.NAMESPACE","value":"czpucw=="}]}]`))
	f.Add([]byte(`[]`))
	probes := []*core.Node{node("ns1", "reviews", 1), node("ns1", "reviews", 3), {Id: "a"}, {}}
	f.Fuzz(func(t *testing.T, b []byte) {
		splits, err := DecodeSplits(b)
		if err != nil {
			return
		}
		again, err := DecodeSplits(EncodeSplits(splits))
		if err != nil {
			t.Fatalf("decoded splits do not decode again: %v", err)
		}
		if len(again) != len(splits) && !(len(again) == 1 && again[0].same(SplitAll)) {
			t.Fatalf("%d splits came back as %d", len(splits), len(again))
		}
		for i := range again {
			if len(again) != len(splits) {
				break
			}
			for _, n := range probes {
				if splits[i].Matches(n) != again[i].Matches(n) {
					t.Fatalf("split %v moves %q, its round trip does not agree", splits[i], n.GetId())
				}
			}
		}
	})
}

// FuzzSplitOfNodes splits arbitrary pairs of nodes: no panic, the diverging
// node always moves, the presented one never does (when they differ in more
// than the id, or in the id alone), and the split's wire form moves the same
// nodes.
func FuzzSplitOfNodes(f *testing.F) {
	add := func(a, b *core.Node) {
		ba, _ := proto.Marshal(a)
		bb, _ := proto.Marshal(b)
		f.Add(ba, bb)
	}
	add(node("ns1", "reviews", 3), node("ns1", "reviews", 1))
	add(&core.Node{Id: "a"}, &core.Node{Id: "b", Cluster: "c"})
	odd := node("ns1", "reviews", 2)
	odd.Metadata.Fields["LABELS"].GetStructValue().Fields["a]b"] = structpb.NewStringValue("x")
	odd.Metadata.Fields["x.y"] = structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewNumberValue(1)}})
	add(odd, node("ns1", "reviews", 2))
	f.Fuzz(func(t *testing.T, ba, bb []byte) {
		var a, b core.Node
		if proto.Unmarshal(ba, &a) != nil || proto.Unmarshal(bb, &b) != nil || a.GetId() == "" || b.GetId() == "" {
			return // the relay refuses a node without an id
		}
		differ := Differing(&a, &b)
		if len(differ) == 0 {
			return
		}
		s := NewSplit(&a, &b)
		if !s.Matches(&a) {
			t.Fatalf("split %v of %v from %v does not move the diverging node", s, differ, b.GetId())
		}
		if s.Matches(&b) && a.GetId() != b.GetId() {
			t.Fatalf("split %v of %v moves the presented node too", s, differ)
		}
		back, err := DecodeSplits(EncodeSplits([]Split{s}))
		if err != nil {
			t.Fatalf("a split does not decode: %v", err)
		}
		if len(back) == 1 && (back[0].Matches(&a) != s.Matches(&a) || back[0].Matches(&b) != s.Matches(&b)) {
			t.Fatalf("split %v moves other nodes after its round trip", s)
		}
	})
}
