package snapshot

import (
	"cmp"
	"context"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay"
)

// listPrefix calls fn for every key under prefix, at revision rev (0: the
// latest, which it returns), in pages of listPage keys.
func (s *Store) listPrefix(ctx context.Context, prefix string, rev int64, keysOnly bool, fn func(k, v []byte, modRev int64) error) (int64, error) {
	end := clientv3.GetPrefixRangeEnd(prefix)
	from := prefix
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
			return rev, fmt.Errorf("read %s: %w", strings.TrimPrefix(prefix, s.root), err)
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
// and rebuilds each key's views, checking every type against the roots the
// writer recorded: a type that does not add up (a record lost or damaged)
// is left out, so the relay fetches it from its source instead of serving
// it.
func (s *Store) readIndexes(ctx context.Context) (*index, error) {
	ix := &index{views: map[string]map[string]*view{}, chunkRefs: map[ledger.Hash]bool{}, deadBatches: map[string]int64{}, complete: true}
	raw := make(map[keyID]*keyIndex)
	keysPrefix := s.root + "keys/"
	var err error
	ix.rev, err = s.listPrefix(ctx, keysPrefix, 0, false, func(k, v []byte, modRev int64) error {
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
	chunks := make(map[ledger.Hash][]byte)
	if _, err := s.listPrefix(ctx, s.root+"chunk/", ix.rev, false, func(k, v []byte, _ int64) error {
		h, err := ledger.ParseHash(strings.TrimPrefix(string(k), s.root+"chunk/"))
		if err == nil && ledger.HashBytes(v) == h {
			chunks[h] = v
		}
		return nil
	}); err != nil {
		return nil, err
	}
	s.addKnown(slices.Collect(maps.Keys(chunks))...)
	for id, ki := range raw {
		key, vs, err := rebuild(ki, chunks, ix.chunkRefs)
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

// rebuild applies a key's batch records to its base, in revision order,
// noting the chunks its head refers to.
func rebuild(ki *keyIndex, chunks map[ledger.Hash][]byte, chunkRefs map[ledger.Hash]bool) (string, map[string]*view, error) {
	h, err := decodeHead(ki.head)
	if err != nil {
		return "", nil, fmt.Errorf("head: %w", err)
	}
	out := make(map[string]*view, len(h.Types))
	bad := make(map[string]bool)
	for _, ht := range h.Types {
		v := &view{full: ht.Full, root: ht.Root, entries: make(map[string]ledger.Hash, ht.N)}
		for _, ch := range ht.Chunks {
			chunkRefs[ch] = true
			b, ok := chunks[ch]
			if !ok {
				bad[ht.Type] = true
				continue
			}
			es, err := decodeChunk(b)
			if err != nil {
				bad[ht.Type] = true
				continue
			}
			for _, e := range es {
				v.entries[e.Name] = e.Hash
			}
		}
		out[ht.Type] = v
	}
	slices.SortFunc(ki.batches, func(a, b applied) int { return cmp.Compare(a.rev, b.rev) })
	for _, a := range ki.batches {
		for _, lt := range a.types {
			if lt.Drop {
				delete(out, lt.Type)
				delete(bad, lt.Type)
				continue
			}
			v := out[lt.Type]
			if v == nil {
				v = &view{entries: make(map[string]ledger.Hash)}
				out[lt.Type] = v
			}
			for _, e := range lt.Set {
				v.entries[e.Name] = e.Hash
			}
			for _, n := range lt.Del {
				delete(v.entries, n)
			}
			v.full, v.root = lt.Full, lt.Root
		}
	}
	for t, v := range out {
		if bad[t] || rootOf(v.entries) != v.root {
			delete(out, t)
		}
	}
	return h.Key, out, nil
}

func rootOf(entries map[string]ledger.Hash) ledger.Hash {
	b := ledger.Tree[struct{}]{}.Edit()
	for n, h := range entries {
		b.Set(n, h, struct{}{})
	}
	return b.Tree().Root()
}

// Load implements relay.Snapshots: every key's views, with the resources
// they refer to. A type whose records or resources are missing or damaged
// is left out.
func (s *Store) Load(ctx context.Context) ([]relay.SavedKey, error) {
	start := time.Now()
	ix, err := s.readIndexes(ctx)
	if err != nil {
		return nil, err
	}
	rev, views := ix.rev, ix.views
	need := make(map[ledger.Hash]bool)
	for _, vs := range views {
		for _, v := range vs {
			for _, h := range v.entries {
				need[h] = true
			}
		}
	}
	bodies, err := s.readResources(ctx, rev, need)
	if err != nil {
		return nil, err
	}
	var out []relay.SavedKey
	for _, key := range slices.Sorted(maps.Keys(views)) {
		sk := relay.SavedKey{Key: key}
		for _, t := range slices.Sorted(maps.Keys(views[key])) {
			v := views[key][t]
			st := relay.SavedType{Type: t, Full: v.full, Root: v.root, Resources: make([]relay.SavedResource, 0, len(v.entries))}
			complete := true
			for name, h := range v.entries {
				b, ok := bodies[h]
				if !ok || b.typ != t {
					complete = false
					break
				}
				st.Resources = append(st.Resources, relay.SavedResource{Name: name, Body: b.body})
			}
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

// readResources reads every resource record at rev and returns the bodies
// of those in need, opened if sealed and joined if in parts.
func (s *Store) readResources(ctx context.Context, rev int64, need map[ledger.Hash]bool) (map[ledger.Hash]body, error) {
	out := make(map[ledger.Hash]body, len(need))
	parts := make(map[ledger.Hash]map[int][]byte)
	records := make(map[ledger.Hash]resourceRecord)
	prefix := s.root + "res/"
	_, err := s.listPrefix(ctx, prefix, rev, false, func(k, v []byte, _ int64) error {
		rest := strings.TrimPrefix(string(k), prefix)
		hs, part, isPart := strings.Cut(rest, "/")
		h, err := ledger.ParseHash(hs)
		if err != nil {
			return nil
		}
		s.addKnown(h)
		if !need[h] {
			return nil
		}
		if isPart {
			i, err := strconv.Atoi(part)
			if err == nil && i >= 0 && i < maxParts {
				if parts[h] == nil {
					parts[h] = make(map[int][]byte)
				}
				parts[h][i] = v
			}
			return nil
		}
		rr, err := decodeResource(v)
		if err != nil {
			s.log.Warn("resource record unreadable", "hash", hs, "err", err)
			return nil
		}
		records[h] = rr
		return nil
	})
	if err != nil {
		return nil, err
	}
	for h, rr := range records {
		b := rr.Body
		if rr.Flags&flagParts != 0 {
			b = make([]byte, 0, rr.Total)
			for i := range rr.Parts {
				b = append(b, parts[h][i]...)
			}
			if len(b) != rr.Total {
				continue
			}
		}
		if rr.Flags&flagSealed != 0 {
			if s.sealer == nil {
				continue
			}
			var err error
			if b, err = s.sealer.open(b, h); err != nil {
				s.log.Warn("sealed resource does not open", "hash", h.String(), "err", err)
				continue
			}
		} else if rr.Type == secretType {
			continue // never trust a Secret stored in clear
		}
		out[h] = body{typ: rr.Type, body: b}
	}
	return out, nil
}
