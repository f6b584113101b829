package admission

import (
	"errors"
	"sync"
)

// Shares bounds the Envoy streams a relay serves at once
// (XDS.MaxStreams) and shares them by identity: at the bound, a stream
// of an identity holding less than its share (the bound over the
// identities that hold streams) is admitted and the newest stream of the
// identity holding the most, over its share, is evicted (Unavailable: its
// client reconnects, here or to another relay); a stream of an identity
// at its share is refused. So a workload that opens streams without end
// holds at most the bound, and down to its share as others come. Peers are
// not counted. Safe for concurrent use.
type Shares[S comparable] struct {
	max int

	mu    sync.Mutex
	by    map[string]map[S]uint64 // identity → its streams → when they joined
	of    map[S]string
	seq   uint64
	total int
}

// NewShares returns Shares bounded at max streams (0: no bound).
func NewShares[S comparable](max int) *Shares[S] {
	return &Shares[S]{max: max, by: make(map[string]map[S]uint64), of: make(map[S]string)}
}

// ErrOverShare refuses a stream of an identity at its share.
var ErrOverShare = errors.New("identity holds its share of the relay's streams")

// Join counts s as who's. At the bound it evicts a stream of the identity
// most over its share, returned (with true) for the caller to end, or
// refuses s with ErrOverShare.
func (sh *Shares[S]) Join(s S, who string) (evicted S, ok bool, err error) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.max > 0 && sh.total >= sh.max {
		identities := len(sh.by)
		if _, ok := sh.by[who]; !ok {
			identities++
		}
		share := max(1, sh.max/identities)
		if len(sh.by[who])+1 > share {
			return evicted, false, ErrOverShare
		}
		var most string
		for id, streams := range sh.by {
			if id != who && len(streams) > len(sh.by[most]) {
				most = id
			}
		}
		if len(sh.by[most]) <= share {
			return evicted, false, ErrOverShare
		}
		var newest uint64
		for st, at := range sh.by[most] {
			if at >= newest {
				evicted, newest = st, at
			}
		}
		sh.leaveLocked(evicted)
		ok = true
	}
	if sh.by[who] == nil {
		sh.by[who] = make(map[S]uint64)
	}
	sh.seq++
	sh.by[who][s] = sh.seq
	sh.of[s] = who
	sh.total++
	return evicted, ok, nil
}

// Leave forgets s (once: an evicted stream was forgotten as it was).
func (sh *Shares[S]) Leave(s S) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sh.leaveLocked(s)
}

func (sh *Shares[S]) leaveLocked(s S) {
	who, ok := sh.of[s]
	if !ok {
		return
	}
	delete(sh.of, s)
	delete(sh.by[who], s)
	if len(sh.by[who]) == 0 {
		delete(sh.by, who)
	}
	sh.total--
}

// Len returns the streams counted, and how many of them are who's.
func (sh *Shares[S]) Len(who string) (total, of int) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return sh.total, len(sh.by[who])
}
