package relay

import (
	"maps"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/relay/xds"
)

func TestWithoutArrived(t *testing.T) {
	at := time.Unix(100, 0)
	pending := map[string]time.Time{"a": at, "b": at, "c": at}
	res := func(names ...string) []*xds.Resource {
		var out []*xds.Resource
		for _, n := range names {
			out = append(out, &xds.Resource{Name: n})
		}
		return out
	}
	for _, tc := range []struct {
		name string
		upd  []*xds.Resource
		want map[string]time.Time
	}{
		{"none of them", res("x"), pending},
		{"some", res("a", "x", "c"), map[string]time.Time{"b": at}},
		{"all", res("c", "b", "a"), nil},
	} {
		got := withoutArrived(pending, tc.upd)
		if !maps.Equal(got, tc.want) || (tc.want == nil) != (got == nil) {
			t.Errorf("%s: withoutArrived = %v, want %v", tc.name, got, tc.want)
		}
	}
	if len(pending) != 3 {
		t.Fatalf("withoutArrived changed the map it was given (it is shared by published views): %v", pending)
	}
}
