package snapshot

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// loadProbeTimeout bounds Load's first request.
const loadProbeTimeout = 2 * time.Second

// listPrefix calls fn for every key under prefix, at revision rev (0: the
// latest, which it returns), in pages of listPage keys.
func (s *Store) listPrefix(ctx context.Context, prefix string, rev int64, keysOnly bool, fn func(k, v []byte, modRev int64) error) (int64, error) {
	return s.listRange(ctx, prefix, clientv3.GetPrefixRangeEnd(prefix), rev, keysOnly, fn)
}

// listRange is listPrefix for the keys in [from, end).
func (s *Store) listRange(ctx context.Context, from, end string, rev int64, keysOnly bool, fn func(k, v []byte, modRev int64) error) (int64, error) {
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(listPage), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend)}
		if rev != 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		if keysOnly {
			opts = append(opts, clientv3.WithKeysOnly())
		}
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		resp, err := s.cli.Get(rctx, from, opts...)
		cancel()
		if err != nil {
			return rev, fmt.Errorf("read %s: %w", strings.TrimPrefix(from, s.root), err)
		}
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for _, kv := range resp.Kvs {
			if err := fn(kv.Key, kv.Value, kv.ModRevision); err != nil {
				return rev, err
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return rev, nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// keyIndex is one key's head as read from etcd, and the batch records
// that apply on top of it.
type keyIndex struct {
	head    []byte
	headRev int64
	batches []applied
}

// applied is one batch record's change to a key.
type applied struct {
	rev   int64
	types []logType
}

// view is a type's entries rebuilt from a head and its log.
type view struct {
	full    bool
	root    ledger.Hash
	entries map[string]ledger.Hash
}

// index is every key's views as etcd holds them at one revision.
type index struct {
	rev   int64
	views map[string]map[string]*view // key → type → view
	// chunks some head refers to, and batch records that no key applies
	// any more (etcd key → mod revision): for the collector.
	chunkRefs   map[ledger.Hash]bool
	deadBatches map[string]int64
	// complete is false if a head could not be read: a collector must then
	// delete nothing.
	complete bool
}

// readIndexes reads every key's head and the batch records at one revision
// and rebuilds each key's views. A type whose chunks are missing or damaged
// is left out; the relay checks the rest against the roots the writer
// recorded, so a lost or damaged record costs a warm type, not a wrong one.
//
// rev 0 reads the latest revision (and reports it in the index).
func (s *Store) readIndexes(ctx context.Context, rev int64) (*index, error) {
	ix := &index{views: map[string]map[string]*view{}, chunkRefs: map[ledger.Hash]bool{}, deadBatches: map[string]int64{}, complete: true}
	raw := make(map[keyID]*keyIndex)
	keysPrefix := s.root + "keys/"
	var err error
	ix.rev, err = s.listPrefix(ctx, keysPrefix, rev, false, func(k, v []byte, modRev int64) error {
		idHex, what, ok := strings.Cut(strings.TrimPrefix(string(k), keysPrefix), "/")
		var id keyID
		if !ok || what != "head" || len(idHex) != 2*len(id) {
			return nil
		}
		if _, err := hex.Decode(id[:], []byte(idHex)); err != nil {
			return nil
		}
		raw[id] = &keyIndex{head: v, headRev: modRev}
		return nil
	})
	if err != nil {
		return nil, err
	}
	batchPrefix := s.root + "batch/"
	if _, err := s.listPrefix(ctx, batchPrefix, ix.rev, false, func(k, v []byte, modRev int64) error {
		rec, err := decodeBatch(v)
		if err != nil {
			s.m.corrupt.Inc()
			s.log.Warn("batch record unreadable: the keys it names are not loaded", "record", strings.TrimPrefix(string(k), s.root), "err", err)
			ix.complete = false
			return nil
		}
		live := false
		for _, g := range rec.Groups {
			for _, id := range g.Keys {
				if ki := raw[id]; ki != nil && modRev > ki.headRev {
					ki.batches = append(ki.batches, applied{rev: modRev, types: g.Types})
					live = true
				}
			}
		}
		if !live {
			ix.deadBatches[string(k)] = modRev
		}
		return nil
	}); err != nil {
		return nil, err
	}
	// Chunks are decoded once, whatever the number of heads that share them.
	chunks := make(map[ledger.Hash][]entry)
	if _, err := s.listPrefix(ctx, s.root+"chunk/", ix.rev, false, func(k, v []byte, _ int64) error {
		h, err := ledger.ParseHash(strings.TrimPrefix(string(k), s.root+"chunk/"))
		if err != nil || ledger.HashBytes(v) != h {
			return nil
		}
		if es, err := decodeChunk(v); err == nil {
			chunks[h] = es
		}
		return nil
	}); err != nil {
		return nil, err
	}
	s.addKnown(slices.Collect(maps.Keys(chunks))...)
	rebuilt := make(map[ledger.Hash]*view)
	byRoot := make(map[typeRoot]*view)
	for id, ki := range raw {
		key, vs, err := rebuild(ki, chunks, ix.chunkRefs, rebuilt, byRoot)
		if err != nil {
			s.m.corrupt.Inc()
			s.log.Warn("snapshot of key unreadable: not loaded", "key_id", hex.EncodeToString(id[:]), "err", err)
			ix.complete = false
			continue
		}
		if idOf(key) != id {
			s.m.corrupt.Inc()
			s.log.Warn("snapshot head names another key: not loaded", "key", key)
			continue
		}
		ix.views[key] = vs
	}
	return ix, nil
}

// history is how one type of a key came to be: a base (nil if the type
// appeared after it) and the changes applied since, in order.
type history struct {
	typ   string
	base  *headType
	steps []logType
}

// signature identifies a history: keys that changed alike (most keys of a
// namespace) have the same, and their view is rebuilt and checked once.
func (h *history) signature() ledger.Hash {
	d := sha256.New()
	d.Write([]byte(h.typ))
	if h.base != nil {
		d.Write(encodeHead(head{Types: []headType{*h.base}}))
	}
	for _, st := range h.steps {
		d.Write(encodeChanges([]logType{st}))
	}
	var sum ledger.Hash
	d.Sum(sum[:0])
	return sum
}

// rebuild applies a key's batch records to its base, in revision order,
// noting the chunks its head refers to. Views already rebuilt for the same
// history (in views) are shared, not rebuilt: a nil entry there is a
// history that did not add up.
func rebuild(ki *keyIndex, chunks map[ledger.Hash][]entry, chunkRefs map[ledger.Hash]bool, views map[ledger.Hash]*view, byRoot map[typeRoot]*view) (string, map[string]*view, error) {
	h, err := decodeHead(ki.head)
	if err != nil {
		return "", nil, fmt.Errorf("head: %w", err)
	}
	hist := make(map[string]*history, len(h.Types))
	for i := range h.Types {
		ht := &h.Types[i]
		for _, ch := range ht.Chunks {
			chunkRefs[ch] = true
		}
		hist[ht.Type] = &history{typ: ht.Type, base: ht}
	}
	slices.SortFunc(ki.batches, func(a, b applied) int { return cmp.Compare(a.rev, b.rev) })
	for _, a := range ki.batches {
		for _, lt := range a.types {
			if lt.Drop {
				delete(hist, lt.Type)
				continue
			}
			th := hist[lt.Type]
			if th == nil {
				th = &history{typ: lt.Type}
				hist[lt.Type] = th
			}
			th.steps = append(th.steps, lt)
		}
	}
	out := make(map[string]*view, len(hist))
	for t, th := range hist {
		sig := th.signature()
		v, seen := views[sig]
		if !seen {
			v = th.replay(chunks, byRoot)
			views[sig] = v
		}
		if v != nil {
			out[t] = v
		}
	}
	return h.Key, out, nil
}

// replay rebuilds a type's view from its history. It returns nil if a
// chunk is missing or damaged. It does not check the view against its root:
// the relay does, once per distinct root, as it builds the view's tree (a
// root costs a hash per entry; doing it here too was a third of a warm
// start). Views of the same root and content are shared.
func (h *history) replay(chunks map[ledger.Hash][]entry, byRoot map[typeRoot]*view) *view {
	v := &view{entries: make(map[string]ledger.Hash)}
	if b := h.base; b != nil {
		v.full, v.root = b.Full, b.Root
		v.entries = make(map[string]ledger.Hash, b.N)
		for _, ch := range b.Chunks {
			es, ok := chunks[ch]
			if !ok {
				return nil
			}
			for _, e := range es {
				v.entries[e.Name] = e.Hash
			}
		}
	}
	for _, st := range h.steps {
		for _, e := range st.Set {
			v.entries[e.Name] = e.Hash
		}
		for _, n := range st.Del {
			delete(v.entries, n)
		}
		v.full, v.root = st.Full, st.Root
	}
	tr := typeRoot{h.typ, v.root}
	if known := byRoot[tr]; known != nil && known.full == v.full && maps.Equal(known.entries, v.entries) {
		return known
	}
	if byRoot[tr] == nil {
		byRoot[tr] = v
	}
	return v
}

type typeRoot struct {
	typ  string
	root ledger.Hash
}

// Load implements relay.Snapshots: every key's views, with the resources
// they refer to. A type whose chunks or resources are missing or damaged
// is left out; roots are the relay's to check.
func (s *Store) Load(ctx context.Context) ([]xds.SavedKey, error) {
	start := time.Now()
	// One revision for every read; the indexes and the resources (most of
	// the bytes) are read at once. The first read is bounded tightly: the
	// relay holds its streams until Load returns, and an etcd that is away
	// must cost it a cold start, not a late one.
	rctx, cancel := context.WithTimeout(ctx, min(s.cfg.RequestTimeout, loadProbeTimeout))
	resp, err := s.cli.Get(rctx, s.root, clientv3.WithPrefix(), clientv3.WithCountOnly())
	cancel()
	if err != nil {
		return nil, fmt.Errorf("read snapshots: %w", err)
	}
	rev := resp.Header.Revision
	var (
		ix          *index
		bodies      map[ledger.Hash]body
		ixErr, rErr error
		wg          sync.WaitGroup
	)
	wg.Go(func() { ix, ixErr = s.readIndexes(ctx, rev) })
	wg.Go(func() { bodies, rErr = s.readResources(ctx, rev) })
	wg.Wait()
	if err := errors.Join(ixErr, rErr); err != nil {
		return nil, err
	}
	views := ix.views
	var out []xds.SavedKey
	// Keys with the same view share one list of resources (they are read,
	// never changed).
	lists := make(map[*view][]xds.SavedResource)
	for _, key := range slices.Sorted(maps.Keys(views)) {
		sk := xds.SavedKey{Key: key}
		for _, t := range slices.Sorted(maps.Keys(views[key])) {
			v := views[key][t]
			st := xds.SavedType{Type: t, Full: v.full, Root: v.root}
			list, complete := lists[v]
			if !complete {
				list, complete = make([]xds.SavedResource, 0, len(v.entries)), true
				for name, h := range v.entries {
					b, ok := bodies[h]
					if !ok || b.typ != t {
						complete = false
						break
					}
					list = append(list, xds.SavedResource{Name: name, Body: b.body})
				}
				if complete {
					lists[v] = list
				}
			}
			st.Resources = list
			if !complete {
				s.m.corrupt.Inc()
				s.log.Warn("snapshot type incomplete: not loaded", "key", key, "type", t)
				continue
			}
			sk.Types = append(sk.Types, st)
		}
		if len(sk.Types) > 0 {
			out = append(out, sk)
		}
	}
	s.log.Info("snapshots loaded", "keys", len(out), "resources", len(bodies), "revision", rev, "took", time.Since(start).Round(time.Millisecond))
	return out, nil
}

type body struct {
	typ  string
	body []byte
}

// readResources reads every resource record at rev and returns their
// bodies, opened if sealed and joined if in parts. (It reads them all, while
// the indexes that say which are needed are read beside it: the few no key
// needs are collected garbage-to-be.)
func (s *Store) readResources(ctx context.Context, rev int64) (map[ledger.Hash]body, error) {
	// Four ranges of the hash space, read at once: etcd serves each on a
	// core of its own, and the client decodes them side by side.
	prefix := s.root + "res/"
	bounds := []string{prefix, prefix + "4", prefix + "8", prefix + "c", clientv3.GetPrefixRangeEnd(prefix)}
	type part struct {
		records map[ledger.Hash]resourceRecord
		parts   map[ledger.Hash]map[int][]byte
		err     error
	}
	results := make([]part, len(bounds)-1)
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() {
			p := part{records: map[ledger.Hash]resourceRecord{}, parts: map[ledger.Hash]map[int][]byte{}}
			_, p.err = s.listRange(ctx, bounds[i], bounds[i+1], rev, false, func(k, v []byte, _ int64) error {
				rest := strings.TrimPrefix(string(k), prefix)
				hexHash, idx, isPart := strings.Cut(rest, "/")
				h, err := ledger.ParseHash(hexHash)
				if err != nil {
					return nil
				}
				if isPart {
					n, err := strconv.Atoi(idx)
					if err == nil && n >= 0 && n < maxParts {
						if p.parts[h] == nil {
							p.parts[h] = make(map[int][]byte)
						}
						p.parts[h][n] = v
					}
					return nil
				}
				rr, err := decodeResource(v)
				if err != nil {
					s.log.Warn("resource record unreadable", "hash", hexHash, "err", err)
					return nil
				}
				p.records[h] = rr
				return nil
			})
			results[i] = p
		})
	}
	wg.Wait()
	out := make(map[ledger.Hash]body)
	for _, p := range results {
		if p.err != nil {
			return nil, p.err
		}
		for h, rr := range p.records {
			if b, ok := s.bodyOf(h, rr, p.parts[h]); ok {
				out[h] = body{typ: rr.Type, body: b}
			}
		}
	}
	// Only what reads back whole counts as held: anything else is written
	// again when a key needs it (a Secret sealed under an older key, say).
	s.addKnown(slices.Collect(maps.Keys(out))...)
	return out, nil
}

// bodyOf returns the body of the resource record rr of hash h: joined from
// parts if stored in parts, opened if sealed. ok is false if it does not
// read back whole, or is stored in clear while it must be sealed (a
// Secret, or anything that sets a sensitive field: never trusted).
func (s *Store) bodyOf(h ledger.Hash, rr resourceRecord, parts map[int][]byte) (b []byte, ok bool) {
	b = rr.Body
	if rr.Flags&flagParts != 0 {
		b = make([]byte, 0, rr.Total)
		for i := range rr.Parts {
			b = append(b, parts[i]...)
		}
		if len(b) != rr.Total {
			return nil, false
		}
	}
	switch {
	case rr.Flags&flagSealed != 0:
		if s.sealer == nil {
			return nil, false
		}
		var err error
		if b, err = s.sealer.open(b, h); err != nil {
			s.log.Warn("sealed resource does not open", "hash", h.String(), "err", err)
			return nil, false
		}
	case mustSealBody(rr.Type, b):
		// In clear, yet it must be sealed (written by a relay from before
		// sensitive fields were sealed): not trusted, nor taken to be held,
		// so that it is written again sealed, or not at all.
		return nil, false
	}
	return b, true
}
