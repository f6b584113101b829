package upstream

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"sync"
	"time"
	"unsafe"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"google.golang.org/protobuf/types/known/anypb"
)

// deltaCache serves one group's resources of one type to Delta streams
// at a cost that follows what changed, as istiod's incremental pushes do,
// where go-control-plane's LinearCache costs what each stream subscribes
// to: on every response and every ACK it walks the stream's whole
// subscription, indexes its watch under every name and clones the map of
// what the stream knows. At 30,000 services behind 100 aggregation keys
// that is seconds of CPU per change (Config.IncrementalDelta).
//
// Per stream it relies on what go-control-plane's delta server does with
// the map of versions the client knows (Subscription.ReturnedResources):
// the server keeps the map a response returns and hands it back with every
// later request. deltaCache returns, updated in place, the very map it was
// given, and remembers, by the map's identity, the change sequence number
// the map is current to. A request then needs only the names changed
// since, and those it (un)subscribes; a change needs only the open watches
// whose subscription holds its name. A stream seen for the first time (or
// after its memo expired) is computed in full, as LinearCache does.
//
// The semantics are LinearCache's for Delta (resources versioned by the
// SHA-256 of their deterministic encoding, removals for names no longer
// served or subscribed, an empty first answer to a wildcard). It serves
// Delta only; SotW requests go to the LinearCache beside it. Safe for
// concurrent use.
type deltaCache struct {
	typeURL string

	mu        sync.Mutex
	resources map[string]*deltaRes
	seq       uint64        // of the latest change
	log       []deltaChange // the latest changes, oldest first
	logFloor  uint64        // changes after it are all in log
	watches   map[uint64]*deltaWatch
	nextWatch uint64
	memos     map[unsafe.Pointer]*deltaMemo
	sweptAt   time.Time
}

// deltaRes is one resource as served: encoded once, shared by every
// group's cache that serves the same object.
type deltaRes struct {
	name    string
	res     types.Resource
	wire    []byte
	version string
}

type deltaChange struct {
	name string
	seq  uint64
}

type deltaWatch struct {
	req   *discovery.DeltaDiscoveryRequest
	sub   cache.Subscription
	known map[string]string
	ch    chan cache.DeltaResponse
}

// deltaMemo says that known, a stream's map of versions, is current to
// change seq. It holds the map, so that its address is not reused by
// another map while the memo lives; open counts the watches using it.
type deltaMemo struct {
	known map[string]string
	seq   uint64
	open  int
	used  time.Time
}

// Bounds: the change log keeps the latest maxDeltaLog changes (a stream
// behind by more is computed in full), and a memo no open watch uses is
// dropped memoTTL after its last use.
const (
	maxDeltaLog = 1 << 16
	memoTTL     = time.Minute
)

var _ cache.Cache = (*deltaCache)(nil)

// newDeltaRes encodes res for the wire, and versions it as LinearCache does.
func newDeltaRes(name string, res types.Resource) (*deltaRes, error) {
	wire, err := cache.MarshalResource(res)
	if err != nil {
		return nil, fmt.Errorf("upstream: encode %s: %w", name, err)
	}
	return &deltaRes{name: name, res: res, wire: wire, version: cache.HashResource(wire)}, nil
}

func newDeltaCache(typeURL string, initial map[string]*deltaRes) *deltaCache {
	c := &deltaCache{
		typeURL: typeURL, resources: make(map[string]*deltaRes, len(initial)),
		watches: map[uint64]*deltaWatch{}, memos: map[unsafe.Pointer]*deltaMemo{}, sweptAt: time.Now(),
	}
	for n, r := range initial {
		c.resources[n] = r
	}
	return c
}

// set publishes r (nil: removes name) and answers the open watches it
// concerns.
func (c *deltaCache) set(name string, r *deltaRes) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if r == nil {
		if _, ok := c.resources[name]; !ok {
			return
		}
		delete(c.resources, name)
	} else {
		c.resources[name] = r
	}
	c.seq++
	c.log = append(c.log, deltaChange{name, c.seq})
	if len(c.log) > maxDeltaLog {
		drop := len(c.log) / 2
		c.logFloor = c.log[drop-1].seq
		c.log = append(c.log[:0], c.log[drop:]...)
	}
	for id, w := range c.watches {
		if !w.sub.IsWildcard() {
			_, subscribed := w.sub.SubscribedResources()[name]
			_, known := w.known[name]
			if !subscribed && !known {
				continue
			}
		}
		if resp := c.respond(w.req, w.sub, w.known, false); resp != nil {
			w.ch <- resp // buffered by the server: one watch per type
			c.closeWatch(id)
		}
	}
}

// CreateDeltaWatch answers at once if the stream is behind, or opens a
// watch answered by the next change that concerns it.
func (c *deltaCache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	if req.GetTypeUrl() != c.typeURL {
		return nil, fmt.Errorf("upstream: request for %s sent to the cache of %s", req.GetTypeUrl(), c.typeURL)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sweep()
	// On a wildcard subscription's first request Envoy waits for an
	// answer, even an empty one, to end its initialisation.
	first := sub.IsWildcard() && req.GetResponseNonce() == ""
	if resp := c.respond(req, sub, sub.ReturnedResources(), first); resp != nil {
		ch <- resp
		return nil, nil
	}
	c.nextWatch++
	id := c.nextWatch
	known := sub.ReturnedResources()
	c.watches[id] = &deltaWatch{req: req, sub: sub, known: known, ch: ch}
	c.memos[mapID(known)].open++ // respond made it
	return func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.closeWatch(id)
	}, nil
}

