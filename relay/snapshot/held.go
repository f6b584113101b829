package snapshot

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Held versions (relay.HeldVersions): what a draining relay's SotW clients
// hold, kept for the relay they reconnect to. A SotW client says of each
// type only the version it holds; once the relays that knew that version
// are gone (a rolling restart), the one it reconnects to finds it here and
// can hold back the removal of clusters its routes still use.
//
//	held/<id>/<type>/<root>   a head of one type: the version's chunks
//
// <type> is 8 bytes of SHA-256 of the type URL, in hex. A record lives on
// a lease of heldTTL: a client reconnects within seconds, and its relay
// looks the version up at once. Chunks are written unless etcd holds them
// (a version most Envoys hold is their key's snapshot); resource bodies
// are written only for what the key's view did not hold (the relay that
// reads the record holds the rest, or etcd does). Collection does not look at held records: it may take a chunk or
// body one refers to once the record is older than GCInterval, and the
// record then fails its root check; the claim is unknown, as it was
// before hand-over.

// heldTTL is how long a held version is kept: one collection interval (so
// what SaveHeld wrote outlives the record; see Collect), or 10 minutes.
func (s *Store) heldTTL() time.Duration {
	if s.cfg.GCInterval > 0 {
		return s.cfg.GCInterval
	}
	return 10 * time.Minute
}

// heldLease returns a lease for held records: the one granted last, if
// less than half of heldTTL ago (a drain's records share one), or a new
// one. A record lives from half to all of heldTTL.
func (s *Store) heldLease(ctx context.Context) (clientv3.LeaseID, error) {
	s.heldMu.Lock()
	defer s.heldMu.Unlock()
	ttl := s.heldTTL()
	if !s.leaseAt.IsZero() && time.Since(s.leaseAt) < ttl/2 {
		return s.lease, nil
	}
	resp, err := s.cli.Grant(ctx, max(1, int64(ttl/time.Second)))
	if err != nil {
		return 0, err
	}
	s.lease, s.leaseAt = resp.ID, time.Now()
	return s.lease, nil
}

func (s *Store) heldKey(id keyID, typeURL string, root ledger.Hash) string {
	t := ledger.HashBytes([]byte(typeURL))
	return s.root + "held/" + hex.EncodeToString(id[:]) + "/" + hex.EncodeToString(t[:8]) + "/" + root.String()
}

// SaveHeld implements relay.HeldVersions: it keeps v (every value set), a
// version a SotW client of key holds, and the bodies of bodies that this
// store has not written itself (its snapshots' and earlier hand-overs'),
// for heldTTL. As in snapshots, what must be sealed (a Secret, anything
// that sets a sensitive field) is kept only sealed (SealKey): without a
// key, a version that holds such a resource is not kept.
func (s *Store) SaveHeld(ctx context.Context, key string, v xds.View, bodies []*xds.Resource) error {
	if s.sealer == nil {
		if v.Type == secretType {
			return nil
		}
		for e := range v.Tree.All() {
			if mustSeal(e.Value) {
				return nil // as in snapshots: not without a seal key
			}
		}
	}
	ht := headType{Type: v.Type, Full: v.Full, Root: v.Tree.Root(), N: v.Tree.Len()}
	chunks := map[ledger.Hash][]byte{}
	for _, c := range chunksOf(v.Tree) {
		b := encodeChunk(c)
		ch := ledger.HashBytes(b)
		ht.Chunks = append(ht.Chunks, ch)
		if !s.isKnown(ch) {
			chunks[ch] = b
		}
	}
	// A version most Envoys hold is most often a key's snapshot, whose
	// chunks its owner wrote: only those etcd lacks are written.
	if err := s.dropPresent(ctx, chunks); err != nil {
		return fmt.Errorf("snapshot: held version of %s: %w", key, err)
	}
	var puts []clientv3.Op
	var fresh []ledger.Hash
	for _, ch := range slices.SortedFunc(maps.Keys(chunks), func(a, b ledger.Hash) int { return bytes.Compare(a[:], b[:]) }) {
		fresh = append(fresh, ch)
		puts = append(puts, clientv3.OpPut(s.chunkKey(ch), string(chunks[ch])))
	}
	rs := make(map[ledger.Hash]*xds.Resource, len(bodies))
	for _, r := range bodies {
		if !s.isKnown(r.Hash) {
			rs[r.Hash] = r
		}
	}
	if err := s.putResources(ctx, rs); err != nil {
		return fmt.Errorf("snapshot: held version of %s: %w", key, err)
	}
	if err := s.commitBatches(ctx, puts); err != nil {
		return fmt.Errorf("snapshot: held version of %s: %w", key, err)
	}
	s.addKnown(fresh...)
	hb := encodeHead(head{Key: key, Types: []headType{ht}})
	if len(hb) > batchBytes {
		return fmt.Errorf("snapshot: held version of %s: head of %d bytes exceeds %d", key, len(hb), batchBytes)
	}
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	lease, err := s.heldLease(rctx)
	if err != nil {
		return fmt.Errorf("snapshot: held version of %s: lease: %w", key, err)
	}
	if _, err := s.cli.Put(rctx, s.heldKey(idOf(key), v.Type, ht.Root), string(hb), clientv3.WithLease(lease)); err != nil {
		s.heldMu.Lock()
		s.leaseAt = time.Time{} // the lease may be gone: a new one next time
		s.heldMu.Unlock()
		return fmt.Errorf("snapshot: held version of %s: %w", key, err)
	}
	s.m.bytes.Add(float64(len(hb)))
	return nil
}

