package sim

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Store stands in for the etcd a tier persists its keys' views in: one per
// simulated tier, shared by its relays, each of which writes through a
// StoreClient of its own (relay.Snapshots). It keeps the fencing that
// relay/snapshot gives the relay: the first write of a key by a member
// claims the key (the fence moves to a new revision), and a member's writes
// hold only while the fence is still at the revision its claim produced; a
// member fenced off writes the key again only for a later term. Safe for
// concurrent use.
type Store struct {
	mu   sync.Mutex
	rev  int64
	keys map[string]*storedKey
	held map[heldKey]xds.HeldVersion
	down bool
}

// heldKey names a held version (relay.HeldVersions): a key's version of a
// type.
type heldKey struct {
	key, typeURL string
	root         ledger.Hash
}

type storedKey struct {
	fenceRev    int64
	fenceMember string
	types       []xds.SavedType
}

// ErrStoreDown is returned while the store is down.
var ErrStoreDown = errors.New("sim: snapshot store is down")

// NewStore returns an empty store.
func NewStore() *Store {
	return &Store{keys: map[string]*storedKey{}, held: map[heldKey]xds.HeldVersion{}}
}

// SetDown takes the store down (every read and write fails) or brings it
// back, as an etcd outage would.
func (s *Store) SetDown(down bool) {
	s.mu.Lock()
	s.down = down
	s.mu.Unlock()
}

// Keys returns the persisted keys, sorted.
func (s *Store) Keys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Sorted(maps.Keys(s.keys))
}

// claim makes member the writer of key and returns the fence's revision.
func (s *Store) claim(key, member string) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return 0, ErrStoreDown
	}
	s.rev++
	k := s.keys[key]
	if k == nil {
		k = &storedKey{}
		s.keys[key] = k
	}
	k.fenceRev, k.fenceMember = s.rev, member
	return s.rev, nil
}

// errFenced is a write refused by the fence.
var errFenced = errors.New("sim: deposed: another member claimed the key")

// write stores key's views if the fence is still at claimRev.
func (s *Store) write(key string, claimRev int64, types []xds.SavedType) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return ErrStoreDown
	}
	k := s.keys[key]
	if k == nil || k.fenceRev != claimRev {
		return errFenced
	}
	s.rev++
	k.types = types
	return nil
}

// load returns every persisted key.
func (s *Store) load() ([]xds.SavedKey, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return nil, ErrStoreDown
	}
	var out []xds.SavedKey
	for _, key := range slices.Sorted(maps.Keys(s.keys)) {
		if k := s.keys[key]; len(k.types) > 0 {
			out = append(out, xds.SavedKey{Key: key, Types: k.types})
		}
	}
	return out, nil
}

// StoreClient is one relay incarnation's writer to a Store: it implements
// relay.Snapshots as snapshot.Store does (Save hands over the latest views
// and returns; a writer goroutine writes every FlushInterval, retrying
// while the store is down). Start it before the relay and Stop (or Kill)
// it after.
type StoreClient struct {
	s      *Store
	member string
	flush  time.Duration

	mu   sync.Mutex
	jobs map[string]storeJob
	wake chan struct{}

	recs   map[string]*storeRec // the writer's
	cancel context.CancelFunc
	done   chan struct{}
}

var (
	_ relay.Snapshots    = (*StoreClient)(nil)
	_ relay.HeldVersions = (*StoreClient)(nil)
)

type storeJob struct {
	term  uint64
	views []xds.View
}

type storeRec struct {
	claimRev    int64
	deposed     bool
	deposedTerm uint64
}

// Client returns a writer for member (one relay incarnation) that gathers
// changes for flush before writing them.
func (s *Store) Client(member string, flush time.Duration) *StoreClient {
	return &StoreClient{s: s, member: member, flush: flush, jobs: map[string]storeJob{}, wake: make(chan struct{}, 1), recs: map[string]*storeRec{}}
}

