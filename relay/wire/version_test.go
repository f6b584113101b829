package wire

import (
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
)

func TestVersionRoundTrip(t *testing.T) {
	h := ledger.HashBytes([]byte("content"))
	s := ledger.StampAt(time.UnixMilli(1764574155123))
	plain := ledger.Order{Session: s, At: s + 3}
	for _, o := range []ledger.Order{{}, plain, plain.Mix(ledger.Order{Session: s + 1, At: s + 9})} {
		for _, stale := range []bool{false, true} {
			v := Version(h, o)
			if stale {
				v = MarkStale(v)
			}
			cut, marked := CutStale(v)
			gotH, gotO, err := ParseVersion(cut)
			if err != nil || gotH != h || gotO != o || marked != stale {
				t.Errorf("%q: ParseVersion(CutStale) = %v %v %v (marked %v), want %v %v (marked %v)", v, gotH, gotO, err, marked, h, o, stale)
			}
		}
	}
	if _, _, err := ParseVersion(MarkStale(Version(h, plain))); err == nil {
		t.Errorf("a stale mark parses as part of a version")
	}
}
