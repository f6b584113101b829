package envoy

import (
	"fmt"
	"time"
	"unique"
	"unsafe"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// response is a SotW or Delta response, decoded.
type response struct {
	delta   bool
	typeURL string
	nonce   string
	version string // version_info, or system_version_info in Delta
	cp      string // control_plane.identifier
	res     []decoded
	handles []name   // res[i]'s interned name
	removed []string // Delta removed_resources
	// ignored[i] is set when res[i] was not applied: it came, within the
	// grace, for a name no longer subscribed (Envoy ignores it).
	ignored []bool
	size    int
	at      time.Time
}

// handleSotw processes a SotW response and returns the requests to send.
func (e *Envoy) handleSotw(resp *discovery.DiscoveryResponse, at time.Time) []outbound {
	r := &response{
		typeURL: resp.GetTypeUrl(),
		nonce:   resp.GetNonce(),
		version: resp.GetVersionInfo(),
		cp:      resp.GetControlPlane().GetIdentifier(),
		res:     make([]decoded, len(resp.GetResources())),
		size:    proto.Size(resp),
		at:      at,
	}
	k := kindOf(r.typeURL)
	opt := decodeOptions{needName: true, generation: e.cfg.Generation, cache: e.cfg.DecodeCache}
	for i, a := range resp.GetResources() {
		inner, wrapName, wrapped, err := unwrapSotw(a)
		switch {
		case err != nil:
			r.res[i] = decoded{err: err}
		case wrapped && inner == nil:
			r.res[i] = decoded{name: wrapName} // TTL heartbeat: keep what is held
		default:
			d := decode(k, inner, opt)
			if wrapped && wrapName != "" {
				d.name = wrapName
			}
			r.res[i] = d
		}
	}
	return e.handle(r)
}

// handleDelta processes a Delta response and returns the requests to send.
func (e *Envoy) handleDelta(resp *discovery.DeltaDiscoveryResponse, at time.Time) []outbound {
	r := &response{
		delta:   true,
		typeURL: resp.GetTypeUrl(),
		nonce:   resp.GetNonce(),
		version: resp.GetSystemVersionInfo(),
		cp:      resp.GetControlPlane().GetIdentifier(),
		res:     make([]decoded, len(resp.GetResources())),
		removed: resp.GetRemovedResources(),
		size:    proto.Size(resp),
		at:      at,
	}
	k := kindOf(r.typeURL)
	opt := decodeOptions{generation: e.cfg.Generation, cache: e.cfg.DecodeCache}
	for i, x := range resp.GetResources() {
		var d decoded
		if x.GetResource() != nil {
			d = decode(k, x.GetResource(), opt)
		}
		d.name, d.version = x.GetName(), x.GetVersion()
		r.res[i] = d
	}
	return e.handle(r)
}

// handle checks, applies (or rejects) a response and builds its ACK or NACK
// followed by the subscription changes it caused.
func (e *Envoy) handle(r *response) []outbound {
	if e.cfg.OnEvent != nil {
		ev := Event{Kind: Received, TypeURL: r.typeURL, Version: r.version, Nonce: r.nonce, At: r.at, Bytes: r.size, ControlPlane: r.cp}
		ev.Names, ev.Versions = r.names()
		ev.Generations = r.generations()
		e.cfg.OnEvent(ev)
	}

	e.mu.Lock()
	ts := e.checkLocked(r)
	e.notifyLocked()
	e.mu.Unlock()
	if ts == nil {
		return nil
	}

	var rejected error
	for _, d := range r.res {
		if d.err != nil {
			rejected = d.err
			break
		}
	}
	if rejected == nil && e.cfg.Reject != nil {
		anys := make([]*anypb.Any, 0, len(r.res))
		for _, d := range r.res {
			if d.body != nil {
				anys = append(anys, d.body)
			}
		}
		rejected = e.cfg.Reject(r.typeURL, anys)
	}

	e.mu.Lock()
	var removals []removal
	if rejected == nil {
		removals = e.applyLocked(ts, r)
	}
	if ts.kind == kindCluster && !e.ldsArmed {
		e.ldsArmed = true
		lds := e.typeLocked(ListenerType)
		lds.wildcard = true
		lds.dirty = true
	}
	var out []outbound
	if !e.cfg.NoACK {
		out = append(out, e.ackLocked(ts, r, rejected))
	}
	out = e.pendingLocked(out)
	e.notifyLocked()
	e.mu.Unlock()

	if e.cfg.OnEvent != nil {
		for _, rm := range removals {
			e.cfg.OnEvent(Event{Kind: Removed, TypeURL: rm.typeURL, Names: rm.names, Nonce: r.nonce, At: time.Now()})
		}
	}
	return out
}

// names lists the response's resource names (and Delta versions).
func (r *response) names() (names, versions []string) {
	names = make([]string, len(r.res))
	if r.delta {
		versions = make([]string, len(r.res))
	}
	for i, d := range r.res {
		names[i] = d.name
		if r.delta {
			versions[i] = d.version
		}
	}
	return names, versions
}

// keepApplied returns the elements of s (parallel to a response's
// resources, or nil) whose resource was not ignored.
func keepApplied[T any](ignored []bool, s []T) []T {
	if s == nil {
		return nil
	}
	out := make([]T, 0, len(s))
	for i, v := range s {
		if !ignored[i] {
			out = append(out, v)
		}
	}
	return out
}

// generations lists the resources' generations (0 where unknown), parallel
// to names.
func (r *response) generations() []uint64 {
	out := make([]uint64, len(r.res))
	for i, d := range r.res {
		out[i] = d.gen
	}
	return out
}

// checkLocked records the response and its violations; it returns the
// type's state, or nil if the response cannot be processed.
func (e *Envoy) checkLocked(r *response) *typeState {
	e.stats.Responses++
	e.stats.BytesReceived += uint64(r.size)
	if r.cp != "" {
		e.cp = r.cp
	}
	e.checkNonceLocked(r.typeURL, r.nonce)
	if r.typeURL == "" {
		e.violateLocked(RuleTypeURL, "", r.nonce, "response has no type_url")
		return nil
	}
	ts := e.types[r.typeURL]
	if ts == nil || !ts.opened {
		e.violateLocked(RuleUnsubscribed, r.typeURL, r.nonce, "response for a type not requested on this stream")
		return nil
	}
	ts.nonce = r.nonce

	r.handles = make([]name, len(r.res))
	seen := make(map[name]struct{}, len(r.res))
	for i := range r.res {
		d := &r.res[i]
		h := unique.Make(d.name)
		r.handles[i] = h
		if d.body != nil && d.body.GetTypeUrl() != r.typeURL {
			e.violateLocked(RuleTypeURL, r.typeURL, r.nonce,
				fmt.Sprintf("resource %q has type_url %q", d.name, d.body.GetTypeUrl()))
		}
		if d.err != nil {
			e.violateLocked(RuleMalformed, r.typeURL, r.nonce, fmt.Sprintf("resource %d: %v", i, d.err))
			continue
		}
		if d.name == "" {
			// A SotW resource of a type this binary cannot decode has no
			// name we can read; that is not the server's fault.
			if r.delta || ts.kind != kindOther {
				e.violateLocked(RuleMalformed, r.typeURL, r.nonce, fmt.Sprintf("resource %d has no name", i))
			}
			continue
		}
		if _, dup := seen[h]; dup {
			e.violateLocked(RuleDuplicate, r.typeURL, r.nonce, fmt.Sprintf("resource %q appears twice", d.name))
		}
		seen[h] = struct{}{}
		if !ts.allowed(h) {
			e.violateLocked(RuleUnsubscribed, r.typeURL, r.nonce, fmt.Sprintf("resource %q was not subscribed", d.name))
		}
		if d.hasGen {
			prev, ok := ts.gens[h]
			if ok && d.gen < prev {
				e.violateLocked(RuleGeneration, r.typeURL, r.nonce,
					fmt.Sprintf("resource %q arrived with generation %d after generation %d", d.name, d.gen, prev))
			}
			if !ok || d.gen > prev {
				if ts.gens == nil {
					ts.gens = make(map[name]uint64)
				}
				ts.gens[h] = d.gen
			}
		}
	}
	if len(r.removed) > 0 {
		gone := make(map[name]struct{}, len(r.removed))
		for _, n := range r.removed {
			h := unique.Make(n)
			if _, dup := gone[h]; dup {
				e.violateLocked(RuleDuplicate, r.typeURL, r.nonce, fmt.Sprintf("removed resource %q appears twice", n))
			}
			gone[h] = struct{}{}
			if _, both := seen[h]; both {
				e.violateLocked(RuleDuplicate, r.typeURL, r.nonce,
					fmt.Sprintf("resource %q is in both resources and removed_resources", n))
			}
		}
	}
	if ts.kind == kindRoute || ts.kind == kindListener {
		e.checkUsesLocked(ts, r)
	}
	ts.responded()
	return ts
}

// checkUsesLocked: every cluster a route configuration or listener uses must
// be held, and warm, before it arrives (make-before-break). As in Envoy, a
// cluster that takes its endpoints from EDS is warming until its
// ClusterLoadAssignment is held: a route to it fails (no_cluster).
func (e *Envoy) checkUsesLocked(ts *typeState, r *response) {
	var clusters, endpoints map[name]entry
	if cds := e.types[ClusterType]; cds != nil {
		clusters = cds.held
	}
	if eds := e.types[EndpointType]; eds != nil {
		endpoints = eds.held
	}
	what := "route configuration"
	if ts.kind == kindListener {
		what = "listener"
	}
	for _, d := range r.res {
		for _, c := range d.uses {
			held, ok := clusters[unique.Make(c)]
			if !ok {
				e.violateLocked(RuleOrdering, r.typeURL, r.nonce,
					fmt.Sprintf("%s %q uses cluster %q, which is not held", what, d.name, c))
				continue
			}
			eachRef(held.Value().refs, func(dep bool, cla string) {
				if _, warm := endpoints[unique.Make(cla)]; dep && !warm {
					e.violateLocked(RuleOrdering, r.typeURL, r.nonce,
						fmt.Sprintf("%s %q uses cluster %q, which is warming (no ClusterLoadAssignment %q yet)", what, d.name, c, cla))
				}
			})
		}
	}
}

// removal is a set of resources that stopped being held.
type removal struct {
	typeURL string
	names   []string
}

// applyLocked applies an accepted response and the subscription changes it
// implies.
func (e *Envoy) applyLocked(ts *typeState, r *response) []removal {
	var inResponse map[name]struct{}
	full := !r.delta && ts.kind.fullState()
	if full {
		inResponse = make(map[name]struct{}, len(r.res))
	}
	for i, d := range r.res {
		h := r.handles[i]
		if full {
			inResponse[h] = struct{}{}
		}
		if d.body == nil {
			continue // heartbeat: keep what is held
		}
		if !ts.wildcard && !(d.name == "" && !r.delta && ts.kind == kindOther) {
			if _, ok := ts.subs[h]; !ok {
				// Not subscribed (recorded by checkLocked): Envoy ignores it.
				if r.ignored == nil {
					r.ignored = make([]bool, len(r.res))
				}
				r.ignored[i] = true
				continue
			}
		}
		body := d.body.GetValue()
		if !d.hashed {
			d.hash, d.refs = contentHash(body), encodeRefs(d.deps, d.uses)
		}
		v := heldValue{version: r.version, hash: d.hash, refs: d.refs}
		if !ts.light {
			v.body = bytesView(body)
		}
		if r.delta {
			v.version = d.version
		}
		if d.hasGen {
			v.gen = d.gen
		}
		ts.held[h] = unique.Make(v)
	}

	var gone []string
	var goneSet map[string]struct{}
	drop := func(h name) {
		if _, ok := ts.held[h]; !ok {
			return
		}
		delete(ts.held, h)
		gone = append(gone, h.Value())
		if ts.kind == kindCluster {
			if goneSet == nil {
				goneSet = make(map[string]struct{})
			}
			goneSet[h.Value()] = struct{}{}
		}
	}
	if full {
		for h := range ts.held {
			if _, ok := inResponse[h]; !ok {
				drop(h)
			}
		}
	}
	for _, n := range r.removed {
		drop(unique.Make(n))
	}
	if len(goneSet) > 0 {
		e.checkRemovedClustersLocked(goneSet, r.nonce)
	}

	var removals []removal
	if len(gone) > 0 {
		removals = append(removals, removal{typeURL: ts.url, names: gone})
	}
	switch ts.kind {
	case kindCluster:
		if rm := e.deriveLocked(ts, EndpointType); len(rm) > 0 {
			removals = append(removals, removal{typeURL: EndpointType, names: rm})
		}
	case kindListener:
		if rm := e.deriveLocked(ts, RouteType); len(rm) > 0 {
			removals = append(removals, removal{typeURL: RouteType, names: rm})
		}
	}
	return removals
}

// checkRemovedClustersLocked: a cluster may be removed only once no held
// route configuration or listener uses it (remove stale resources last).
func (e *Envoy) checkRemovedClustersLocked(gone map[string]struct{}, nonce string) {
	for _, url := range []string{RouteType, ListenerType} {
		ts := e.types[url]
		if ts == nil {
			continue
		}
		for n, en := range ts.held {
			eachRef(en.Value().refs, func(dep bool, c string) {
				if _, ok := gone[c]; ok && !dep {
					e.violateLocked(RuleOrdering, ClusterType, nonce,
						fmt.Sprintf("cluster %q removed while %s %q still uses it", c, kindLabel(ts.kind), n.Value()))
				}
			})
		}
	}
}

func kindLabel(k kind) string {
	if k == kindListener {
		return "listener"
	}
	return "route configuration"
}

// deriveLocked makes the subscription of toURL follow what from's resources
// name (EDS from CDS, RDS from LDS) plus what Subscribe added; it returns the
// names whose held resources were dropped.
func (e *Envoy) deriveLocked(from *typeState, toURL string) []string {
	want := make(map[name]struct{})
	for _, en := range from.held {
		eachRef(en.Value().refs, func(dep bool, s string) {
			if dep {
				want[unique.Make(s)] = struct{}{}
			}
		})
	}
	to := e.types[toURL]
	if to == nil {
		if len(want) == 0 {
			return nil
		}
		to = e.typeLocked(toURL)
	}
	for n := range to.user {
		want[n] = struct{}{}
	}
	changed := false
	for n := range want {
		if to.subscribeLocked(n) {
			e.queueLocked(to, n, true)
			changed = true
		}
	}
	var dropped []string
	for n := range to.subs {
		if _, ok := want[n]; ok {
			continue
		}
		if to.unsubscribeLocked(n, e.cfg.UnsubscribeGrace) {
			dropped = append(dropped, n.Value())
		}
		e.queueLocked(to, n, false)
		changed = true
	}
	if changed {
		to.dirty = true
	}
	return dropped
}

// queueLocked records a Delta subscription change (SotW sends full lists).
func (e *Envoy) queueLocked(ts *typeState, n name, subscribe bool) {
	if e.cfg.Protocol == Delta {
		ts.queue(n, subscribe)
	}
}

// ackLocked builds the ACK (rejected == nil) or NACK of a response.
func (e *Envoy) ackLocked(ts *typeState, r *response, rejected error) outbound {
	ev := &Event{Kind: ACKed, TypeURL: r.typeURL, Version: r.version, Nonce: r.nonce, Err: rejected}
	if e.cfg.OnEvent != nil {
		ev.Names, ev.Versions = r.names()
		ev.Generations = r.generations()
		if rejected == nil && r.ignored != nil {
			// An ACK accepts what was applied: an ignored resource is not
			// held, and a history must not count it.
			ev.Names, ev.Versions, ev.Generations = keepApplied(r.ignored, ev.Names), keepApplied(r.ignored, ev.Versions), keepApplied(r.ignored, ev.Generations)
		}
	}
	var detail *status.Status
	if rejected != nil {
		ev.Kind = NACKed
		e.stats.NACKs++
		detail = &status.Status{Code: int32(codes.InvalidArgument), Message: rejected.Error()}
	} else {
		e.stats.ACKs++
		ts.acked = r.version
	}
	if r.delta {
		req := &discovery.DeltaDiscoveryRequest{TypeUrl: r.typeURL, ResponseNonce: r.nonce, ErrorDetail: detail}
		if e.nodeLocked() {
			req.Node = e.cfg.Node
		}
		return outbound{delta: req, ev: ev}
	}
	// A NACK carries the last ACKed version; ts.acked is only moved by ACKs.
	return outbound{sotw: e.sotwRequestLocked(ts, ts.acked, detail), ev: ev}
}

// sotwRequestLocked builds a SotW request carrying the full subscription.
func (e *Envoy) sotwRequestLocked(ts *typeState, version string, detail *status.Status) *discovery.DiscoveryRequest {
	req := &discovery.DiscoveryRequest{
		VersionInfo:   version,
		ResourceNames: ts.requestNames(),
		TypeUrl:       ts.url,
		ResponseNonce: ts.nonce,
		ErrorDetail:   detail,
	}
	if e.nodeLocked() {
		req.Node = e.cfg.Node
	}
	ts.sent()
	return req
}

// deltaSubscriptionLocked builds a Delta subscription request: the full
// subscription with initial_resource_versions on a new stream, the queued
// changes afterwards. It returns nil if there is nothing to say.
func (e *Envoy) deltaSubscriptionLocked(ts *typeState) *discovery.DeltaDiscoveryRequest {
	req := &discovery.DeltaDiscoveryRequest{TypeUrl: ts.url}
	if !ts.opened {
		req.ResourceNamesSubscribe = ts.requestNames()
		if len(ts.held) > 0 {
			req.InitialResourceVersions = make(map[string]string, len(ts.held))
			for n, en := range ts.held {
				req.InitialResourceVersions[n.Value()] = en.Value().version
			}
		}
	} else {
		if len(ts.addQ) == 0 && len(ts.delQ) == 0 {
			ts.dirty = false
			return nil
		}
		req.ResourceNamesSubscribe = sortedNames(ts.addQ)
		req.ResourceNamesUnsubscribe = sortedNames(ts.delQ)
		if ts.wildcard && !ts.starSent && len(ts.addQ) > 0 {
			// Leaving the legacy (implicit) wildcard needs an explicit "*".
			if _, ok := ts.addQ[unique.Make(wildcardName)]; !ok {
				req.ResourceNamesSubscribe = append([]string{wildcardName}, req.ResourceNamesSubscribe...)
			}
			ts.starSent = true
		}
	}
	if e.nodeLocked() {
		req.Node = e.cfg.Node
	}
	ts.addQ, ts.delQ = nil, nil
	ts.sent()
	return req
}

// bytesView views b as a string without copying. It is only given to
// unique.Make, which copies the strings it stores, and b is not modified.
func bytesView(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(unsafe.SliceData(b), len(b))
}
