package ledger

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Stamp orders the versions of one key's view of a type: of two views of
// the same key and type, the one with the larger Stamp is the newer. A Hash
// says what a view is; a Stamp says when, in the key's history, it was true.
//
// A Stamp is a hybrid logical clock reading (Kulkarni et al., 2014): the
// high 48 bits are milliseconds of wall-clock time since the Unix epoch, the
// low 16 bits a counter that orders readings within one millisecond (and
// carries the clock past a reading from a faster clock). The zero Stamp is
// "unordered": older than every stamped view. Clients of a relay built
// before stamps, or of another control plane, declare content with no
// Stamp; the relay's view wins over it, as it always did.
//
// Who stamps. Only a key's source stamps: the relay that holds the key's
// upstream stream (its owner, or a relay in fallback while the owner is
// unreachable) stamps each view when it receives it, with its Clock. A
// relay that subscribes to the owner takes the owner's Stamps with the
// views, so the same version has the same Stamp on every relay that holds
// it; every response to an Envoy carries the Stamp of the view it was built
// from (SotW version_info, Delta resource versions), and so does what the
// Envoy declares when it reconnects. Snapshots in etcd carry a lower bound
// of the Stamps of the views they hold.
//
// Why the order holds where views travel:
//   - Within one source, readings of its Clock only grow, so a later receipt
//     has a larger Stamp: the order is the source's receipt order, which is
//     the upstream's order on one stream.
//   - A Clock is moved past every Stamp the relay learns from the tier (a
//     peer's response or declaration, a restored snapshot; Observe), so a
//     relay that becomes a key's source after another (a ring change, a
//     crash, a restart) stamps after everything of the key it has seen,
//     whatever the clocks say; the wall-clock part orders sources that never
//     saw each other (a crashed owner and its successor) as real time does,
//     to within the clocks' skew.
//   - A restored snapshot is stamped at or before its views were received,
//     so it is older than anything a live source receives after the relay
//     started, and newer than nothing it did not see.
//   - During a partition two relays may both act as a key's source: each
//     orders its own views, and when the partition heals the deposed one
//     subscribes to the owner and takes the owner's views. Its Envoys'
//     content stamped later than the owner's view is kept until the owner's
//     view is newer, which its next receipt is (its Clock observed theirs).
//
// What it cannot order: two sources that are live at the same time receive
// the same upstream changes at different moments. A source whose receipt of
// an upstream change lags another's by more than the time between two
// changes stamps the older version later. The tier keeps such overlaps to a
// switch of source (make-before-break) and to fallbacks, and the robustness
// suite (loadtest chaos) checks every Envoy's history for regressions.
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

// String renders s as "<milliseconds>.<counter>", its form on the wire.
func (s Stamp) String() string {
	return strconv.FormatUint(uint64(s)>>logicalBits, 10) + "." + strconv.FormatUint(uint64(s)&(1<<logicalBits-1), 10)
}

// ErrBadStamp is returned by ParseStamp for anything that is not a Stamp's
// String form.
var ErrBadStamp = errors.New("ledger: not a version stamp")

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
	if limit := c.wall() + StampAt(time.UnixMilli(MaxObserveAhead.Milliseconds())); s > limit {
		return fmt.Errorf("%w: %s, more than %v ahead", ErrStampAhead, s.Time().UTC().Format(time.RFC3339Nano), MaxObserveAhead)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.last = max(c.last, s)
	return nil
}

func (c *Clock) wall() Stamp {
	if c.now == nil {
		return StampAt(time.Now())
	}
	return StampAt(c.now())
}
