package snapshot

import (
	"context"
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
		if s.cfg.GCLeader != nil && !s.cfg.GCLeader() {
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
// deleted. A resource or chunk is deleted when this pass and the previous
// one both found that no key refers to it and it was not rewritten in
// between: a writer puts objects before the record that refers to them, so
// an object on its way to being referenced is young, and GCInterval is far
// longer than any write. A pass that cannot read every key's index deletes
// nothing. Collect is called by the collector goroutine; tests call it
// directly (never both at once).
func (s *Store) Collect(ctx context.Context) (int, error) {
	rev, views, err := s.readIndexes(ctx)
	if err != nil {
		return 0, err
	}
	refs := make(map[ledger.Hash]bool)
	for _, vs := range views {
		for _, v := range vs {
			for _, h := range v.entries {
				refs[h] = true
			}
		}
	}
	// Chunks are referenced by heads; read them again to know which.
	chunkRefs, err := s.referencedChunks(ctx, rev)
	if err != nil {
		return 0, err
	}
	cand := make(map[string]int64)
	for _, dir := range []string{"res/", "chunk/"} {
		prefix := s.root + dir
		if _, err := s.listPrefix(ctx, prefix, rev, true, func(k, _ []byte, modRev int64) error {
			hs, _, _ := strings.Cut(strings.TrimPrefix(string(k), prefix), "/")
			h, err := ledger.ParseHash(hs)
			if err != nil {
				return nil
			}
			if (dir == "res/" && !refs[h]) || (dir == "chunk/" && !chunkRefs[h]) {
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
			s.forget(k)
		}
	}
	s.gcPrev = cand
	s.m.gcDeleted.Add(float64(deleted))
	return deleted, nil
}

// referencedChunks returns the chunks some key's head refers to.
func (s *Store) referencedChunks(ctx context.Context, rev int64) (map[ledger.Hash]bool, error) {
	out := make(map[ledger.Hash]bool)
	prefix := s.root + "keys/"
	_, err := s.listPrefix(ctx, prefix, rev, false, func(k, v []byte, _ int64) error {
		if !strings.HasSuffix(string(k), "/head") {
			return nil
		}
		h, err := decodeHead(v)
		if err != nil {
			return err // a head we cannot read: delete nothing
		}
		for _, t := range h.Types {
			for _, c := range t.Chunks {
				out[c] = true
			}
		}
		return nil
	})
	return out, err
}

// forget drops a deleted object from the known set, so a writer that needs
// it again writes it.
func (s *Store) forget(k string) {
	rest := strings.TrimPrefix(k, s.root)
	_, hs, _ := strings.Cut(rest, "/")
	hs, _, _ = strings.Cut(hs, "/")
	if h, err := ledger.ParseHash(hs); err == nil {
		s.mu.Lock()
		delete(s.known, h)
		s.mu.Unlock()
	}
}
