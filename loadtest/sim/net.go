package sim

import (
	"cmp"
	"context"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"syscall"
	"testing/synctest"
	"time"
)

// Network is an in-memory network of hosts for one synctest bubble: TCP-like
// connections (Listen, DialContext) and datagrams (Transport, for gossip)
// between named hosts, every byte of which is handed over by one goroutine,
// one delivery at a time. Create it inside the bubble with NewNetwork; Close
// it once everything that used it has stopped. Safe for concurrent use.
//
// A write queues a segment on its connection, due after a latency drawn
// from that end's own random stream (seeded from the network's seed and the
// connection's name, so that it does not depend on what other goroutines
// draw); writes at the same instant while a segment is queued join it, so
// that how many writes a writer's goroutines happened to split a flight
// into does not matter. The delivering goroutine waits until every other
// goroutine of the bubble is durably blocked (synctest.Wait), then picks one
// due delivery, at random (the network's seed) among all connections and
// datagrams in a fixed order, and hands it over: segments of one direction
// of a connection arrive in order, whole; datagrams may overtake one
// another. So the interleaving of deliveries and every latency are the
// seed's; what the goroutines woken by a delivery do meanwhile is the Go
// scheduler's (see loadtest/README.md on replay).
//
// Faults: Partition cuts two hosts apart (segments between them wait, dials
// wait, datagrams are lost: a dropped link, which TCP retransmission bridges
// once healed), Freeze stops a host as SIGSTOP looks from outside (what is
// sent to it waits, and is delivered at once when it thaws; what it writes
// or dials blocks; connections to it are accepted by the kernel and wait),
// Crash resets its connections and closes its listeners (SIGKILL), Reset
// and ResetHost reset connections (a middlebox's RST).
type Network struct {
	seed uint64

	mu         sync.Mutex
	rng        *rand.Rand // the delivering goroutine's; under mu
	hosts      map[string]*Host
	byIP       map[string]*Host
	listeners  map[string]*Listener  // by "ip:port"
	ends       []*end                // ends with something queued, by first queueing
	conns      []*end                // client ends of connections not yet closed on both sides, by creation
	packets    []*packet             // datagrams in flight, by sending
	transports map[string]*Transport // by gossip address
	services   map[string]func() []string
	cuts       map[[2]string]bool // partitioned host pairs (sorted names)
	healed     chan struct{}      // closed (and replaced) when a cut heals
	nextConn   uint64
	dials      map[string]uint64    // per "host>addr": dials so far (names connections)
	sent       map[[2]string]uint64 // per host pair: datagrams sent so far
	wake       chan struct{}        // cap 1: something was queued
	closed     bool
	stop       chan struct{}
	done       chan struct{}
	latency    Latency
	trace      func(string)
	delivered  uint64
}

// Latency draws a segment's or a datagram's delay from a random stream.
type Latency func(*rand.Rand) time.Duration

// DefaultLatency is 50–500 µs, and one delivery in a hundred 1–20 ms.
func DefaultLatency(r *rand.Rand) time.Duration {
	if r.IntN(100) == 0 {
		return time.Millisecond + time.Duration(r.Int64N(int64(19*time.Millisecond)))
	}
	return 50*time.Microsecond + time.Duration(r.Int64N(int64(450*time.Microsecond)))
}

// NetworkConfig configures a Network.
type NetworkConfig struct {
	// Seed seeds every random choice the network makes.
	Seed uint64
	// Latency draws delays. Default DefaultLatency.
	Latency Latency
	// Trace, if set, is told of every delivery and fault, in order, from
	// the delivering goroutine (or the caller of the fault). Default nil.
	Trace func(string)
}

