package relay

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger/ledgerpb"
)

// TestLedgerExchangeWantsPeerProof: the ledger exchange answers only the
// relays of the tier (the same proof as relay-to-relay streams).
func TestLedgerExchangeWantsPeerProof(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 1)
	r := startRelay(t, up, func(c *Config) { c.Tier.Secret = []byte("tier secret") })
	c := ledgerpb.NewLedgerClient(dialPeer(t, r.Addr().String()))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	other := &Relay{cfg: Config{ID: "relay-x", Tier: TierConfig{Secret: []byte("tier secret")}}}
	stranger := &Relay{cfg: Config{ID: "relay-x", Tier: TierConfig{Secret: []byte("another tier")}}}
	for _, tc := range []struct {
		name string
		ctx  context.Context
		want codes.Code
	}{
		{"no peer id", ctx, codes.PermissionDenied},
		{"wrong secret", stranger.asPeer(ctx), codes.Unauthenticated},
		{"a relay of the tier", other.asPeer(ctx), codes.OK},
	} {
		_, err := c.GetSummary(tc.ctx, &ledgerpb.SummaryRequest{})
		if got := status.Code(err); got != tc.want {
			t.Errorf("%s: GetSummary err = %v, want %v", tc.name, err, tc.want)
		}
	}
}
