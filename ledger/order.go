package ledger

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Stamp is a hybrid logical clock reading (Kulkarni et al., 2014): the
// high 48 bits are milliseconds of wall-clock time since the Unix epoch, the
// low 16 bits a counter that orders readings within one millisecond (and
// carries the clock past a reading from a faster clock). The zero Stamp is
// "never". Versions are ordered by pairs of them (Order).
type Stamp uint64

// logicalBits is the width of a Stamp's counter.
const logicalBits = 16

// StampAt returns the Stamp of wall-clock time t with counter 0.
func StampAt(t time.Time) Stamp {
	ms := t.UnixMilli()
	if ms < 0 {
		return 0
	}
	return Stamp(uint64(ms) << logicalBits)
}

// Time returns the wall-clock part of s.
func (s Stamp) Time() time.Time {
	return time.UnixMilli(int64(uint64(s) >> logicalBits))
}

// Before reports whether s is known to be earlier than t in real time:
// they fall in different milliseconds. Two readings of one millisecond are
// ordered by their counters only on one clock (or one that observed the
// other); two relays' clocks count their own readings, so a stream one
// relay opened in the millisecond another relay received content may have
// the higher count and be the earlier all the same (the simulation's seed
// 3707: a restarted owner's stream, opened 0.9 ms before a change arrived
// at a relay that switched to it, covered the change, and the relay's
// Envoys were sent the cluster's removal). Comparisons across streams use
// Before; those of one stream's arrivals, read on one clock, the counters.
func (s Stamp) Before(t Stamp) bool {
	return s|(1<<logicalBits-1) < t
}

// String renders s as "<milliseconds>.<counter>", its form on the wire.
func (s Stamp) String() string {
	return strconv.FormatUint(uint64(s)>>logicalBits, 10) + "." + strconv.FormatUint(uint64(s)&(1<<logicalBits-1), 10)
}

// ErrBadStamp is returned by ParseStamp for anything that is not a Stamp's
// String form.
var ErrBadStamp = errors.New("ledger: not a version stamp")

// Order says how new a version of one key's view of a type is, where a
// Hash says what it is. The key's source (the relay that holds its upstream
// stream: its owner, or a relay in fallback while the owner is
// unreachable) gives each view it receives an Order: Session is its Clock's
// reading when it opened the upstream stream the view came on, At its
// reading when the view arrived. A relay that subscribes to the owner takes
// the owner's Orders with the views, every response to an Envoy carries the
// Order of the view it was built from (SotW version_info, Delta resource
// versions), and so does what the Envoy declares when it reconnects.
//
// An Order is a pair of bounds on the upstream's history. Content of Order o
// is at least as new as the upstream's state when o's stream was opened
// (Session; and, on that one stream, as anything that arrived on it before
// At), and no newer than the upstream's state at At. A view is sent over
// what a client holds only if its lower bound is past the client's upper
// bound (Covers): so no path sends a client content older than content it
// held (Session and At are readings of different relays' clocks: o's stream
// must be opened in a later millisecond than c arrived, Stamp.Before).
// Content made of parts of several views (a relay that subscribes to
// the owner and was sent only part of the owner's view keeps the rest of
// its own) has a Mixed Order (Mix): the earliest of the parts' Sessions
// and the latest of their arrivals, and no single stream, so it covers and
// is covered across streams only. The zero Order is "unknown": the view of
// a snapshot restored from etcd, which covers nothing a client holds. What a
// client declares without an Order (a version of another control plane, of
// a relay built before Orders, or of an unknown view) is bounded by the
// moment it declares it (Bound): whatever it holds arrived before that.
//
// Why Covers is safe. An upstream sends, on one stream, states of the key in
// the order they happened, each received after it happened: a view is at
// least as new as the upstream's state when its stream was opened (the
// upstream answers a stream's subscription with what it has then), and no
// newer than the upstream's state when it arrived. So view v is at least as
// new as view c if both came on the same stream and v arrived later, or if
// v's stream was opened after c arrived (c.At.Before(v.Session)). Nothing else is
// known: two streams open at the same time receive the same changes at
// different moments (a relay frozen for 10 s reads ten seconds of changes
// at once when it resumes, each "arriving" late, and it has no way to tell
// that its stream is behind; its Orders say so all the same, since its
// Session is older than anything it did not send itself). A client whose
// version the view does not cover keeps what it holds; the source then
// opens a new stream (Relay renews a session when a client declares a
// version its own does not cover, at most once a second per key), whose
// Session is after every version it was shown, so the wait lasts that
// second and a round trip to the upstream at most. Clocks are compared
// across relays: a relay's Clock observes every Order it learns from the
// tier, and Envoys' declarations are never observed (an Envoy cannot move
// a relay's clock); what clocks of different machines disagree by beyond
// that is a window in which a cross-relay comparison can be wrong. The
// argument also takes the upstream to be one consistent source: replicas
// that lag each other are not (a stream opened later on a lagging replica
// is older).
//
// Why clocks, and not the etcd fence revision or ring incarnations: what
// must be ordered is upstream streams, and every relay that is a key's
// source opens one, owner or not (a relay in fallback, a relay partitioned
// away, a tier run without etcd); only the owner claims a fence, and ring
// incarnations order members, not streams, and differ between the views of
// two relays. A clock reading needs no coordination on the data path, and
// the hybrid clock keeps causality (a relay that has seen a stream's
// versions opens its next one after them) where wall clocks alone would not.
type Order struct {
	Session, At Stamp
	// Mixed marks the Order of content from more than one view (Mix):
	// Session is the earliest of their Sessions, and no stream's.
	Mixed bool
}