// NewNetwork returns a network and starts its delivering goroutine. It must
// be called inside a synctest bubble.
func NewNetwork(cfg NetworkConfig) *Network {
	if cfg.Latency == nil {
		cfg.Latency = DefaultLatency
	}
	n := &Network{
		seed:      cfg.Seed,
		rng:       rand.New(rand.NewPCG(cfg.Seed, 0x6e6574)),
		hosts:     map[string]*Host{},
		byIP:      map[string]*Host{},
		listeners: map[string]*Listener{},
		cuts:      map[[2]string]bool{},
		healed:    make(chan struct{}),
		dials:     map[string]uint64{},
		sent:      map[[2]string]uint64{},
		wake:      make(chan struct{}, 1),
		stop:      make(chan struct{}),
		done:      make(chan struct{}),
		latency:   cfg.Latency,
		trace:     cfg.Trace,
	}
	go n.run()
	return n
}

// Close stops the delivering goroutine and resets whatever is still open.
// Call it after every user of the network has stopped.
func (n *Network) Close() {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return
	}
	n.closed = true
	for _, c := range n.conns {
		c.resetLocked(errReset)
		c.peer.resetLocked(errReset)
	}
	for _, e := range n.ends {
		e.listed = false
	}
	n.ends, n.conns = nil, nil
	n.packets = nil
	n.mu.Unlock()
	close(n.stop)
	<-n.done
}

// Delivered returns the number of deliveries made so far.
func (n *Network) Delivered() uint64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.delivered
}

// hostState is what a host is doing.
type hostState int

const (
	hostUp hostState = iota
	hostFrozen
	hostDown
)

// Host is a machine on the Network, named and with an IP of its own.
type Host struct {
	n     *Network
	name  string
	ip    string
	state hostState     // under n.mu
	thaw  chan struct{} // closed when a freeze ends; under n.mu
	rng   *rand.Rand    // the host's own choices (the Service's pick); under n.mu
}

// AddHost adds a host. Names and IPs must be unique.
func (n *Network) AddHost(name, ip string) *Host {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.hosts[name] != nil || n.byIP[ip] != nil {
		panic(fmt.Sprintf("sim: host %s (%s) added twice", name, ip))
	}
	h := &Host{n: n, name: name, ip: ip, thaw: closedChan(), rng: rand.New(rand.NewPCG(n.seed, hash64("host "+name)))}
	n.hosts[name], n.byIP[ip] = h, h
	return h
}

// Name returns the host's name.
func (h *Host) Name() string { return h.name }

// Frozen reports whether the host is frozen.
func (h *Host) Frozen() bool {
	h.n.mu.Lock()
	defer h.n.mu.Unlock()
	return h.state == hostFrozen
}

// IP returns the host's IP.
func (h *Host) IP() string { return h.ip }

// Addr returns "ip:port" on the host.
func (h *Host) Addr(port int) string { return net.JoinHostPort(h.ip, fmt.Sprint(port)) }

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func closedChan() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}

func hash64(s string) uint64 {
	h := fnv.New64a()
	io.WriteString(h, s)
	return h.Sum64()
}

func (n *Network) tracef(format string, args ...any) {
	if n.trace != nil {
		n.trace(fmt.Sprintf("%s ", time.Now().Format("15:04:05.000000")) + fmt.Sprintf(format, args...))
	}
}

// kick wakes the delivering goroutine. Under n.mu.
func (n *Network) kick() {
	select {
	case n.wake <- struct{}{}:
	default:
	}
}

var (
	errReset   = &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	errRefused = &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	errUnreach = &net.OpError{Op: "dial", Net: "tcp", Err: syscall.EHOSTUNREACH}
)

// Faults.

func pairKey(a, b string) [2]string {
	if a > b {
		a, b = b, a
	}
	return [2]string{a, b}
}

// Partition cuts hosts a and b apart until Heal: segments between them wait
// (as retransmissions would), dials between them wait, datagrams are lost.
func (n *Network) Partition(a, b string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.cuts[pairKey(a, b)] = true
	n.tracef("fault: partition %s | %s", a, b)
}

// Heal ends every partition.
func (n *Network) Heal() {
	n.mu.Lock()
	defer n.mu.Unlock()
	clear(n.cuts)
	close(n.healed)
	n.healed = make(chan struct{})
	n.kick()
	n.tracef("fault: heal")
}

