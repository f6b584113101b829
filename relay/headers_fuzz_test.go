package relay

import (
	"context"
	"log/slog"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/ledger/ledgerpb"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/peers"
)

// The headers a relay reads from a call's incoming metadata, and where
// each is fuzzed:
//   - x-meshrelay-peer, -key, -peer-auth, -demand, -splits-bin (a
//     relay-to-relay stream: identifyPeer): FuzzIdentifyPeer;
//   - x-meshrelay-peer, -peer-auth (a ledger or inspect call:
//     checkPeerCall): FuzzCheckPeerCall;
//   - the proof alone: peers.FuzzVerifyProof; a stamp alone:
//     ledger.FuzzParseStamp; splits alone: aggkey.FuzzDecodeSplits;
//   - authorization on the xDS TLS port (auth.BearerToken):
//     auth.FuzzBearer; on the admin API (admin.Guard): admin.FuzzGuardToken.
// Owners' splits in a stream's header and trailer (readSplits,
// askMember) are decoded by aggkey.DecodeSplits alone.

// fuzzSecret is the tier secret of the fuzzed relays.
var fuzzSecret = []byte("fuzzed tier secret")

// fuzzRelay is a relay enough to read headers: a tier secret and a
// replay cache, no listener.
func fuzzRelay() *Relay {
	return &Relay{
		cfg:  Config{ID: "relay-self", Tier: TierConfig{Secret: fuzzSecret}},
		log:  slog.New(slog.DiscardHandler),
		pool: peers.NewPool(1 << 20),
		srv:  &server{authLogs: newAuthLogLimiter()},
	}
}

// methodStream makes grpc.Method(ctx) answer method, as a server stream's
// context does.
type methodStream struct{ method string }

func (s methodStream) Method() string             { return s.method }
func (methodStream) SetHeader(metadata.MD) error  { return nil }
func (methodStream) SendHeader(metadata.MD) error { return nil }
func (methodStream) SetTrailer(metadata.MD) error { return nil }
func incoming(method string, md metadata.MD) context.Context {
	ctx := grpc.NewContextWithServerTransportStream(context.Background(), methodStream{method})
	return metadata.NewIncomingContext(ctx, md)
}

// FuzzIdentifyPeer: a relay-to-relay stream's metadata is untrusted.
// identifyPeer never panics; it refuses with InvalidArgument or
// Unauthenticated; it accepts only a fresh proof minted with the tier's
// secret for the name, method and key claimed, and once; and what it
// accepts reads back as sent (the name, the key, the demand's stamp, the
// splits).
func FuzzIdentifyPeer(f *testing.F) {
	split := string(aggkey.EncodeSplits([]aggkey.Split{aggkey.NewSplit(node("ns", "a", 2), node("ns", "a", 1))}))
	// A proof of the right shape another secret made. (No seed carries a
	// good one without mint: each fuzzing worker is a process of its own,
	// which could not tell it from a forgery.)
	other := deltaProof([]byte("another tier's secret"), "relay-a", "key")
	f.Add("relay-a", false, "key", other, false, "", "")
	f.Add("relay-a", false, "key", "", true, "", "")
	f.Add("relay-a", false, "key", "", true, "1700000000000.3", split)
	f.Add("relay-a", true, "key", "", true, "", "")
	f.Add("relay-a", false, "key", "", true, "x.1", "[]")
	f.Add("relay-a", false, "", "", true, "", `[{"id":""}]`)
	f.Add("", false, "k", "2.1.00.00", false, "", "")
	f.Fuzz(func(t *testing.T, id string, twoIDs bool, key, proof string, mint bool, demand, splits string) {
		r := fuzzRelay()
		if mint {
			proof = deltaProof(fuzzSecret, id, key)
		}
		md := metadata.MD{}
		md.Append(peers.MDRelay, id)
		if twoIDs {
			md.Append(peers.MDRelay, id)
		}
		md.Append(peers.MDKey, key)
		if proof != "" {
			md.Append(peers.MDAuth, proof)
		}
		if demand != "" {
			md.Append(peers.MDDemand, demand)
		}
		if splits != "" {
			md.Append(peers.MDSplits, splits)
		}
		pi, err := r.identifyPeer(incoming(methodDelta, md), portPlain)
		if err != nil {
			if c := status.Code(err); c != codes.InvalidArgument && c != codes.Unauthenticated || pi != nil {
				t.Fatalf("identifyPeer(%q, %q) = %+v, %v: want nil and InvalidArgument or Unauthenticated", id, key, pi, err)
			}
			return
		}
		if pi == nil {
			t.Fatalf("identifyPeer(%q, %q): a stream naming a relay taken for an Envoy's", id, key)
		}
		if !mint {
			t.Fatalf("identifyPeer accepted %q with proof %q, which the secret did not make", id, proof)
		}
		if twoIDs || pi.id != id || string(pi.key) != key || key == "" || len(key) > maxKeyLen {
			t.Fatalf("identifyPeer(%q, %q, two ids %v) = %+v", id, key, twoIDs, pi)
		}
		if demand != "" {
			if s, err := ledger.ParseStamp(demand); err != nil || s != pi.demand {
				t.Fatalf("identifyPeer took demand %q as %v (ParseStamp: %v, %v)", demand, pi.demand, s, err)
			}
		}
		if splits != "" {
			// What the relay keeps is what it decoded, and tells on as
			// the tier's other relays would have.
			want, err := aggkey.DecodeSplits([]byte(splits))
			if err != nil || string(aggkey.EncodeSplits(want)) != string(aggkey.EncodeSplits(pi.splits)) {
				t.Fatalf("identifyPeer took splits %q as %v (DecodeSplits: %v)", splits, pi.splits, err)
			}
		}
		if _, err := r.identifyPeer(incoming(methodDelta, md), portPlain); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("identifyPeer of the same metadata again: %v, want Unauthenticated", err)
		}
	})
}