// IsZero reports whether o is the zero (unknown) Order.
func (o Order) IsZero() bool { return o == Order{} }

// Covers reports whether content of Order o is known to be at least as new
// as content of Order c: c is zero (nothing is known of it, and nothing
// held), or both came on the same upstream stream and o arrived no
// earlier, or o's stream (every stream of a Mixed o) was opened after c
// arrived, in a later millisecond (Stamp.Before). A zero o covers nothing
// but a zero c.
func (o Order) Covers(c Order) bool {
	if c.IsZero() {
		return true
	}
	if o.IsZero() {
		return false
	}
	return (o.SameStream(c) && o.At >= c.At) || c.At.Before(o.Session)
}

// SameStream reports whether o and c are Orders of views that came on one
// upstream stream: a later view of o's stream may cover c without a new
// stream.
func (o Order) SameStream(c Order) bool {
	return !o.Mixed && !c.Mixed && !o.IsZero() && o.Session == c.Session
}

// Mix returns the Order of content made of parts of content of Orders o
// and p: covered only by what covers both, and covering only what both
// cover. Zero if either is zero (a part of unknown age).
func (o Order) Mix(p Order) Order {
	switch {
	case o.IsZero() || p.IsZero():
		return Order{}
	case o == p:
		return o
	}
	return Order{Session: min(o.Session, p.Session), At: max(o.At, p.At), Mixed: true}
}

// Bound returns the Order of content that arrived no later than at, of
// unknown origin: what a client declares without an Order, at the moment
// it declares it. Only a stream opened after at covers it.
func Bound(at Stamp) Order { return Order{Session: at, At: at, Mixed: true} }

// String renders o as "<session>/<at>", or "<session>~<at>" if Mixed: its
// form on the wire.
func (o Order) String() string {
	sep := "/"
	if o.Mixed {
		sep = "~"
	}
	return o.Session.String() + sep + o.At.String()
}

// ErrBadOrder is returned by ParseOrder for anything that is not an Order's
// String form.
var ErrBadOrder = errors.New("ledger: not a version order")

// ParseOrder parses the String form of an Order. The input comes back from
// clients, so it is untrusted: anything malformed is ErrBadOrder.
func ParseOrder(str string) (Order, error) {
	mixed := false
	sess, at, ok := strings.Cut(str, "/")
	if !ok {
		sess, at, ok = strings.Cut(str, "~")
		mixed = true
	}
	if !ok {
		return Order{}, fmt.Errorf("%w: %q", ErrBadOrder, str)
	}
	s, err := ParseStamp(sess)
	if err != nil {
		return Order{}, fmt.Errorf("%w: %q", ErrBadOrder, str)
	}
	a, err := ParseStamp(at)
	if err != nil || a < s || mixed && s == 0 {
		// A Mix of Orders has a Session; only the zero Order has none.
		return Order{}, fmt.Errorf("%w: %q", ErrBadOrder, str)
	}
	return Order{Session: s, At: a, Mixed: mixed}, nil
}

