package peers

import (
	"context"
	"errors"
	"slices"
	"testing"

	"google.golang.org/grpc"
)

// TestGather: every relay is called at once, on the pool's connection to
// it; the answers come back, and each failure under its relay's address.
func TestGather(t *testing.T) {
	p := NewPool(1 << 20)
	t.Cleanup(func() { p.Close() })
	addrs := []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}
	refused := errors.New("refused")
	got, missing := Gather(context.Background(), p, addrs, func(_ context.Context, c *grpc.ClientConn) (string, error) {
		if c.Target() == addrs[1] {
			return "", refused
		}
		return c.Target(), nil
	})
	slices.Sort(got)
	if !slices.Equal(got, []string{addrs[0], addrs[2]}) {
		t.Errorf("answers = %q, want those of %s and %s", got, addrs[0], addrs[2])
	}
	if len(missing) != 1 || !errors.Is(missing[addrs[1]], refused) {
		t.Errorf("missing = %v, want %s refused", missing, addrs[1])
	}
	if c, err := p.Conn(addrs[0]); err != nil || c.Target() != addrs[0] {
		t.Fatalf("Conn(%s) = %v, %v", addrs[0], c, err)
	}
	first, _ := p.Conn(addrs[0])
	if again, _ := p.Conn(addrs[0]); again != first {
		t.Error("a second Conn to the same relay dialled again")
	}
	if p.Ready("127.0.0.1:1") {
		t.Error("Ready for a relay nothing listens for")
	}
	if err := p.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if none, _ := Gather(context.Background(), p, nil, func(context.Context, *grpc.ClientConn) (int, error) { return 1, nil }); len(none) != 0 {
		t.Errorf("Gather over no relays = %v", none)
	}
}