// FuzzCheckPeerCall: a ledger or inspect call's metadata is untrusted.
// checkPeerCall never panics, refuses with PermissionDenied or
// Unauthenticated, and admits only one named relay with a fresh proof of
// the tier's secret for that name and method, on any port.
func FuzzCheckPeerCall(f *testing.F) {
	p := peers.Prover{Secret: []byte("another tier's secret"), ID: "relay-a"}
	f.Add("relay-a", false, p.Proof(ledgerpb.Ledger_GetSummary_FullMethodName, ""), false, "", uint8(0))
	f.Add("relay-a", false, "", true, "", uint8(1))
	f.Add("relay-a", true, "", true, "", uint8(2))
	f.Add("relay-a", false, "", true, "k", uint8(0))
	f.Add("", false, "", true, "", uint8(0))
	f.Add("relay-a", false, p.Proof(methodDelta, ""), false, "", uint8(0))
	f.Fuzz(func(t *testing.T, id string, twoIDs bool, proof string, mint bool, key string, portN uint8) {
		r := fuzzRelay()
		const method = ledgerpb.Ledger_GetSummary_FullMethodName
		if mint {
			proof = peers.Prover{Secret: fuzzSecret, ID: id}.Proof(method, key)
		}
		md := metadata.Pairs(peers.MDRelay, id)
		if twoIDs {
			md.Append(peers.MDRelay, id)
		}
		if proof != "" {
			md.Append(peers.MDAuth, proof)
		}
		if key != "" {
			md.Append(peers.MDKey, key)
		}
		p := port(portN % 3)
		err := r.checkPeerCall(incoming(method, md), p, "ledger")
		if err != nil {
			if c := status.Code(err); c != codes.PermissionDenied && c != codes.Unauthenticated {
				t.Fatalf("checkPeerCall(%q) on %s: %v, want PermissionDenied or Unauthenticated", id, p, err)
			}
			return
		}
		if !mint || twoIDs || id == "" {
			t.Fatalf("checkPeerCall admitted %q (two ids %v) with proof %q on %s", id, twoIDs, proof, p)
		}
		if err := r.checkPeerCall(incoming(method, md), p, "ledger"); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("checkPeerCall of the same metadata again: %v, want Unauthenticated", err)
		}
	})
}
