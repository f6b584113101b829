package ledger

import (
	"errors"
	"testing"
	"time"
)

func TestClockNeverRepeatsNorGoesBack(t *testing.T) {
	wall := time.UnixMilli(1_000_000)
	c := NewClock(func() time.Time { return wall })
	a := c.Now()
	b := c.Now() // same millisecond: the counter orders them
	if b <= a {
		t.Fatalf("Now() = %v after %v, want later", b, a)
	}
	wall = wall.Add(-time.Second) // the wall clock steps back
	if d := c.Now(); d <= b {
		t.Fatalf("Now() = %v after the wall clock stepped back, want after %v", d, b)
	}
	wall = wall.Add(time.Hour)
	if e := c.Now(); e != StampAt(wall) {
		t.Fatalf("Now() = %v, want the wall clock %v", e, StampAt(wall))
	}
}

func TestClockObserve(t *testing.T) {
	wall := time.UnixMilli(5_000_000)
	c := NewClock(func() time.Time { return wall })
	peer := StampAt(wall.Add(2*time.Second)) + 7 // a faster clock
	if err := c.Observe(peer); err != nil {
		t.Fatalf("Observe(%v) = %v", peer, err)
	}
	if s := c.Now(); s <= peer {
		t.Fatalf("Now() = %v after observing %v, want later", s, peer)
	}
	if err := c.Observe(StampAt(wall)); err != nil { // older: nothing moves
		t.Fatalf("Observe(older) = %v", err)
	}
	far := StampAt(wall.Add(MaxObserveAhead + time.Second))
	if err := c.Observe(far); !errors.Is(err, ErrStampAhead) {
		t.Fatalf("Observe(%v ahead) = %v, want ErrStampAhead", MaxObserveAhead+time.Second, err)
	}
	if s := c.Now(); s >= far {
		t.Fatalf("Now() = %v: a refused observation moved the clock", s)
	}
}

func TestStampString(t *testing.T) {
	for _, s := range []Stamp{0, 1, StampAt(time.UnixMilli(1764574155123)) + 3, Stamp(1<<64 - 1)} {
		got, err := ParseStamp(s.String())
		if err != nil || got != s {
			t.Errorf("ParseStamp(%q) = %v, %v, want %v", s.String(), got, err, s)
		}
	}
	for _, bad := range []string{"", ".", "1", "1.", ".1", "a.1", "1.65536", "281474976710656.0", "-1.0", "1.-1", "1.2.3"} {
		if _, err := ParseStamp(bad); !errors.Is(err, ErrBadStamp) {
			t.Errorf("ParseStamp(%q) = %v, want ErrBadStamp", bad, err)
		}
	}
}

func FuzzParseStamp(f *testing.F) {
	for _, s := range []string{"0.0", "1764574155123.3", "281474976710655.65535", "1.2.3", "", "x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		s, err := ParseStamp(in)
		if err != nil {
			return
		}
		if again, err := ParseStamp(s.String()); err != nil || again != s {
			t.Fatalf("ParseStamp(%q) = %v, but its String %q parses as %v, %v", in, s, s.String(), again, err)
		}
	})
}
