package shard

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/buraksezer/consistent"
	"github.com/cespare/xxhash/v2"
)

// Member is one relay of the tier as the ring sees it.
type Member struct {
	// Name is the memberlist name: the relay's ID and a suffix unique to
	// this incarnation of the process.
	Name string
	// XDSAddr is where the relay serves ADS, for Envoys and for peers.
	XDSAddr string
	// AdminAddr is where it serves the admin API ("" if it does not).
	AdminAddr string
	// Conns is the relay's Envoy stream count, as last gossiped.
	Conns int
	// Self marks the local relay.
	Self bool
}

// hashRing places keys on members with consistent hashing with bounded
// loads. It is immutable once built: membership changes build a new one, so
// every relay with the same member set computes the same owners whatever
// order it learned of them in.
type hashRing struct {
	c       *consistent.Consistent
	members map[string]Member
}

type ringMember string

func (m ringMember) String() string { return string(m) }

// xxhasher is consistent's Hasher: xxhash64 is fast, well mixed for short
// similar strings ("0:relay-a", "1:relay-a"), and identical on every relay.
type xxhasher struct{}

func (xxhasher) Sum64(b []byte) uint64 { return xxhash.Sum64(b) }

// replicationFactor is how many points each member has on the circle before
// partitions are placed; consistent's default.
const replicationFactor = 20

// errNoMembers is returned for a ring with no members.
var errNoMembers = errors.New("shard: ring has no members")

// validateRing checks the parameters consistent would otherwise panic on
// or silently misuse: it panics when a load factor below 1 leaves no room
// for a partition.
func validateRing(partitions int, load float64) error {
	var errs []error
	if partitions < 1 || partitions > 1<<20 {
		errs = append(errs, fmt.Errorf("shard: field Partitions is %d, want 1 to %d", partitions, 1<<20))
	}
	if !(load >= 1 && load <= 10) { // also refuses NaN
		errs = append(errs, fmt.Errorf("shard: field Load is %v, want 1 to 10 (1 means perfectly even, no slack)", load))
	}
	return errors.Join(errs...)
}

// newHashRing builds a ring over members. It never panics: parameters are
// validated first, and with a load factor of at least 1 every partition
// finds room (the capacity ceil(P/N·load)·N is at least P).
func newHashRing(members []Member, partitions int, load float64) (*hashRing, error) {
	if err := validateRing(partitions, load); err != nil {
		return nil, err
	}
	if len(members) == 0 {
		return nil, errNoMembers
	}
	byName := make(map[string]Member, len(members))
	names := make([]consistent.Member, 0, len(members))
	for _, m := range members {
		if m.Name == "" {
			return nil, errors.New("shard: member with an empty name")
		}
		if _, dup := byName[m.Name]; dup {
			return nil, fmt.Errorf("shard: member %q listed twice", m.Name)
		}
		byName[m.Name] = m
		names = append(names, ringMember(m.Name))
	}
	// Sorted, so that hash collisions between replica points (if any)
	// resolve the same way on every relay.
	slices.SortFunc(names, func(a, b consistent.Member) int {
		return strings.Compare(a.String(), b.String())
	})
	var (
		c   *consistent.Consistent
		err error
	)
	func() {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("shard: consistent: %v", p)
			}
		}()
		c = consistent.New(names, consistent.Config{
			Hasher:            xxhasher{},
			PartitionCount:    partitions,
			ReplicationFactor: replicationFactor,
			Load:              load,
		})
	}()
	if err != nil {
		return nil, err
	}
	return &hashRing{c: c, members: byName}, nil
}

// locate returns the member that owns key.
func (h *hashRing) locate(key string) Member {
	return h.members[h.c.LocateKey([]byte(key)).String()]
}
