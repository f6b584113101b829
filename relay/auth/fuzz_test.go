package auth

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// FuzzBearer feeds arbitrary authorization headers to the bearer parser:
// it never panics, never returns a token longer than the cap, and returns
// a token only from a "Bearer" header.
func FuzzBearer(f *testing.F) {
	for _, s := range []string{"Bearer abc", "bearer  x.y.z ", "Basic abc", "", "Bearer", "Bearer \x00", strings.Repeat("B", 100)} {
		f.Add(s, "")
	}
	f.Add("Bearer a", "Bearer b")
	f.Fuzz(func(t *testing.T, a, b string) {
		vals := []string{a}
		if b != "" {
			vals = append(vals, b)
		}
		tok, err := bearer(vals)
		if err != nil {
			if tok != "" || ReasonOf(err) != BadToken {
				t.Fatalf("bearer(%q) = %q, %v: want no token and a BadToken error", vals, tok, err)
			}
			return
		}
		if len(vals) != 1 || len(tok) > MaxTokenBytes || !strings.EqualFold(a[:6], "bearer") || tok == "" {
			t.Fatalf("bearer(%q) = %q: accepted what it must refuse", vals, tok)
		}
	})
}

// FuzzParseSPIFFEID: never panics; what it accepts prints back to itself.
func FuzzParseSPIFFEID(f *testing.F) {
	for _, s := range []string{"spiffe://cluster.local/ns/default/sa/app", "spiffe://td/ns//sa/x", "spiffe://a/b", "spiffe://x/ns/a/sa/b?q", "spiffe://%2e/ns/a/sa/b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		id, err := ParseSPIFFEID(s)
		if err != nil {
			if ReasonOf(err) != NoSPIFFEID {
				t.Fatalf("ParseSPIFFEID(%q): reason %s, want %s", s, ReasonOf(err), NoSPIFFEID)
			}
			return
		}
		if id.SPIFFEID() != s {
			t.Fatalf("ParseSPIFFEID(%q) = %+v, which prints as %q", s, id, id.SPIFFEID())
		}
	})
}

// FuzzLocalVerifyToken feeds arbitrary tokens to the local verifier: it
// never panics, and accepts nothing but the one token the issuer signed.
func FuzzLocalVerifyToken(f *testing.F) {
	is := authtest.NewIssuer(f)
	now := time.Now()
	good := is.Sign(f, authtest.Token{Namespace: "ns1", ServiceAccount: "app", IssuedAt: now})
	f.Add(good)
	f.Add(good[:len(good)-3])
	f.Add("eyJhbGciOiJub25lIn0.eyJpc3MiOiJ4In0.")
	f.Add("a.b.c")
	f.Add("")
	cfg := DefaultLocalConfig()
	cfg.Issuer, cfg.Keys, cfg.Now = is.URL, KeysFromFile(is.WriteJWKS(f)), func() time.Time { return now }
	l, err := NewLocal(context.Background(), cfg)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, tok string) {
		id, err := l.VerifyToken(context.Background(), tok)
		if err == nil && (tok != good || id.Namespace != "ns1") {
			t.Fatalf("VerifyToken(%q) = %+v: accepted a token the issuer did not sign", tok, id)
		}
	})
}
