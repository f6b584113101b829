// Package memnet is an in-memory network for a tier of relays in one
// process (the demo, the in-process cluster, the tests): a memberlist
// transport whose relays can be partitioned from one another and healed,
// and a dialer that cuts their relay-to-relay gRPC traffic along the same
// lines. Only the network is fake: memberlist runs as it does in production.
package memnet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
)

// Network connects in-memory transports. Its zero value is not usable; call
// NewNetwork. Safe for concurrent use.
type Network struct {
	mu     sync.Mutex
	nodes  map[string]*Transport // by gossip address
	xds    map[string]string     // xDS address → gossip address of its relay
	group  map[string]int        // gossip address → partition group (0: the main one)
	groups int
	conns  map[*trackedConn]struct{}
	next   int
}

// NewNetwork returns an empty network.
func NewNetwork() *Network {
	return &Network{
		nodes: make(map[string]*Transport),
		xds:   make(map[string]string),
		group: make(map[string]int),
		conns: make(map[*trackedConn]struct{}),
	}
}

// ErrPartitioned is returned by dials across a partition.
var ErrPartitioned = errors.New("shardtest: partitioned")

// NewTransport returns a transport with a fresh address on the network.
func (n *Network) NewTransport() *Transport {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.next++
	t := &Transport{
		net:     n,
		addr:    net.JoinHostPort("127.0.0.1", strconv.Itoa(20000+n.next)),
		packets: make(chan *memberlist.Packet, 1024),
		streams: make(chan net.Conn, 64),
		done:    make(chan struct{}),
	}
	n.nodes[t.addr] = t
	return t
}

// Register tells the network that the relay gossiping at gossipAddr serves
// xDS at xdsAddr, so that Dialer can apply partitions to peer traffic.
func (n *Network) Register(gossipAddr, xdsAddr string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.xds[xdsAddr] = gossipAddr
}

// Partition puts the relays at the given gossip addresses on an island of
// their own: gossip between them and the others is dropped, dials fail, and
// open relay-to-relay connections across the cut are closed.
func (n *Network) Partition(gossipAddrs ...string) {
	n.mu.Lock()
	n.groups++
	for _, a := range gossipAddrs {
		n.group[a] = n.groups
	}
	var cut []*trackedConn
	for c := range n.conns {
		if n.group[c.from] != n.group[c.to] {
			cut = append(cut, c)
		}
	}
	n.mu.Unlock()
	for _, c := range cut {
		c.Close()
	}
}

// Heal joins every island back.
func (n *Network) Heal() {
	n.mu.Lock()
	defer n.mu.Unlock()
	clear(n.group)
}

// reachable reports whether from may talk to to.
func (n *Network) reachable(from, to string) bool {
	return n.group[from] == n.group[to]
}

// Dialer returns a gRPC context dialer for the relay gossiping at from: it
// dials TCP for real, but fails across a partition and its connections are
// closed when one is made. Addresses not registered are dialled as they are.
func (n *Network) Dialer(from string) func(ctx context.Context, addr string) (net.Conn, error) {
	return func(ctx context.Context, addr string) (net.Conn, error) {
		n.mu.Lock()
		to, known := n.xds[addr]
		ok := !known || n.reachable(from, to)
		n.mu.Unlock()
		if !ok {
			return nil, fmt.Errorf("dial %s: %w", addr, ErrPartitioned)
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil || !known {
			return c, err
		}
		tc := &trackedConn{Conn: c, net: n, from: from, to: to}
		n.mu.Lock()
		if !n.reachable(from, to) { // partitioned while dialling
			n.mu.Unlock()
			c.Close()
			return nil, fmt.Errorf("dial %s: %w", addr, ErrPartitioned)
		}
		n.conns[tc] = struct{}{}
		n.mu.Unlock()
		return tc, nil
	}
}

type trackedConn struct {
	net.Conn
	net      *Network
	from, to string
	once     sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.net.mu.Lock()
		delete(c.net.conns, c)
		c.net.mu.Unlock()
	})
	return c.Conn.Close()
}

// Transport is a memberlist.Transport on a Network. Packets are delivered
// best-effort (dropped across a partition, to a stopped transport, or when
// the receiver is 1,024 packets behind), as UDP would be.
type Transport struct {
	net     *Network
	addr    string
	packets chan *memberlist.Packet
	streams chan net.Conn
	done    chan struct{}
	once    sync.Once
}

var _ memberlist.Transport = (*Transport)(nil)

// Addr returns the transport's address, for Config.Join.
func (t *Transport) Addr() string { return t.addr }

// FinalAdvertiseAddr implements memberlist.Transport.
func (t *Transport) FinalAdvertiseAddr(string, int) (net.IP, int, error) {
	host, port, _ := net.SplitHostPort(t.addr)
	p, _ := strconv.Atoi(port)
	return net.ParseIP(host), p, nil
}

// peer returns the transport at addr if t may reach it.
func (t *Transport) peer(addr string) *Transport {
	t.net.mu.Lock()
	defer t.net.mu.Unlock()
	dest := t.net.nodes[addr]
	if dest == nil || !t.net.reachable(t.addr, addr) {
		return nil
	}
	return dest
}

// WriteTo implements memberlist.Transport.
func (t *Transport) WriteTo(b []byte, addr string) (time.Time, error) {
	now := time.Now()
	dest := t.peer(addr)
	if dest == nil {
		return now, nil // lost, as a datagram would be
	}
	p := &memberlist.Packet{Buf: append([]byte(nil), b...), From: mockAddr(t.addr), Timestamp: now}
	select {
	case dest.packets <- p:
	case <-dest.done:
	default:
	}
	return now, nil
}

// PacketCh implements memberlist.Transport.
func (t *Transport) PacketCh() <-chan *memberlist.Packet { return t.packets }

// DialTimeout implements memberlist.Transport.
func (t *Transport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	dest := t.peer(addr)
	if dest == nil {
		return nil, fmt.Errorf("dial %s: %w", addr, ErrPartitioned)
	}
	a, b := net.Pipe()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case dest.streams <- a:
		return b, nil
	case <-dest.done:
	case <-timer.C:
	}
	a.Close()
	b.Close()
	return nil, fmt.Errorf("dial %s: no answer", addr)
}

// StreamCh implements memberlist.Transport.
func (t *Transport) StreamCh() <-chan net.Conn { return t.streams }

// Shutdown implements memberlist.Transport: the address stops receiving.
func (t *Transport) Shutdown() error {
	t.once.Do(func() {
		t.net.mu.Lock()
		delete(t.net.nodes, t.addr)
		t.net.mu.Unlock()
		close(t.done)
	})
	return nil
}

type mockAddr string

func (a mockAddr) Network() string { return "mem" }
func (a mockAddr) String() string  { return string(a) }
