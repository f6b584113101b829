package xds

import (
	"slices"
	"testing"
)

func TestSotWResourceNames(t *testing.T) {
	for _, tc := range []struct {
		wildcard, named bool
		names           []string
		want            []string
	}{
		{true, false, nil, nil},                          // the legacy wildcard
		{true, true, nil, []string{"*"}},                 // once named, "*" says it
		{true, false, []string{"a"}, []string{"*", "a"}}, // wildcard and names
		{false, true, []string{"a"}, []string{"a"}},
		{false, false, nil, nil}, // nothing asked
	} {
		if got := SotWResourceNames(tc.wildcard, tc.names, tc.named); !slices.Equal(got, tc.want) {
			t.Errorf("SotWResourceNames(%v, %q, %v) = %q, want %q", tc.wildcard, tc.names, tc.named, got, tc.want)
		}
	}
}