// closeWatch forgets watch id. The caller holds c.mu.
func (c *deltaCache) closeWatch(id uint64) {
	w, ok := c.watches[id]
	if !ok {
		return
	}
	delete(c.watches, id)
	if m := c.memos[mapID(w.known)]; m != nil {
		m.open--
		m.used = time.Now()
	}
}

// respond returns the response that brings known (a stream's map of
// versions, for sub) up to date, updating known in place and its memo;
// nil if nothing is to be sent (unless always). The caller holds c.mu.
func (c *deltaCache) respond(req *discovery.DeltaDiscoveryRequest, sub cache.Subscription, known map[string]string, always bool) cache.DeltaResponse {
	id := mapID(known)
	m := c.memos[id]
	full := m == nil || m.seq < c.logFloor
	for _, n := range req.GetResourceNamesSubscribe() {
		full = full || n == "*"
	}
	for _, n := range req.GetResourceNamesUnsubscribe() {
		full = full || n == "*"
	}
	var updated []*deltaRes
	var removed []string
	seen := map[string]struct{}{}
	check := func(name string) {
		if _, dup := seen[name]; dup {
			return
		}
		seen[name] = struct{}{}
		r, exists := c.resources[name]
		kv, isKnown := known[name]
		subscribed := sub.IsWildcard()
		if !subscribed {
			_, subscribed = sub.SubscribedResources()[name]
		}
		switch {
		case exists && subscribed:
			if !isKnown || kv != r.version {
				updated = append(updated, r)
			}
		case isKnown:
			// Gone from the cache, or no longer subscribed.
			removed = append(removed, name)
		}
	}
	if full {
		if sub.IsWildcard() {
			for name := range c.resources {
				check(name)
			}
		} else {
			for name := range sub.SubscribedResources() {
				check(name)
			}
		}
		for name := range known {
			check(name)
		}
	} else {
		// The changes since the map was current, past the log's floor,
		// and the names this request (un)subscribes.
		i := len(c.log)
		for i > 0 && c.log[i-1].seq > m.seq {
			i--
		}
		for _, ch := range c.log[i:] {
			check(ch.name)
		}
		for _, n := range req.GetResourceNamesSubscribe() {
			check(n)
		}
		for _, n := range req.GetResourceNamesUnsubscribe() {
			check(n)
		}
	}
	for _, r := range updated {
		known[r.name] = r.version
	}
	for _, n := range removed {
		delete(known, n)
	}
	if m == nil {
		m = &deltaMemo{known: known}
		c.memos[id] = m
	}
	m.seq, m.used = c.seq, time.Now()
	if len(updated) == 0 && len(removed) == 0 && !always {
		return nil
	}
	out := &discovery.DeltaDiscoveryResponse{
		TypeUrl:           c.typeURL,
		SystemVersionInfo: strconv.FormatUint(c.seq, 10),
		Resources:         make([]*discovery.Resource, len(updated)),
		RemovedResources:  removed,
	}
	for i, r := range updated {
		// A wrapper per response (the bytes are shared): messages sent on
		// several streams at once must not be shared.
		out.Resources[i] = &discovery.Resource{Name: r.name, Version: r.version, Resource: &anypb.Any{TypeUrl: c.typeURL, Value: r.wire}}
	}
	return &deltaResponse{req: req, resp: out, known: known}
}

// sweep drops the memos no open watch uses and unused for memoTTL, at
// most once a memoTTL. The caller holds c.mu.
func (c *deltaCache) sweep() {
	now := time.Now()
	if now.Sub(c.sweptAt) < memoTTL {
		return
	}
	c.sweptAt = now
	for id, m := range c.memos {
		if m.open == 0 && now.Sub(m.used) > memoTTL {
			delete(c.memos, id)
		}
	}
}

// mapID is the identity of a map: its header's address.
func mapID(m map[string]string) unsafe.Pointer { return reflect.ValueOf(m).UnsafePointer() }

// CreateWatch is not served: SotW streams have the LinearCache.
func (c *deltaCache) CreateWatch(*cache.Request, cache.Subscription, chan cache.Response) (func(), error) {
	return nil, errors.New("upstream: the incremental Delta cache serves no SotW stream")
}

// Fetch is not served (as LinearCache).
func (c *deltaCache) Fetch(context.Context, *cache.Request) (cache.Response, error) {
	return nil, errors.New("upstream: fetch is not served")
}

// deltaResponse is one answer of a deltaCache.
type deltaResponse struct {
	req   *discovery.DeltaDiscoveryRequest
	resp  *discovery.DeltaDiscoveryResponse
	known map[string]string
}

var _ cache.DeltaResponse = (*deltaResponse)(nil)

func (r *deltaResponse) GetDeltaDiscoveryResponse() (*discovery.DeltaDiscoveryResponse, error) {
	return r.resp, nil
}
func (r *deltaResponse) GetDeltaRequest() *discovery.DeltaDiscoveryRequest { return r.req }
func (r *deltaResponse) GetSystemVersion() (string, error)                 { return r.resp.GetSystemVersionInfo(), nil }
func (r *deltaResponse) GetResponseVersion() string                        { return r.resp.GetSystemVersionInfo() }
func (r *deltaResponse) GetNextVersionMap() map[string]string              { return r.known }
func (r *deltaResponse) GetReturnedResources() map[string]string           { return r.known }
func (r *deltaResponse) GetContext() context.Context                       { return context.Background() }
