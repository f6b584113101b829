package admin

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// FuzzGuardToken: an admin call's authorization headers are untrusted.
// Caller never panics, admits as admin only a call one of whose headers is
// exactly "Bearer <the admin token>", and refuses every other with
// Unauthenticated.
func FuzzGuardToken(f *testing.F) {
	const token = "the-admin-token"
	for _, s := range []string{"Bearer " + token, "bearer " + token, "Bearer " + token + " ", "Bearer", "Basic " + token, "", token} {
		f.Add(s, "", false)
	}
	f.Add("Bearer x", "Bearer "+token, true)
	f.Fuzz(func(t *testing.T, a, b string, two bool) {
		g := &Guard{Token: token}
		md := metadata.Pairs("authorization", a)
		if two {
			md.Append("authorization", b)
		}
		c, err := g.Caller(metadata.NewIncomingContext(context.Background(), md), "/fuzz/Call")
		good := a == "Bearer "+token || two && b == "Bearer "+token
		switch {
		case err != nil && status.Code(err) != codes.Unauthenticated:
			t.Fatalf("Caller(%q, %q) = %v, want Unauthenticated", a, b, err)
		case err != nil && good:
			t.Fatalf("Caller(%q, %q) refused the admin token: %v", a, b, err)
		case err == nil && (!good || !c.Admin):
			t.Fatalf("Caller(%q, %q) = %+v: admitted without the admin token", a, b, c)
		}
	})
}
