package ledgerpb

import (
	"errors"
	"fmt"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
)

// ErrBadMessage is returned for a message that does not decode into the
// ledger's types: another relay's answer is checked, not trusted.
var ErrBadMessage = errors.New("ledgerpb: bad message")

func nanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromNanos(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

func hashBytes(h ledger.Hash) []byte {
	if h.IsZero() {
		return nil
	}
	return h[:]
}

func toHash(b []byte, what string) (ledger.Hash, error) {
	var h ledger.Hash
	switch len(b) {
	case 0:
		return h, nil
	case len(h):
		copy(h[:], b)
		return h, nil
	}
	return h, fmt.Errorf("%w: %s is %d bytes, want %d", ErrBadMessage, what, len(b), len(h))
}

// FromScope encodes a Scope.
func FromScope(s ledger.Scope) *Scope { return &Scope{Key: s.Key, KeyPrefix: s.KeyPrefix} }

// ToScope decodes a Scope (nil is every Envoy).
func ToScope(s *Scope) ledger.Scope {
	return ledger.Scope{Key: s.GetKey(), KeyPrefix: s.GetKeyPrefix()}
}

// FromSummary encodes a Summary.
func FromSummary(s *ledger.Summary) *Summary {
	out := &Summary{Relay: s.Relay, At: nanos(s.At), Keys: make([]*KeySummary, len(s.Keys))}
	for i := range s.Keys {
		k := &s.Keys[i]
		pk := &KeySummary{Key: k.Key, Origin: k.Origin, Stale: k.Stale,
			Types: make([]*TypeVersion, len(k.Types)), Envoys: make([]*EnvoyState, len(k.Envoys))}
		for j, tv := range k.Types {
			v := tv.Version
			pk.Types[j] = &TypeVersion{Type: tv.Type, Version: &Version{Seq: v.Seq, Root: hashBytes(v.Root), Received: nanos(v.Received), Len: int64(v.Len)}}
		}
		for j := range k.Envoys {
			e := &k.Envoys[j]
			pe := &EnvoyState{Node: e.Node, ConnectedAt: nanos(e.ConnectedAt), DisconnectedAt: nanos(e.DisconnectedAt), Types: make([]*EnvoyType, len(e.Types))}
			for l, et := range e.Types {
				pe.Types[l] = &EnvoyType{Type: et.Type, Sent: hashBytes(et.Sent), SentAt: nanos(et.SentAt), Pending: et.Pending,
					Acked: hashBytes(et.Acked), AckedAt: nanos(et.AckedAt), Nack: fromNACK(et.NACK)}
			}
			pk.Envoys[j] = pe
		}
		out.Keys[i] = pk
	}
	return out
}

func fromNACK(n *ledger.NACKState) *NACK {
	if n == nil {
		return nil
	}
	return &NACK{Fingerprint: string(n.Fingerprint), Version: n.Version, Detail: n.Detail, At: nanos(n.At)}
}

func toNACK(n *NACK) *ledger.NACKState {
	if n == nil {
		return nil
	}
	return &ledger.NACKState{Fingerprint: ledger.Fingerprint(n.Fingerprint), Version: n.Version, Detail: n.Detail, At: fromNanos(n.At)}
}

// ToSummary decodes a Summary, checking every hash.
func ToSummary(p *Summary) (*ledger.Summary, error) {
	out := &ledger.Summary{Relay: p.GetRelay(), At: fromNanos(p.GetAt()), Keys: make([]ledger.KeySummary, len(p.GetKeys()))}
	for i, pk := range p.GetKeys() {
		k := ledger.KeySummary{Key: pk.GetKey(), Relay: out.Relay, Origin: pk.GetOrigin(), Stale: pk.GetStale(),
			Types: make([]ledger.TypeVersion, len(pk.GetTypes())), Envoys: make([]ledger.EnvoyState, len(pk.GetEnvoys()))}
		for j, tv := range pk.GetTypes() {
			v := tv.GetVersion()
			root, err := toHash(v.GetRoot(), "a root")
			if err != nil {
				return nil, err
			}
			if v.GetLen() < 0 {
				return nil, fmt.Errorf("%w: %d resources", ErrBadMessage, v.GetLen())
			}
			k.Types[j] = ledger.TypeVersion{Type: tv.GetType(), Version: ledger.Version{Seq: v.GetSeq(), Root: root, Received: fromNanos(v.GetReceived()), Len: int(v.GetLen())}}
		}
		for j, pe := range pk.GetEnvoys() {
			e := ledger.EnvoyState{Node: pe.GetNode(), ConnectedAt: fromNanos(pe.GetConnectedAt()), DisconnectedAt: fromNanos(pe.GetDisconnectedAt()),
				Types: make([]ledger.EnvoyType, len(pe.GetTypes()))}
			for l, pt := range pe.GetTypes() {
				sent, err := toHash(pt.GetSent(), "a sent view")
				if err != nil {
					return nil, err
				}
				acked, err := toHash(pt.GetAcked(), "an acked view")
				if err != nil {
					return nil, err
				}
				e.Types[l] = ledger.EnvoyType{Type: pt.GetType(), Sent: sent, SentAt: fromNanos(pt.GetSentAt()), Pending: pt.GetPending(),
					Acked: acked, AckedAt: fromNanos(pt.GetAckedAt()), NACK: toNACK(pt.GetNack())}
			}
			k.Envoys[j] = e
		}
		out.Keys[i] = k
	}
	return out, nil
}

// FromVerdicts encodes a relay's delivery verdicts.
func FromVerdicts(vs []ledger.Verdicts) *DeliveryVerdicts {
	out := &DeliveryVerdicts{Keys: make([]*KeyVerdicts, len(vs))}
	for i, v := range vs {
		pk := &KeyVerdicts{Key: v.Key, References: v.References, Known: v.Known}
		for root, has := range v.Roots {
			b := append([]byte(nil), root[:]...)
			if has {
				pk.Delivered = append(pk.Delivered, b)
			} else {
				pk.NotDelivered = append(pk.NotDelivered, b)
			}
		}
		out.Keys[i] = pk
	}
	return out
}

// ToVerdicts decodes a relay's delivery verdicts, checking every root.
func ToVerdicts(p *DeliveryVerdicts) ([]ledger.Verdicts, error) {
	out := make([]ledger.Verdicts, len(p.GetKeys()))
	for i, pk := range p.GetKeys() {
		v := ledger.Verdicts{Key: pk.GetKey(), References: pk.GetReferences(), Known: pk.GetKnown(),
			Roots: make(map[ledger.Hash]bool, len(pk.GetDelivered())+len(pk.GetNotDelivered()))}
		for _, set := range []struct {
			roots [][]byte
			has   bool
		}{{pk.GetNotDelivered(), false}, {pk.GetDelivered(), true}} {
			for _, b := range set.roots {
				h, err := toHash(b, "a root")
				if err != nil {
					return nil, err
				}
				v.Roots[h] = v.Roots[h] || set.has
			}
		}
		out[i] = v
	}
	return out, nil
}
