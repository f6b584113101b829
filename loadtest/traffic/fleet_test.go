package traffic

import (
	"slices"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestTopReasons checks that the reasons come most common first, ties in
// name order, cut at n.
func TestTopReasons(t *testing.T) {
	count := map[string]int{"keepalive": 3, "EOF": 7, "refused": 3, "reset": 1}
	got := topReasons(count, 3)
	want := []string{"7× EOF", "3× keepalive", "3× refused"}
	if !slices.Equal(got, want) {
		t.Errorf("topReasons(…, 3) = %q, want %q", got, want)
	}
	if got := topReasons(nil, 5); len(got) != 0 {
		t.Errorf("topReasons(nil, 5) = %q, want none", got)
	}
}
