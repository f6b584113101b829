package sim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
)

// GossipPort is where a host's Transport listens for gossip streams and
// datagrams.
const GossipPort = 7946

// packet is a datagram in flight.
type packet struct {
	from *Host
	to   *Transport
	data []byte
	at   time.Time
	seq  uint64 // per (from, to)
}

// Transport is a memberlist.Transport on a host of a Network: datagrams and
// streams go through the network's deliveries, so partitions, freezes and
// crashes apply to gossip as to everything else. Create it with
// NewTransport and let memberlist shut it down.
type Transport struct {
	host    *Host
	lis     *Listener
	packets chan *memberlist.Packet
	streams chan net.Conn
	done    chan struct{}
	wg      sync.WaitGroup
	once    sync.Once
	closed  bool // under host.n.mu
}

var _ memberlist.Transport = (*Transport)(nil)

// NewTransport listens on the host's gossip port.
func (h *Host) NewTransport() (*Transport, error) {
	lis, err := h.Listen(GossipPort)
	if err != nil {
		return nil, err
	}
	t := &Transport{
		host:    h,
		lis:     lis,
		packets: make(chan *memberlist.Packet, 1024),
		streams: make(chan net.Conn),
		done:    make(chan struct{}),
	}
	n := h.n
	n.mu.Lock()
	if n.transports == nil {
		n.transports = map[string]*Transport{}
	}
	n.transports[h.Addr(GossipPort)] = t
	n.mu.Unlock()
	t.wg.Add(1)
	go t.accept()
	return t, nil
}

// Addr is the transport's address, for memberlist's Join.
func (t *Transport) Addr() string { return t.host.Addr(GossipPort) }

func (t *Transport) accept() {
	defer t.wg.Done()
	for {
		c, err := t.lis.Accept()
		if err != nil {
			return
		}
		select {
		case t.streams <- c:
		case <-t.done:
			c.Close()
			return
		}
	}
}

// FinalAdvertiseAddr implements memberlist.Transport.
func (t *Transport) FinalAdvertiseAddr(string, int) (net.IP, int, error) {
	return net.ParseIP(t.host.ip), GossipPort, nil
}

// WriteTo implements memberlist.Transport: the datagram is queued for
// delivery (a frozen host's send blocks until it thaws; one from or to a
// host that is down is lost).
func (t *Transport) WriteTo(b []byte, addr string) (time.Time, error) {
	n := t.host.n
	n.mu.Lock()
	for t.host.state == hostFrozen && !n.closed {
		ch := t.host.thaw
		n.mu.Unlock()
		<-ch
		n.mu.Lock()
	}
	now := time.Now()
	defer n.mu.Unlock()
	to := n.transports[addr]
	if n.closed || t.closed || t.host.state == hostDown || to == nil || to.closed {
		return now, nil
	}
	// The delay comes from the datagram's own stream (sender, receiver,
	// sequence), not from the order in which the sender addressed its
	// receivers, which memberlist draws from the process's global source.
	pair := [2]string{t.host.name, to.host.name}
	n.sent[pair]++
	seq := n.sent[pair]
	rng := rand.New(rand.NewPCG(n.seed, hash64(fmt.Sprintf("%s>%s#%d", pair[0], pair[1], seq))))
	n.packets = append(n.packets, &packet{from: t.host, to: to, data: slices.Clone(b), at: now.Add(n.latency(rng)), seq: seq})
	n.kick()
	return now, nil
}

// deliverPacketLocked hands a datagram over, or loses it across a cut or
// to a full queue (as UDP would).
func (n *Network) deliverPacketLocked(p *packet) {
	n.packets = slices.DeleteFunc(n.packets, func(q *packet) bool { return q == p })
	n.delivered++
	if n.cutLocked(p.from, p.to.host) {
		n.tracef("drop datagram %s → %s: cut", p.from.name, p.to.host.name)
		return
	}
	select {
	case p.to.packets <- &memberlist.Packet{Buf: p.data, From: tcpAddr(p.from.Addr(GossipPort)), Timestamp: time.Now()}:
		n.tracef("deliver datagram %s → %s: %d bytes", p.from.name, p.to.host.name, len(p.data))
	default:
		n.tracef("drop datagram %s → %s: queue full", p.from.name, p.to.host.name)
	}
}

// PacketCh implements memberlist.Transport.
func (t *Transport) PacketCh() <-chan *memberlist.Packet { return t.packets }

// DialTimeout implements memberlist.Transport.
func (t *Transport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return t.host.DialContext(ctx, addr)
}

// StreamCh implements memberlist.Transport.
func (t *Transport) StreamCh() <-chan net.Conn { return t.streams }

// Shutdown implements memberlist.Transport.
func (t *Transport) Shutdown() error {
	t.once.Do(func() {
		n := t.host.n
		n.mu.Lock()
		t.closed = true
		if n.transports[t.Addr()] == t {
			delete(n.transports, t.Addr())
		}
		n.mu.Unlock()
		close(t.done)
		t.lis.Close()
		t.wg.Wait()
	})
	return nil
}