func (n *Network) cutLocked(a, b *Host) bool {
	return len(n.cuts) > 0 && n.cuts[pairKey(a.name, b.name)]
}

// Freeze stops host name as SIGSTOP would, seen from outside, until Thaw.
func (n *Network) Freeze(name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	h := n.hosts[name]
	if h.state != hostUp {
		return
	}
	h.state, h.thaw = hostFrozen, make(chan struct{})
	n.tracef("fault: freeze %s", name)
}

// Thaw resumes a frozen host: what queued for it is delivered at once.
func (n *Network) Thaw(name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	h := n.hosts[name]
	if h.state != hostFrozen {
		return
	}
	h.state = hostUp
	close(h.thaw)
	n.kick()
	n.tracef("fault: thaw %s", name)
}

// Crash takes host name down as SIGKILL would: its connections are reset
// (both ends), its listeners closed, datagrams to it lost, and whatever
// runs on it can reach nothing until Restart.
func (n *Network) Crash(name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	h := n.hosts[name]
	if h.state == hostFrozen {
		close(h.thaw)
	}
	h.state = hostDown
	for _, c := range n.liveConnsLocked() {
		if c.host == h || c.peer.host == h {
			c.resetLocked(errReset)
			c.peer.resetLocked(errReset)
		}
	}
	for addr, l := range n.listeners {
		if l.host == h {
			l.closeLocked()
			delete(n.listeners, addr)
		}
	}
	n.packets = slices.DeleteFunc(n.packets, func(p *packet) bool { return p.to.host == h || p.from == h })
	n.tracef("fault: crash %s", name)
}

// Restart brings a crashed host back up (a new process starts on it).
func (n *Network) Restart(name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	h := n.hosts[name]
	if h.state == hostDown {
		h.state = hostUp
		h.thaw = closedChan()
	}
	n.tracef("fault: restart %s", name)
}

// Reset resets every connection between hosts a and b (a middlebox's RST).
func (n *Network) Reset(a, b string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	k := 0
	for _, c := range n.liveConnsLocked() {
		if c.host.name == a && c.peer.host.name == b || c.host.name == b && c.peer.host.name == a {
			c.resetLocked(errReset)
			c.peer.resetLocked(errReset)
			k++
		}
	}
	n.tracef("fault: reset %s | %s (%d connections)", a, b, k)
	return k
}

// liveConnsLocked prunes and returns the client ends of open connections.
func (n *Network) liveConnsLocked() []*end {
	n.conns = slices.DeleteFunc(n.conns, func(c *end) bool {
		gone := func(e *end) bool { return e.closed || e.reset != nil }
		return gone(c) && gone(c.peer)
	})
	return n.conns
}

// AddService makes address a Service: each dial to it connects to one of
// the addresses backends returns at the time (the ready endpoints), drawn
// from the dialing host's random stream. backends is called without locks
// held.
func (n *Network) AddService(address string, backends func() []string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.services == nil {
		n.services = map[string]func() []string{}
	}
	n.services[address] = backends
}

// ResetHost resets every connection of host name (its Envoys', its peers',
// its upstream's), as a flapping interface would.
func (n *Network) ResetHost(name string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	k := 0
	for _, c := range n.liveConnsLocked() {
		if c.host.name == name || c.peer.host.name == name {
			c.resetLocked(errReset)
			c.peer.resetLocked(errReset)
			k++
		}
	}
	n.tracef("fault: reset every connection of %s (%d)", name, k)
	return k
}

// Listener is a listening address on a Host. It implements net.Listener.
type Listener struct {
	n       *Network
	host    *Host
	addr    *net.TCPAddr
	backlog []*end
	changed chan struct{}
	closed  bool
}

