package relay

import (
	"slices"
	"testing"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// A Delta response of a Singleton type (Istio's NDS) removes its one
// resource only when it carries none and removes a name other than the
// wildcard: istiod answers a subscription of "*" with the unnamed table and
// removes "*" in the same response (found against a real istiod: every
// other NameTable a relayed sidecar got was empty).
func TestSingletonRemoved(t *testing.T) {
	for _, tc := range []struct {
		removed []string
		carried bool
		want    []string
	}{
		{[]string{xds.WildcardName}, true, nil},
		{[]string{xds.WildcardName}, false, nil},
		{[]string{""}, true, nil},
		{[]string{""}, false, []string{xds.SingletonName}},
		{[]string{xds.WildcardName, "nds-0"}, false, []string{xds.SingletonName}},
		{nil, false, nil},
	} {
		if got := singletonRemoved(tc.removed, tc.carried); !slices.Equal(got, tc.want) {
			t.Errorf("singletonRemoved(%q, carried %v) = %q, want %q", tc.removed, tc.carried, got, tc.want)
		}
	}
}
