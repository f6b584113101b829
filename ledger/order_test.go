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

func TestOrderCovers(t *testing.T) {
	s := func(ms int64) Stamp { return StampAt(time.UnixMilli(ms)) }
	o := func(session, at int64) Order { return Order{Session: s(session), At: s(at)} }
	for _, tt := range []struct {
		name string
		v, c Order
		want bool
	}{
		{"a client of unknown content holds nothing known", o(10, 20), Order{}, true},
		{"a view of unknown age covers nothing ordered", Order{}, o(10, 20), false},
		{"same stream, later", o(10, 30), o(10, 20), true},
		{"same stream, equal", o(10, 20), o(10, 20), true},
		{"same stream, earlier", o(10, 15), o(10, 20), false},
		{"a stream opened after the client's arrived", o(25, 26), o(10, 20), true},
		{"opened at the same reading as it arrived: not known to be after", o(20, 21), o(10, 20), false},
		{"opened in the millisecond it arrived, at a higher count of another clock: not known to be after",
			Order{Session: s(20) + 3, At: s(21)}, Order{Session: s(10), At: s(20) + 1}, false},
		{"opened in the next millisecond", Order{Session: s(21), At: s(22)}, Order{Session: s(10), At: s(20) + 9}, true},
		{"same stream, a later count of its clock", Order{Session: s(10), At: s(20) + 2}, Order{Session: s(10), At: s(20) + 1}, true},
		{"opened before the client's arrived: a concurrent stream", o(15, 40), o(10, 20), false},
		{"an older stream, however late it arrived (a frozen relay)", o(5, 90), o(10, 20), false},
		{"a mix covers by its earliest session only", o(10, 30).Mix(o(25, 26)), o(10, 20), false},
		{"a mix whose every stream opened later", o(30, 31).Mix(o(25, 40)), o(10, 20), true},
		{"a mix is covered only by a stream opened after its latest part", o(28, 36), o(10, 30).Mix(o(25, 26)), false},
		{"a stream opened after a mix's latest part", o(31, 32), o(10, 30).Mix(o(25, 26)), true},
		{"a mix is on no stream, even one it shares a session with", o(10, 90), o(10, 20).Mix(o(10, 30)), false},
		{"a bound is covered by a stream opened after it", o(21, 22), Bound(s(20)), true},
		{"a bound is on no stream", o(20, 90), Bound(s(20)), false},
	} {
		if got := tt.v.Covers(tt.c); got != tt.want {
			t.Errorf("%s: %v.Covers(%v) = %v, want %v", tt.name, tt.v, tt.c, got, tt.want)
		}
	}
}

func TestOrderMix(t *testing.T) {
	s := func(ms int64) Stamp { return StampAt(time.UnixMilli(ms)) }
	a, b := Order{Session: s(10), At: s(30)}, Order{Session: s(25), At: s(26)}
	for _, tt := range []struct {
		name string
		got  Order
		want Order
	}{
		{"two streams", a.Mix(b), Order{Session: s(10), At: s(30), Mixed: true}},
		{"either way", b.Mix(a), Order{Session: s(10), At: s(30), Mixed: true}},
		{"itself", a.Mix(a), a},
		{"a part of unknown age", a.Mix(Order{}), Order{}},
		{"again", a.Mix(b).Mix(Order{Session: s(5), At: s(6)}), Order{Session: s(5), At: s(30), Mixed: true}},
	} {
		if tt.got != tt.want {
			t.Errorf("%s: %v, want %v", tt.name, tt.got, tt.want)
		}
	}
	// Whatever covers the mix covers each part, and the mix covers only
	// what each part covers.
	parts := []Order{a, b}
	m := a.Mix(b)
	for _, v := range []Order{{Session: s(31), At: s(40)}, {Session: s(10), At: s(50)}, {Session: s(27), At: s(28)}} {
		if v.Covers(m) && !(v.Covers(a) && v.Covers(b)) {
			t.Errorf("%v covers %v but not each of %v", v, m, parts)
		}
	}
	for _, c := range []Order{{Session: s(1), At: s(5)}, {Session: s(10), At: s(20)}, {Session: s(1), At: s(12)}} {
		if m.Covers(c) && !(a.Covers(c) && b.Covers(c)) {
			t.Errorf("%v covers %v but not each of %v does", m, c, parts)
		}
	}
}

func TestOrderString(t *testing.T) {
	o := Order{Session: StampAt(time.UnixMilli(1764574155123)), At: StampAt(time.UnixMilli(1764574155200)) + 4}
	for _, o := range []Order{o, o.Mix(Order{Session: o.Session + 1, At: o.At + 1}), Bound(o.At)} {
		if got, err := ParseOrder(o.String()); err != nil || got != o {
			t.Errorf("ParseOrder(%q) = %v, %v, want %v", o.String(), got, err, o)
		}
	}
	for _, bad := range []string{"", "/", "1.0", "1.0/", "/1.0", "2.0/1.0", "1.0/x", "1.0/2.0/3.0", "1.0~2.0/3.0", "0.0~0.0", "2.0~1.0"} {
		if _, err := ParseOrder(bad); !errors.Is(err, ErrBadOrder) {
			t.Errorf("ParseOrder(%q) = %v, want ErrBadOrder", bad, err)
		}
	}
}

func FuzzParseOrder(f *testing.F) {
	for _, s := range []string{"0.0/0.0", "1764574155123.3/1764574155200.0", "2.0/1.0", "1.0/2.0/3.0", "", "1764574155123.3~1764574155200.0", "0.0~0.0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		o, err := ParseOrder(in)
		if err != nil {
			return
		}
		if o.At < o.Session {
			t.Fatalf("ParseOrder(%q) = %v: arrived before its stream opened", in, o)
		}
		if again, err := ParseOrder(o.String()); err != nil || again != o {
			t.Fatalf("ParseOrder(%q) = %v, but its String %q parses as %v, %v", in, o, o.String(), again, err)
		}
	})
}

func TestClockLater(t *testing.T) {
	c := NewClock(nil)
	a := c.Now()
	b := c.Now() // the same millisecond, most likely: a higher count
	l := c.Later(time.Second, 7)
	if !a.Before(l) || !b.Before(l) {
		t.Fatalf("Later() = %v, not in a later millisecond than %v and %v", l, a, b)
	}
	if l&(1<<logicalBits-1) != 7 {
		t.Fatalf("Later(_, 7) = %v: its counter is not the spread asked", l)
	}
	if n := c.Now(); n <= l {
		t.Fatalf("Now() = %v after Later() = %v: the clock went back", n, l)
	}
	ahead := StampAt(time.Now().Add(time.Hour))
	c.mu.Lock()
	c.last = ahead // as if it observed a clock an hour ahead
	c.mu.Unlock()
	if l := c.Later(5*time.Millisecond, 0); l <= ahead {
		t.Fatalf("Later() = %v after waiting its most, want above %v all the same", l, ahead)
	}
}