// Listen listens on "ip:port" of host h (its IP).
func (h *Host) Listen(port int) (*Listener, error) {
	n := h.n
	n.mu.Lock()
	defer n.mu.Unlock()
	a := h.Addr(port)
	if h.state == hostDown {
		return nil, fmt.Errorf("sim: listen %s: host %s is down", a, h.name)
	}
	if n.listeners[a] != nil {
		return nil, fmt.Errorf("sim: listen %s: address in use", a)
	}
	l := &Listener{n: n, host: h, addr: tcpAddr(a), changed: make(chan struct{})}
	n.listeners[a] = l
	return l, nil
}

// Accept implements net.Listener.
func (l *Listener) Accept() (net.Conn, error) {
	n := l.n
	n.mu.Lock()
	for {
		if l.closed {
			n.mu.Unlock()
			return nil, net.ErrClosed
		}
		if len(l.backlog) > 0 {
			e := l.backlog[0]
			l.backlog = l.backlog[1:]
			n.mu.Unlock()
			return e, nil
		}
		ch := l.changed
		n.mu.Unlock()
		<-ch
		n.mu.Lock()
	}
}

// Close implements net.Listener: connections not yet accepted are reset.
func (l *Listener) Close() error {
	n := l.n
	n.mu.Lock()
	defer n.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closeLocked()
	if a := l.addr.String(); n.listeners[a] == l {
		delete(n.listeners, a)
	}
	return nil
}

func (l *Listener) closeLocked() {
	if l.closed {
		return
	}
	l.closed = true
	for _, e := range l.backlog {
		e.resetLocked(errReset)
		e.peer.resetLocked(errReset)
	}
	l.backlog = nil
	close(l.changed)
}

// Addr implements net.Listener.
func (l *Listener) Addr() net.Addr { return l.addr }

// tcpAddr parses "ip:port" (which the network made) into a TCP address, what
// code that reads a connection's address expects.
func tcpAddr(s string) *net.TCPAddr {
	return net.TCPAddrFromAddrPort(netip.MustParseAddrPort(s))
}

// Dialer returns a gRPC context dialer for host h.
func (h *Host) Dialer() func(ctx context.Context, addr string) (net.Conn, error) {
	return h.DialContext
}