// ParseStamp parses the String form of a Stamp. The input comes back from
// clients, so it is untrusted: anything malformed is ErrBadStamp.
func ParseStamp(str string) (Stamp, error) {
	msPart, logPart, ok := strings.Cut(str, ".")
	if !ok {
		return 0, fmt.Errorf("%w: %q", ErrBadStamp, str)
	}
	ms, err := strconv.ParseUint(msPart, 10, 64-logicalBits)
	if err != nil {
		return 0, fmt.Errorf("%w: %q", ErrBadStamp, str)
	}
	l, err := strconv.ParseUint(logPart, 10, logicalBits)
	if err != nil {
		return 0, fmt.Errorf("%w: %q", ErrBadStamp, str)
	}
	return Stamp(ms<<logicalBits | l), nil
}

// Clock is a hybrid logical clock: Now never returns a Stamp at or below
// one it returned or observed before. Safe for concurrent use.
type Clock struct {
	// now is the wall clock; time.Now if nil (tests set it).
	now func() time.Time

	mu   sync.Mutex
	last Stamp
}

// NewClock returns a Clock reading the wall clock now (time.Now if nil).
func NewClock(now func() time.Time) *Clock {
	return &Clock{now: now}
}

// Now returns a Stamp above every Stamp the Clock returned or observed.
func (c *Clock) Now() Stamp {
	wall := c.wall()
	c.mu.Lock()
	defer c.mu.Unlock()
	if wall > c.last {
		c.last = wall
	} else {
		c.last++
	}
	return c.last
}

// Later returns a Stamp of a later millisecond than every Stamp the Clock
// returned or observed (each is Before it), waiting for the wall clock to
// get there: a millisecond at most, unless the Clock observed a faster
// clock's Stamps. It waits wait at most, and then returns Now. An upstream
// stream's Session reads it, so that the stream is known, across relays,
// to be opened after all the relay had seen (a client's declaration, an
// arrival, a peer's demand). Its counter starts at spread (below 1<<15;
// the Clock's next readings count on from there): a caller that draws it
// at random makes two relays' streams opened in one millisecond differ,
// as SameStream needs (they collide 1 time in 32,768).
func (c *Clock) Later(wait time.Duration, spread uint16) Stamp {
	deadline := time.Now().Add(wait)
	for {
		wall := c.wall()
		c.mu.Lock()
		if c.last.Before(wall) {
			c.last = wall | Stamp(spread&(1<<(logicalBits-1)-1))
			s := c.last
			c.mu.Unlock()
			return s
		}
		next := (c.last | (1<<logicalBits - 1)) + 1 // the next millisecond's first reading
		c.mu.Unlock()
		d := next.Time().Sub(c.wallTime())
		if time.Now().Add(d).After(deadline) {
			return c.Now()
		}
		time.Sleep(d)
	}
}

// MaxObserveAhead bounds how far ahead of the wall clock an observed Stamp
// may be: a relay whose clock is off by more than this (or a damaged
// snapshot) must not drag the tier's clocks with it.
const MaxObserveAhead = time.Minute

// ErrStampAhead is returned by Observe for a Stamp more than
// MaxObserveAhead ahead of the wall clock.
var ErrStampAhead = errors.New("ledger: stamp too far ahead of the clock")

// Observe moves the Clock past s: a Stamp the relay learned from another
// relay of the tier or from a snapshot. Stamps from untrusted clients must
// not be observed (one could push the clock anywhere). A Stamp more than
// MaxObserveAhead ahead of the wall clock is refused with ErrStampAhead.
func (c *Clock) Observe(s Stamp) error {
	if limit := StampAt(c.wallTime().Add(MaxObserveAhead)); s > limit {
		return fmt.Errorf("%w: %s, more than %v ahead", ErrStampAhead, s.Time().UTC().Format(time.RFC3339Nano), MaxObserveAhead)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.last = max(c.last, s)
	return nil
}

// Last returns the latest Stamp the Clock returned or observed.
func (c *Clock) Last() Stamp {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last
}

func (c *Clock) wall() Stamp { return StampAt(c.wallTime()) }

func (c *Clock) wallTime() time.Time {
	if c.now == nil {
		return time.Now()
	}
	return c.now()
}