// Save implements relay.Snapshots.
func (c *StoreClient) Save(key string, term uint64, views []xds.View) {
	c.mu.Lock()
	c.jobs[key] = storeJob{term: term, views: views}
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// Load implements relay.Snapshots.
func (c *StoreClient) Load(context.Context) ([]xds.SavedKey, error) { return c.s.load() }

// SaveHeld implements relay.HeldVersions. It keeps every body (etcd keeps
// the bodies a relay did not hand over as long as a key's snapshot refers
// to them; here, for the seed's life).
func (c *StoreClient) SaveHeld(_ context.Context, key string, v xds.View, _ []*xds.Resource) error {
	hv := xds.HeldVersion{Type: v.Type, Root: v.Tree.Root()}
	for e := range v.Tree.All() {
		hv.Entries = append(hv.Entries, xds.HeldEntry{Name: e.Name, Hash: e.Hash, Body: e.Value.Body.GetValue()})
	}
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	if c.s.down {
		return ErrStoreDown
	}
	c.s.held[heldKey{key, v.Type, hv.Root}] = hv
	return nil
}

// LoadHeld implements relay.HeldVersions.
func (c *StoreClient) LoadHeld(_ context.Context, key, typeURL string, root ledger.Hash, _ func(ledger.Hash) bool) (xds.HeldVersion, bool, error) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	if c.s.down {
		return xds.HeldVersion{}, false, ErrStoreDown
	}
	hv, ok := c.s.held[heldKey{key, typeURL, root}]
	return hv, ok, nil
}

// Start starts the writer.
func (c *StoreClient) Start() {
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel, c.done = cancel, make(chan struct{})
	go func() {
		defer close(c.done)
		c.run(ctx)
	}()
}

// Stop writes what is left (one try) and stops the writer, as a graceful
// stop of the relay does.
func (c *StoreClient) Stop() {
	c.Kill()
	c.writeAll()
}

// Kill stops the writer; what was not written is lost, as in a crash.
func (c *StoreClient) Kill() {
	if c.cancel != nil {
		c.cancel()
		<-c.done
		c.cancel = nil
	}
}

func (c *StoreClient) run(ctx context.Context) {
	retry := time.Duration(0)
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.wake:
		}
		wait := c.flush
		if retry > 0 {
			wait = retry
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		if c.writeAll() {
			retry = 0
		} else {
			retry = min(max(2*retry, 100*time.Millisecond), 2*time.Second)
			select {
			case c.wake <- struct{}{}:
			default:
			}
		}
	}
}

// writeAll writes every pending job once; it reports whether all were
// written (or dropped as fenced off). Jobs that failed stay, unless a newer
// one replaced them meanwhile.
func (c *StoreClient) writeAll() bool {
	c.mu.Lock()
	jobs := c.jobs
	c.jobs = map[string]storeJob{}
	c.mu.Unlock()
	ok := true
	for _, key := range slices.Sorted(maps.Keys(jobs)) {
		j := jobs[key]
		if err := c.write(key, j); err != nil {
			ok = false
			c.mu.Lock()
			if _, newer := c.jobs[key]; !newer {
				c.jobs[key] = j
			}
			c.mu.Unlock()
		}
	}
	return ok
}

// write writes one key's views, claiming it first if this member has not,
// or was fenced off and the term grew since (relay/snapshot's prepare).
func (c *StoreClient) write(key string, j storeJob) error {
	rec := c.recs[key]
	if rec == nil {
		rec = &storeRec{}
		c.recs[key] = rec
	}
	if rec.deposed && j.term <= rec.deposedTerm {
		return nil // another member writes this key until our ring changes
	}
	if rec.claimRev == 0 || rec.deposed {
		rev, err := c.s.claim(key, c.member)
		if err != nil {
			return err
		}
		rec.claimRev, rec.deposed = rev, false
	}
	err := c.s.write(key, rec.claimRev, savedTypes(j.views))
	if errors.Is(err, errFenced) {
		rec.deposed, rec.deposedTerm = true, j.term
		return nil
	}
	return err
}

// savedTypes is what Load gives back of views: per type, its root and
// resources (names and wire bodies).
func savedTypes(views []xds.View) []xds.SavedType {
	out := make([]xds.SavedType, 0, len(views))
	for _, v := range views {
		st := xds.SavedType{Type: v.Type, Full: v.Full, Root: v.Tree.Root()}
		for e := range v.Tree.All() {
			st.Resources = append(st.Resources, xds.SavedResource{Name: e.Name, Body: e.Value.Body.GetValue()})
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b xds.SavedType) int {
		switch {
		case a.Type < b.Type:
			return -1
		case a.Type > b.Type:
			return 1
		}
		return 0
	})
	return out
}