// dropPresent removes from chunks those etcd holds (asked batchOps at a
// time, without their values).
func (s *Store) dropPresent(ctx context.Context, chunks map[ledger.Hash][]byte) error {
	hs := slices.Collect(maps.Keys(chunks))
	for len(hs) > 0 {
		n := min(len(hs), batchOps)
		ops := make([]clientv3.Op, n)
		for i, h := range hs[:n] {
			ops[i] = clientv3.OpGet(s.chunkKey(h), clientv3.WithCountOnly())
		}
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		resp, err := s.cli.Txn(rctx).Then(ops...).Commit()
		cancel()
		if err != nil {
			return fmt.Errorf("read chunks: %w", err)
		}
		for i, r := range resp.Responses {
			if r.GetResponseRange().GetCount() > 0 {
				delete(chunks, hs[i])
			}
		}
		hs = hs[n:]
	}
	return nil
}

// errHeldDamaged: a held record is not the version its etcd key names.
var errHeldDamaged = errors.New("snapshot: held version record damaged")

// LoadHeld implements relay.HeldVersions: the version root of typeURL a
// SotW client of key held when its relay drained it, if one was kept, with
// the bodies of the entries has reports the caller does not hold (nil
// where etcd lost one).
func (s *Store) LoadHeld(ctx context.Context, key, typeURL string, root ledger.Hash, has func(ledger.Hash) bool) (xds.HeldVersion, bool, error) {
	v := xds.HeldVersion{Type: typeURL, Root: root}
	raw, ok, err := s.getOne(ctx, s.heldKey(idOf(key), typeURL, root))
	if err != nil || !ok {
		return v, false, err
	}
	h, err := decodeHead(raw)
	if err != nil {
		return v, false, fmt.Errorf("%w: %w", errHeldDamaged, err)
	}
	if h.Key != key || len(h.Types) != 1 || h.Types[0].Type != typeURL || h.Types[0].Root != root {
		return v, false, fmt.Errorf("%w: it is not version %s of %s of %q", errHeldDamaged, root, xds.ShortType(typeURL), key)
	}
	ht := h.Types[0]
	v.Entries = make([]xds.HeldEntry, 0, min(ht.N, 1<<12)) // N is etcd's word: checked below
	for _, ch := range ht.Chunks {
		b, ok, err := s.getOne(ctx, s.chunkKey(ch))
		if err != nil {
			return v, false, err
		}
		if !ok || ledger.HashBytes(b) != ch {
			return v, false, fmt.Errorf("%w: chunk %s missing or damaged", errHeldDamaged, ch)
		}
		es, err := decodeChunk(b)
		if err != nil {
			return v, false, fmt.Errorf("%w: %w", errHeldDamaged, err)
		}
		for _, e := range es {
			he := xds.HeldEntry{Name: e.Name, Hash: e.Hash}
			if !has(e.Hash) {
				if he.Body, err = s.readResource(ctx, e.Hash); err != nil {
					return v, false, err
				}
			}
			v.Entries = append(v.Entries, he)
		}
	}
	if len(v.Entries) != ht.N {
		return v, false, fmt.Errorf("%w: %d entries, the head says %d", errHeldDamaged, len(v.Entries), ht.N)
	}
	return v, true, nil
}

// getOne reads one etcd key.
func (s *Store) getOne(ctx context.Context, k string) ([]byte, bool, error) {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	resp, err := s.cli.Get(rctx, k)
	if err != nil {
		return nil, false, fmt.Errorf("snapshot: read %s: %w", strings.TrimPrefix(k, s.root), err)
	}
	if len(resp.Kvs) == 0 {
		return nil, false, nil
	}
	return resp.Kvs[0].Value, true, nil
}

// readResource reads one resource's body, joined if in parts and opened if
// sealed: nil if etcd does not hold it whole (or holds a Secret in clear).
func (s *Store) readResource(ctx context.Context, h ledger.Hash) ([]byte, error) {
	raw, ok, err := s.getOne(ctx, s.resKey(h))
	if err != nil || !ok {
		return nil, err
	}
	rr, err := decodeResource(raw)
	if err != nil {
		return nil, nil // damaged: as if lost
	}
	var parts map[int][]byte
	if rr.Flags&flagParts != 0 {
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		resp, err := s.cli.Get(rctx, s.resKey(h)+"/", clientv3.WithPrefix())
		cancel()
		if err != nil {
			return nil, fmt.Errorf("snapshot: read parts of %s: %w", h, err)
		}
		parts = make(map[int][]byte, rr.Parts)
		for _, kv := range resp.Kvs {
			_, idx, _ := strings.Cut(strings.TrimPrefix(string(kv.Key), s.resKey(h)), "/")
			if n, err := strconv.Atoi(idx); err == nil && n >= 0 && n < rr.Parts {
				parts[n] = kv.Value
			}
		}
	}
	b, _ := s.bodyOf(h, rr, parts)
	return b, nil
}
