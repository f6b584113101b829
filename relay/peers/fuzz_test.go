package peers

import (
	"errors"
	"testing"
	"time"
)

// FuzzVerifyProof: a proof (MDAuth) is untrusted. Verify never panics,
// refuses with one of its errors, accepts only a proof the secret made
// for that relay, method and key (the seeds), spelled as the Prover
// spells it, and only once.
func FuzzVerifyProof(f *testing.F) {
	at := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	now := func() time.Time { return at }
	type call struct{ id, method, key string }
	// The seeds' nonces are fixed: the fuzzing workers, each a process of
	// its own, must agree on which proofs the secret made.
	minted := map[string]call{}
	for i, c := range []call{{"relay-a", methodA, ""}, {"relay-a", methodB, "key"}} {
		proof := formatProof([]byte("secret"), c.id, c.method, c.key, at.UnixMilli(), [nonceBytes]byte{byte(i + 1)})
		minted[proof] = c
		f.Add(proof, c.id, c.method, c.key)
	}
	f.Add("2.1893553445000.00000000000000000000000000000000.0000000000000000000000000000000000000000000000000000000000000000", "relay-a", methodA, "")
	f.Add("2.-1.00.00", "", "", "")
	f.Add("1.2.3.4.5", "relay-a", methodA, "")
	f.Add("", "", "", "")
	f.Fuzz(func(t *testing.T, proof, id, method, key string) {
		v := Verifier{Secret: []byte("secret"), Replays: NewReplayCache(4), Now: now}
		err := v.Verify(proof, id, method, key)
		if err != nil {
			if !errors.Is(err, ErrMalformedProof) && !errors.Is(err, ErrBadProof) && !errors.Is(err, ErrStaleProof) {
				t.Fatalf("Verify(%q) = %v: not one of its errors", proof, err)
			}
			return
		}
		if c, ok := minted[proof]; !ok || c != (call{id, method, key}) {
			t.Fatalf("Verify(%q, %q, %q, %q) accepted a proof the secret did not make for it", proof, id, method, key)
		}
		pp, err := parseProof(proof)
		if err != nil || formatProof(v.Secret, id, method, key, pp.ms, pp.nonce) != proof {
			t.Fatalf("accepted proof %q does not read back as itself (%v)", proof, err)
		}
		if err := v.Verify(proof, id, method, key); !errors.Is(err, ErrReplayedProof) {
			t.Fatalf("Verify(%q) again = %v, want %v", proof, err, ErrReplayedProof)
		}
	})
}
