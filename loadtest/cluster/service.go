package cluster

import (
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
)

// Service stands for a Kubernetes Service in front of the relays: an L4
// proxy on loopback that sends each new connection to a random ready
// backend, as kube-proxy does, and relays bytes both ways until either side
// closes. Start it with NewService and Close it when done.
type Service struct {
	lis      net.Listener
	backends func() []string
	mu       sync.Mutex
	conns    map[net.Conn]struct{}
	wg       sync.WaitGroup
}

// NewService listens on a free loopback port. backends is called for every
// new connection and returns the addresses of the ready relays.
func NewService(backends func() []string) (*Service, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Service{lis: lis, backends: backends, conns: make(map[net.Conn]struct{})}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Addr is the Service's address, the one Envoys dial.
func (s *Service) Addr() string { return s.lis.Addr().String() }

func (s *Service) accept() {
	defer s.wg.Done()
	for {
		c, err := s.lis.Accept()
		if err != nil {
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.proxy(c)
		}()
	}
}

func (s *Service) track(c net.Conn, add bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !add {
		delete(s.conns, c)
		return true
	}
	if s.conns == nil {
		return false // closed
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *Service) proxy(client net.Conn) {
	defer client.Close()
	addrs := s.backends()
	rand.Shuffle(len(addrs), func(i, j int) { addrs[i], addrs[j] = addrs[j], addrs[i] })
	var backend net.Conn
	for _, a := range addrs {
		if c, err := net.Dial("tcp", a); err == nil {
			backend = c
			break
		}
	}
	if backend == nil {
		return // no endpoint: the client sees the connection closed
	}
	defer backend.Close()
	if !s.track(client, true) || !s.track(backend, true) {
		return
	}
	defer s.track(client, false)
	defer s.track(backend, false)
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		io.Copy(dst, src)
		// Either side closing ends both, as a TCP reset through a proxy
		// would: the client reconnects through the Service.
		dst.Close()
		src.Close()
		done <- struct{}{}
	}
	go pipe(backend, client)
	go pipe(client, backend)
	<-done
	<-done
}

// Close stops accepting, closes every proxied connection and waits for the
// proxy goroutines to end.
func (s *Service) Close() error {
	err := s.lis.Close()
	s.mu.Lock()
	conns := s.conns
	s.conns = nil
	s.mu.Unlock()
	for c := range conns {
		c.Close()
	}
	s.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}