// DialContext connects host h to addr. A dial to a host that is down or not
// listening is refused; across a partition it waits until the partition
// heals or ctx ends; from a frozen host it waits for the thaw; to a frozen
// host it succeeds and the connection waits to be accepted.
func (h *Host) DialContext(ctx context.Context, address string) (net.Conn, error) {
	n := h.n
	n.mu.Lock()
	svc := n.services[address]
	n.mu.Unlock()
	if svc != nil {
		// A Service: a ready backend at random (the host's own draw), as
		// kube-proxy picks one per connection.
		backends := svc()
		if len(backends) == 0 {
			return nil, errRefused
		}
		slices.Sort(backends)
		n.mu.Lock()
		address = backends[h.rng.IntN(len(backends))]
		n.mu.Unlock()
	}
	n.mu.Lock()
	for {
		switch {
		case n.closed:
			n.mu.Unlock()
			return nil, errRefused
		case h.state == hostDown:
			n.mu.Unlock()
			return nil, errUnreach
		case h.state == hostFrozen:
			ch := h.thaw
			n.mu.Unlock()
			select {
			case <-ch:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			n.mu.Lock()
			continue
		}
		l := n.listeners[address]
		if l == nil {
			n.mu.Unlock()
			return nil, errRefused
		}
		if n.cutLocked(h, l.host) {
			ch := n.healed
			n.mu.Unlock()
			select {
			case <-ch:
			case <-ctx.Done():
				return nil, fmt.Errorf("dial %s: %w", address, os.ErrDeadlineExceeded)
			}
			n.mu.Lock()
			continue
		}
		c := n.pairLocked(h, l, address)
		n.mu.Unlock()
		return c, nil
	}
}

// pairLocked makes the two ends of a new connection from h to l: the
// server end is accepted when its first delivery (the handshake) arrives.
func (n *Network) pairLocked(h *Host, l *Listener, address string) *end {
	n.nextConn++
	key := h.name + ">" + address
	n.dials[key]++
	name := fmt.Sprintf("%s#%d", key, n.dials[key])
	local := tcpAddr(net.JoinHostPort(h.ip, fmt.Sprint(30000+n.dials[key]%30000)))
	c := &end{n: n, id: n.nextConn, client: true, host: h, laddr: local, raddr: tcpAddr(address), changed: make(chan struct{}),
		rng: rand.New(rand.NewPCG(n.seed, hash64(name+" c")))}
	s := &end{n: n, id: n.nextConn, host: l.host, laddr: tcpAddr(address), raddr: local, changed: make(chan struct{}),
		rng: rand.New(rand.NewPCG(n.seed, hash64(name+" s"))), listener: l, name: name}
	c.name = name
	c.peer, s.peer = s, c
	// The handshake: the server end shows up in Accept once delivered.
	s.queue = append(s.queue, segment{accept: true, at: time.Now().Add(n.latency(c.rng))})
	s.lastAt = s.queue[0].at
	s.listed = true
	n.ends = append(n.ends, s)
	n.conns = append(n.conns, c)
	n.kick()
	return c
}

// segment is what one Write queued, or a connection's handshake or FIN.
type segment struct {
	data   []byte
	accept bool // the handshake: the server end is accepted
	fin    bool // the writer closed
	at     time.Time
}

// end is one end of a connection. It implements net.Conn.
type end struct {
	n        *Network
	id       uint64
	name     string
	client   bool
	host     *Host
	laddr    *net.TCPAddr
	raddr    *net.TCPAddr
	peer     *end
	listener *Listener // server ends, until accepted
	rng      *rand.Rand
	listed   bool // in n.ends; under n.mu

	// Under n.mu:
	queue    []segment // sent to this end, not yet delivered
	lastAt   time.Time // the last queued segment's due time (FIFO)
	lastSent time.Time // when the last segment was queued
	buf      []byte    // delivered, not yet read
	eof      bool      // the peer's FIN was delivered
	closed   bool      // closed here
	reset    error     // reset: every call fails with it
	changed  chan struct{}
	rdl, wdl time.Time
}

var _ net.Conn = (*end)(nil)

// notifyLocked wakes whoever waits on e.
func (e *end) notifyLocked() {
	close(e.changed)
	e.changed = make(chan struct{})
}

func (e *end) resetLocked(err error) {
	if e.reset == nil && !e.closed {
		e.reset = err
	}
	e.queue = nil
	e.notifyLocked()
	if e.listener != nil {
		e.listener = nil
	}
}

// wait blocks until e changes, the host thaws (if thaw is set) or the
// deadline passes; it reports false on the deadline. Called without n.mu.
func wait(changed, thaw <-chan struct{}, deadline time.Time) bool {
	if deadline.IsZero() {
		select {
		case <-changed:
		case <-thaw:
		}
		return true
	}
	d := time.Until(deadline)
	if d <= 0 {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-changed:
	case <-thaw:
	case <-t.C:
	}
	return true
}

// Read implements net.Conn.
func (e *end) Read(b []byte) (int, error) {
	n := e.n
	n.mu.Lock()
	for {
		switch {
		case e.closed:
			n.mu.Unlock()
			return 0, net.ErrClosed
		case len(e.buf) > 0:
			k := copy(b, e.buf)
			e.buf = e.buf[k:]
			if len(e.buf) == 0 {
				e.buf = nil
			}
			n.mu.Unlock()
			return k, nil
		case e.reset != nil:
			n.mu.Unlock()
			return 0, e.reset
		case e.eof:
			n.mu.Unlock()
			return 0, io.EOF
		}
		if !e.rdl.IsZero() && !time.Now().Before(e.rdl) {
			n.mu.Unlock()
			return 0, os.ErrDeadlineExceeded
		}
		ch, dl := e.changed, e.rdl
		n.mu.Unlock()
		wait(ch, nil, dl)
		n.mu.Lock()
	}
}

// Write implements net.Conn: the bytes are queued for delivery; a frozen
// host's writes block until it thaws.
func (e *end) Write(b []byte) (int, error) {
	n := e.n
	n.mu.Lock()
	for {
		switch {
		case e.closed:
			n.mu.Unlock()
			return 0, net.ErrClosed
		case e.reset != nil:
			n.mu.Unlock()
			return 0, e.reset
		}
		if !e.wdl.IsZero() && !time.Now().Before(e.wdl) {
			n.mu.Unlock()
			return 0, os.ErrDeadlineExceeded
		}
		if e.host.state == hostFrozen {
			ch, thaw, dl := e.changed, e.host.thaw, e.wdl
			n.mu.Unlock()
			wait(ch, thaw, dl)
			n.mu.Lock()
			continue
		}
		if len(b) == 0 {
			n.mu.Unlock()
			return 0, nil
		}
		e.peer.enqueueLocked(segment{data: slices.Clone(b)}, e.rng)
		n.mu.Unlock()
		return len(b), nil
	}
}

// enqueueLocked queues seg for delivery to e, after a latency, in order.
func (e *end) enqueueLocked(seg segment, rng *rand.Rand) {
	if e.reset != nil || e.closed {
		return // lost: nobody will read it
	}
	now := time.Now()
	if now.Equal(e.lastSent) && len(e.queue) > 0 {
		// Written at the same instant as what is still queued: one flight,
		// whatever the number of writes it took (which depends on how the
		// writer's goroutines happened to interleave, not on the seed).
		last := &e.queue[len(e.queue)-1]
		if !seg.fin && !last.fin && !last.accept {
			last.data = append(last.data, seg.data...)
			return
		}
		seg.at = last.at
		e.queue = append(e.queue, seg)
		return
	}
	at := now.Add(e.n.latency(rng))
	if at.Before(e.lastAt) {
		at = e.lastAt
	}
	seg.at, e.lastAt, e.lastSent = at, at, now
	e.queue = append(e.queue, seg)
	if !e.listed {
		e.listed = true
		e.n.ends = append(e.n.ends, e)
	}
	e.n.kick()
}

// Close implements net.Conn: the peer reads EOF once what was written
// before arrives.
func (e *end) Close() error {
	n := e.n
	n.mu.Lock()
	defer n.mu.Unlock()
	if e.closed {
		return nil
	}
	wasReset := e.reset != nil
	e.closed = true
	e.buf, e.queue = nil, nil
	e.notifyLocked()
	if !wasReset {
		e.peer.enqueueLocked(segment{fin: true}, e.rng)
	}
	return nil
}

// LocalAddr implements net.Conn.
func (e *end) LocalAddr() net.Addr { return e.laddr }

// RemoteAddr implements net.Conn.
func (e *end) RemoteAddr() net.Addr { return e.raddr }

// SetDeadline implements net.Conn.
func (e *end) SetDeadline(t time.Time) error {
	e.n.mu.Lock()
	defer e.n.mu.Unlock()
	e.rdl, e.wdl = t, t
	e.notifyLocked()
	return nil
}

// SetReadDeadline implements net.Conn.
func (e *end) SetReadDeadline(t time.Time) error {
	e.n.mu.Lock()
	defer e.n.mu.Unlock()
	e.rdl = t
	e.notifyLocked()
	return nil
}

// SetWriteDeadline implements net.Conn.
func (e *end) SetWriteDeadline(t time.Time) error {
	e.n.mu.Lock()
	defer e.n.mu.Unlock()
	e.wdl = t
	e.notifyLocked()
	return nil
}

// deliverableLocked reports whether e's next segment may be delivered now.
func (n *Network) deliverableLocked(e *end, now time.Time) bool {
	if len(e.queue) == 0 || e.reset != nil || e.closed {
		return false
	}
	if e.queue[0].at.After(now) || e.host.state != hostUp || n.cutLocked(e.host, e.peer.host) {
		return false
	}
	return true
}

// deliverLocked hands e's next segment over.
func (n *Network) deliverLocked(e *end) {
	seg := e.queue[0]
	e.queue = e.queue[1:]
	if len(e.queue) == 0 {
		e.queue = nil
	}
	n.delivered++
	switch {
	case seg.accept:
		l := e.listener
		e.listener = nil
		if l == nil || l.closed {
			e.resetLocked(errReset)
			e.peer.resetLocked(errRefused)
			n.tracef("deliver %s: refused", e.name)
			return
		}
		l.backlog = append(l.backlog, e)
		close(l.changed)
		l.changed = make(chan struct{})
		n.tracef("deliver %s: accept", e.name)
	case seg.fin:
		e.eof = true
		e.notifyLocked()
		n.tracef("deliver %s → %s: fin", e.peer.host.name, e.host.name)
	default:
		e.buf = append(e.buf, seg.data...)
		e.notifyLocked()
		n.tracef("deliver %s → %s: %d bytes", e.peer.host.name, e.host.name, len(seg.data))
	}
}

// run is the delivering goroutine: one delivery at a time, each once every
// other goroutine of the bubble is durably blocked.
func (n *Network) run() {
	defer close(n.done)
	type cand struct {
		e *end
		p *packet
	}
	var cands []cand
	// Candidates in an order that does not depend on which goroutine
	// queued first: by connection (then direction), then datagrams by
	// sender, receiver and sequence.
	less := func(a, b cand) int {
		switch {
		case a.e != nil && b.e != nil:
			if c := cmp.Compare(a.e.id, b.e.id); c != 0 {
				return c
			}
			return cmp.Compare(btoi(a.e.client), btoi(b.e.client))
		case a.e != nil:
			return -1
		case b.e != nil:
			return 1
		}
		return cmp.Or(cmp.Compare(a.p.from.name, b.p.from.name), cmp.Compare(a.p.to.host.name, b.p.to.host.name), cmp.Compare(a.p.seq, b.p.seq))
	}
	for {
		synctest.Wait()
		n.mu.Lock()
		if n.closed {
			n.mu.Unlock()
			return
		}
		now := time.Now()
		cands = cands[:0]
		var next time.Time
		later := func(at time.Time) {
			if next.IsZero() || at.Before(next) {
				next = at
			}
		}
		live := n.ends[:0]
		for _, e := range n.ends {
			if len(e.queue) == 0 || e.reset != nil || e.closed {
				e.queue, e.listed = nil, false
				continue
			}
			live = append(live, e)
			if n.deliverableLocked(e, now) {
				cands = append(cands, cand{e: e})
			} else if e.queue[0].at.After(now) {
				later(e.queue[0].at)
			}
		}
		clear(n.ends[len(live):])
		n.ends = live
		keep := n.packets[:0]
		for _, p := range n.packets {
			if p.to.closed || p.to.host.state == hostDown {
				continue // lost
			}
			keep = append(keep, p)
			switch {
			case p.at.After(now):
				later(p.at)
			case p.to.host.state == hostUp:
				cands = append(cands, cand{p: p})
			}
		}
		clear(n.packets[len(keep):])
		n.packets = keep
		if len(cands) > 0 {
			slices.SortFunc(cands, less)
			if c := cands[n.rng.IntN(len(cands))]; c.e != nil {
				n.deliverLocked(c.e)
			} else {
				n.deliverPacketLocked(c.p)
			}
			n.mu.Unlock()
			continue
		}
		wake := n.wake
		n.mu.Unlock()
		var timer <-chan time.Time
		if !next.IsZero() {
			t := time.NewTimer(next.Sub(now))
			timer = t.C
			select {
			case <-wake:
			case <-timer:
			case <-n.stop:
			}
			t.Stop()
		} else {
			select {
			case <-wake:
			case <-n.stop:
			}
		}
	}
}
