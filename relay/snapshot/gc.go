package snapshot

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/meshrelay/meshrelay/ledger"
)

// collector runs a collection pass every GCInterval while this relay is the
// collector.
func (s *Store) collector(ctx context.Context) {
	t := time.NewTicker(s.cfg.GCInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !s.owns(GCLeaderKey) {
			s.gcPrev = nil // another relay collects; start over if we take over
			continue
		}
		if n, err := s.Collect(ctx); err != nil {
			s.log.Warn("snapshot collection failed", "err", err)
		} else if n > 0 {
			s.log.Info("snapshot collection", "deleted", n)
		}
	}
}

// Collect runs one collection pass and returns the number of objects it
// deleted. A resource, chunk or batch record is deleted when this pass and
// the previous one both found that no key refers to it (no key applies it)
// and it was not rewritten in between: a writer puts objects before the
// record that refers to them, so an object on its way to being referenced
// was written after the previous pass. A pass that cannot read every key's index deletes
// nothing. Collect is called by the collector goroutine; tests call it
// directly (never both at once).
func (s *Store) Collect(ctx context.Context) (int, error) {
	// A new epoch first: every writer's next write fails until it has
	// forgotten what it believed etcd holds, so a write that refers to an
	// object without writing it either landed before the indexes are read
	// below (and counts), or writes the object again (a newer revision,
	// which no deletion below matches).
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	_, err := s.cli.Put(rctx, s.epochKey(), time.Now().UTC().Format(time.RFC3339))
	cancel()
	if err != nil {
		return 0, fmt.Errorf("snapshot: collection epoch: %w", err)
	}
	ix, err := s.readIndexes(ctx, 0)
	if err != nil {
		return 0, err
	}
	if !ix.complete {
		return 0, errors.New("snapshot: some records are unreadable: collecting nothing")
	}
	refs := make(map[ledger.Hash]bool)
	for _, vs := range ix.views {
		for _, v := range vs {
			for _, h := range v.entries {
				refs[h] = true
			}
		}
	}
	cand := maps.Clone(ix.deadBatches)
	for _, dir := range []string{"res/", "chunk/"} {
		prefix := s.root + dir
		if _, err := s.listPrefix(ctx, prefix, ix.rev, true, func(k, _ []byte, modRev int64) error {
			hs, _, _ := strings.Cut(strings.TrimPrefix(string(k), prefix), "/")
			h, err := ledger.ParseHash(hs)
			if err != nil {
				return nil
			}
			if (dir == "res/" && !refs[h]) || (dir == "chunk/" && !ix.chunkRefs[h]) {
				cand[string(k)] = modRev
			}
			return nil
		}); err != nil {
			return 0, err
		}
	}
	deleted := 0
	for k, modRev := range cand {
		if prev, ok := s.gcPrev[k]; !ok || prev != modRev {
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		resp, err := s.cli.Txn(rctx).
			If(clientv3.Compare(clientv3.ModRevision(k), "=", modRev)).
			Then(clientv3.OpDelete(k)).
			Commit()
		cancel()
		if err != nil {
			return deleted, err
		}
		if resp.Succeeded {
			deleted++
			delete(cand, k)
		}
	}
	s.gcPrev = cand
	s.m.gcDeleted.Add(float64(deleted))
	return deleted, nil
}
