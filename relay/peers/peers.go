// Package peers is how a relay talks to the other relays of its tier: the
// metadata every relay-to-relay stream and call carries (who calls, for
// which key, with what proof), the connections to them (Pool), and one
// call to all of them at once (Gather). Which relays there are, and what a
// proof must show on which port, are the relay's.
package peers

import (
	"context"
	"errors"
	"sync"
	"time"

	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
)

// Relay-to-relay streams carry these gRPC metadata keys: the calling
// relay's ID, the aggregation key it subscribes for (so both ends agree on
// it whatever the profile), a proof that it holds the tier's peer secret
// (proof.go: good for that one call), and, if a client of the calling
// relay holds a version the key's views do not cover, when that version
// arrived (a ledger.Stamp: the owner opens an upstream stream after it:
// the relay's keyState.demand).
const (
	MDRelay  = "x-meshrelay-peer"
	MDKey    = "x-meshrelay-key"
	MDAuth   = "x-meshrelay-peer-auth"
	MDDemand = "x-meshrelay-demand"
	// MDSplits carries a key's splits (aggkey.EncodeSplits): in a stream's
	// metadata from the subscribing relay, in the owner's header and
	// trailer back, so that every relay of the tier moves the nodes a
	// divergence check moved, wherever they connect.
	MDSplits = "x-meshrelay-splits-bin"
)

// Pool holds the connections to the tier's other relays, by xDS
// address, each dialled on first use and kept until Close; their calls
// carry the proofs their context asks for (WithProver). It also holds the
// proofs the relay accepted from the others (Replays). Safe for
// concurrent use.
type Pool struct {
	mu      sync.Mutex
	conns   map[string]*grpc.ClientConn
	opts    []grpc.DialOption
	replays *ReplayCache
}

// NewPool returns a pool whose connections carry messages of up to
// maxMsgSize bytes; extra dial options (transport credentials among them)
// come after the pool's own, so they win.
func NewPool(maxMsgSize int, extra ...grpc.DialOption) *Pool {
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsgSize), grpc.MaxCallSendMsgSize(maxMsgSize)),
		// A partitioned owner must be noticed in seconds, not minutes:
		// its keys fall back to the upstream meanwhile. (The server side
		// permits pings every 10 s.)
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 5 * time.Second, PermitWithoutStream: true}),
		// And found again in seconds once reachable (gRPC's default
		// reconnect backoff grows to two minutes).
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           grpcbackoff.Config{BaseDelay: 250 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 3 * time.Second},
			MinConnectTimeout: 5 * time.Second,
		}),
	}, append(ProofOptions(), extra...)...)
	return &Pool{conns: make(map[string]*grpc.ClientConn), opts: opts, replays: NewReplayCache(DefaultReplayCapacity)}
}

// Replays returns the proofs the relay accepted from the tier's other
// relays (a Verifier's). It lives here because the pool is the relay's
// one handle on its tier's traffic, both ways.
func (p *Pool) Replays() *ReplayCache { return p.replays }

// Conn returns the connection to the relay at addr, dialling it on first
// use.
func (p *Pool) Conn(addr string) (*grpc.ClientConn, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c := p.conns[addr]; c != nil {
		return c, nil
	}
	c, err := grpc.NewClient(addr, p.opts...)
	if err != nil {
		return nil, err
	}
	p.conns[addr] = c
	return c, nil
}

// Ready reports whether the connection to the relay at addr is up, and
// nudges it to reconnect if it is not.
func (p *Pool) Ready(addr string) bool {
	c, err := p.Conn(addr)
	if err != nil {
		return false
	}
	if s := c.GetState(); s != connectivity.Ready {
		c.Connect()
		return false
	}
	return true
}

// Close closes every connection.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, c := range p.conns {
		errs = append(errs, c.Close())
	}
	clear(p.conns)
	return errors.Join(errs...)
}

// Gather calls every relay at addrs at once and returns the answers,
// and the errors of those that failed, by address.
func Gather[T any](ctx context.Context, p *Pool, addrs []string, call func(context.Context, *grpc.ClientConn) (T, error)) ([]T, map[string]error) {
	var (
		mu      sync.Mutex
		wg      sync.WaitGroup
		out     []T
		missing map[string]error
	)
	for _, addr := range addrs {
		wg.Go(func() {
			var v T
			conn, err := p.Conn(addr)
			if err == nil {
				v, err = call(ctx, conn)
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if missing == nil {
					missing = make(map[string]error)
				}
				missing[addr] = err
				return
			}
			out = append(out, v)
		})
	}
	wg.Wait()
	return out, missing
}
