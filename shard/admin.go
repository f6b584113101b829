package shard

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/admin"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/shard/adminpb"
)

// adminServer serves meshrelay.admin.v1 on one relay's admin listener. Any
// relay answers for the whole tier: the ring is its own view of the
// membership, and everything else comes from the ledgers of every relay,
// gathered when asked (relay.TierLedger), within the relay's gather bound;
// relays that did not answer are named in each answer's missing map.
//
// Every call is of an admin.Caller (the admin listener decided it): an
// admin sees the tier; a caller scoped to a namespace sees its Envoys,
// keys and config alone (admin.Caller.SeesKey), everywhere a key or
// an Envoy is reported, and may mutate nothing:
//
//   - GetRing: every member (membership and gossiped counts are no
//     namespace's);
//   - ListShards, ListEnvoys, ListStragglers, GetConvergence, Wait and
//     CheckDelivery: only its keys and their Envoys, counted as if they were
//     the tier (Wait waits for its own Envoys' share);
//   - GetShard, GetConfigDump and LocateEnvoy: a key, or a node whose id,
//     of another namespace is PermissionDenied whether or not it exists,
//     so the refusal tells nothing; a node whose id names none (or the
//     caller's) but whose key is another namespace's is NotFound, as a node
//     not on the tier. (istiod answers a debug config dump of a node it
//     does not serve with nothing; the admin API says why instead.)
//   - Drain: admins only, and only where AllowMutations lets them.
type adminServer struct {
	adminpb.UnimplementedAdminServer
	n *Node
}

// Wait's bounds.
const (
	defaultWaitTimeout = 30 * time.Second
	maxWaitTimeout     = 10 * time.Minute
)

func selectorScope(s *adminpb.Selector) ledger.Scope {
	return ledger.Scope{Key: s.GetKey(), KeyPrefix: s.GetKeyPrefix()}
}

func (a adminServer) GetRing(context.Context, *adminpb.GetRingRequest) (*adminpb.Ring, error) {
	score, states := a.n.health()
	out := &adminpb.Ring{Relay: a.n.relay.ID(), HealthScore: int32(score)}
	for _, m := range a.n.members() {
		out.Members = append(out.Members, &adminpb.Member{Name: m.Name, XdsAddress: m.XDSAddr, AdminAddress: m.AdminAddr,
			Envoys: int64(m.Conns), Self: m.Self, State: states[m.Name]})
	}
	return out, nil
}

// view is a tier's ledger as a caller sees it: every key and Envoy for an
// admin, those of its namespace for a scoped caller, counted as if they
// were the whole tier.
type view struct {
	relay.TierLedger
	c admin.Caller
}

// tierLedger gathers the tier's ledger for scope in detail d, as ctx's
// caller sees it.
func (a adminServer) tierLedger(ctx context.Context, scope ledger.Scope, d ledger.Detail) view {
	return view{a.n.relay.TierLedger(ctx, scope, d), admin.CallerFrom(ctx)}
}

// keys returns the keys the caller sees.
func (v view) keys() []ledger.KeyReport {
	keys := v.Keys()
	if v.c.Admin {
		return keys
	}
	return slices.DeleteFunc(keys, func(kr ledger.KeyReport) bool { return !v.c.SeesKey(kr.Key) })
}

// envoys returns the Envoys the caller sees, by key and node.
func (v view) envoys() []ledger.EnvoyReport {
	envoys := v.Envoys()
	if v.c.Admin {
		return envoys
	}
	return slices.DeleteFunc(envoys, func(e ledger.EnvoyReport) bool { return !v.c.SeesKey(e.Key) })
}

// stragglers returns the stragglers the caller sees (at most limit; 0
// means all).
func (v view) stragglers(limit int) []ledger.Straggler {
	if v.c.Admin {
		return v.Stragglers(limit)
	}
	out := slices.DeleteFunc(v.Stragglers(0), func(s ledger.Straggler) bool { return !v.c.SeesKey(s.Key) })
	if limit > 0 && len(out) > limit {
		out = out[:limit]
	}
	return out
}

// byKey returns the convergence of each key the caller sees.
func (v view) byKey() map[string]ledger.Convergence {
	by := v.ByKey()
	if !v.c.Admin {
		maps.DeleteFunc(by, func(k string, _ ledger.Convergence) bool { return !v.c.SeesKey(k) })
	}
	return by
}

// byRelay returns the convergence of the Envoys the caller sees, by relay:
// each Envoy counted where the report places it, as Report.ByRelay does.
func (v view) byRelay() map[string]ledger.Convergence {
	if v.c.Admin {
		return v.ByRelay()
	}
	out := map[string]ledger.Convergence{}
	for _, e := range v.envoys() {
		c := out[e.Relay]
		c.Envoys++
		if e.Behind == nil {
			c.Current++
		}
		out[e.Relay] = c
	}
	return out
}

// convergence returns the convergence of the Envoys the caller sees.
func (v view) convergence() ledger.Convergence {
	if v.c.Admin {
		return v.Convergence()
	}
	var sum ledger.Convergence
	for _, c := range v.byKey() {
		sum.Envoys += c.Envoys
		sum.Current += c.Current
	}
	return sum
}

// mayAskKey refuses a key of another namespace, whether or not it exists.
func mayAskKey(c admin.Caller, key string) error {
	if c.SeesKey(key) {
		return nil
	}
	return status.Errorf(codes.PermissionDenied, "%s sees only the keys of its own namespace, not %q", c, key)
}

// mayAskNode refuses a node whose id names another namespace, whether or
// not it exists.
func mayAskNode(c admin.Caller, node string) error {
	if c.MayAskNode(node) {
		return nil
	}
	return status.Errorf(codes.PermissionDenied, "%s sees only the Envoys of its own namespace, not %q", c, node)
}

func (a adminServer) ListShards(ctx context.Context, req *adminpb.ListShardsRequest) (*adminpb.ShardList, error) {
	v := a.tierLedger(ctx, selectorScope(req.GetSelector()), ledger.Brief)
	out := &adminpb.ShardList{Missing: missing(v.TierLedger)}
	for _, kr := range v.keys() {
		out.Shards = append(out.Shards, a.shard(kr))
	}
	return out, nil
}

// shard is a key as the ledgers gathered tell it.
func (a adminServer) shard(kr ledger.KeyReport) *adminpb.Shard {
	sh := &adminpb.Shard{Key: kr.Key, LedgerVersion: kr.Version.String(),
		Envoys: int64(kr.Convergence.Envoys), Current: int64(kr.Convergence.Current)}
	if m, ok := a.n.locate(kr.Key); ok {
		sh.Owner, sh.OwnerXdsAddress = m.Name, m.XDSAddr
	}
	for _, h := range kr.Holders {
		sh.Holders = append(sh.Holders, &adminpb.ShardHolder{Relay: h.Relay, Source: string(h.Source), Stale: h.Stale,
			Envoys: int64(h.Connected()), LedgerVersion: h.LedgerVersion().String()})
	}
	slices.SortFunc(sh.Holders, func(a, b *adminpb.ShardHolder) int { return strings.Compare(a.Relay, b.Relay) })
	for _, h := range kr.Holders {
		for _, s := range h.Splits {
			if !slices.Contains(sh.Splits, s) {
				sh.Splits = append(sh.Splits, s)
			}
		}
	}
	slices.Sort(sh.Splits)
	return sh
}

func (a adminServer) GetShard(ctx context.Context, req *adminpb.GetShardRequest) (*adminpb.ShardDetail, error) {
	if req.GetKey() == "" {
		return nil, status.Error(codes.InvalidArgument, "key is required")
	}
	if req.GetMaxNames() < 0 {
		return nil, status.Error(codes.InvalidArgument, "max_names must not be negative")
	}
	if err := mayAskKey(admin.CallerFrom(ctx), req.GetKey()); err != nil {
		return nil, err
	}
	var (
		tl      relay.TierLedger
		details []*inspectpb.KeyDetail
		miss    map[string]error
		done    = make(chan struct{})
	)
	go func() {
		defer close(done)
		tl = a.n.relay.TierLedger(ctx, ledger.Scope{Key: req.GetKey()}, ledger.Brief)
	}()
	details, miss = a.n.relay.TierKeyDetail(ctx, req.GetKey(), int(req.GetMaxNames()))
	<-done
	keys := tl.Keys()
	if len(keys) == 0 && len(details) == 0 {
		return nil, status.Errorf(codes.NotFound, "no relay holds key %q", req.GetKey())
	}
	out := &adminpb.ShardDetail{Holders: details, Missing: missing(tl)}
	for addr, err := range miss {
		if out.Missing == nil {
			out.Missing = map[string]string{}
		}
		out.Missing[addr] = err.Error()
	}
	if len(keys) > 0 {
		out.Shard = a.shard(keys[0])
	} else {
		out.Shard = &adminpb.Shard{Key: req.GetKey()}
		if m, ok := a.n.locate(req.GetKey()); ok {
			out.Shard.Owner, out.Shard.OwnerXdsAddress = m.Name, m.XDSAddr
		}
	}
	return out, nil
}

func (a adminServer) GetConfigDump(ctx context.Context, req *adminpb.ConfigDumpRequest) (*inspectpb.ConfigDump, error) {
	if (req.GetNode() == "") == (req.GetKey() == "") {
		return nil, status.Error(codes.InvalidArgument, "one of node and key is required")
	}
	c := admin.CallerFrom(ctx)
	if req.GetKey() != "" {
		if err := mayAskKey(c, req.GetKey()); err != nil {
			return nil, err
		}
	} else if err := mayAskNode(c, req.GetNode()); err != nil {
		return nil, err
	}
	d, miss, err := a.n.relay.TierConfigDump(ctx, &inspectpb.ConfigDumpRequest{Node: req.GetNode(), Key: req.GetKey(), Types: req.GetTypes()})
	if err == nil && !c.SeesKey(d.GetKey()) {
		// A node whose id names no namespace (or the caller's) but whose
		// key is another namespace's: as if it were not on the tier.
		d, err = nil, fmt.Errorf("node %q: %w", req.GetNode(), relay.ErrNotHeld)
	}
	switch {
	case errors.Is(err, relay.ErrNotHeld) && len(miss) > 0:
		return nil, status.Errorf(codes.Unavailable, "%v; relays that did not answer may hold it: %v", err, miss)
	case errors.Is(err, relay.ErrNotHeld):
		return nil, status.Errorf(codes.NotFound, "%v on any relay of the tier", err)
	case err != nil:
		return nil, status.Error(codes.Internal, err.Error())
	}
	if req.GetJson() {
		dump, err := d.GetConfigDump().UnmarshalNew()
		if err != nil {
			return nil, status.Errorf(codes.Internal, "config dump: %v", err)
		}
		b, err := protojson.MarshalOptions{UseProtoNames: true, Multiline: true, Indent: "  "}.Marshal(dump)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "config dump as JSON: %v", err)
		}
		d.Json, d.ConfigDump = string(b), nil
	}
	return d, nil
}

func (a adminServer) GetConvergence(ctx context.Context, req *adminpb.ConvergenceRequest) (*adminpb.Convergence, error) {
	return convergence(a.tierLedger(ctx, selectorScope(req.GetSelector()), ledger.Brief)), nil
}

func (a adminServer) ListStragglers(ctx context.Context, req *adminpb.StragglersRequest) (*adminpb.StragglerList, error) {
	if req.GetLimit() < 0 {
		return nil, status.Error(codes.InvalidArgument, "limit must not be negative")
	}
	// Full: a stale-source straggler's Since is its last ACK, which Brief
	// does not carry.
	v := a.tierLedger(ctx, selectorScope(req.GetSelector()), ledger.Full)
	return &adminpb.StragglerList{Stragglers: stragglers(v.stragglers(int(req.GetLimit()))), Missing: missing(v.TierLedger)}, nil
}

func (a adminServer) CheckDelivery(ctx context.Context, req *adminpb.DeliveryRequest) (*adminpb.Delivery, error) {
	// A content hash, or a resource's version as an Envoy shows it.
	h, _, err := wire.ParseVersion(req.GetHash())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "hash: %v", err)
	}
	if req.GetType() == "" || req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "type and name are required")
	}
	d, miss, err := a.n.relay.TierDelivery(ctx, selectorScope(req.GetSelector()), req.GetType(), req.GetName(), h)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if c := admin.CallerFrom(ctx); !c.Admin {
		d.Keys = slices.DeleteFunc(d.Keys, func(k ledger.DeliveryKey) bool { return !c.SeesKey(k.Key) })
	}
	envoys, delivered, known := d.Counts()
	out := &adminpb.Delivery{Envoys: int64(envoys), Delivered: int64(delivered), Known: known, Done: d.Done(), MissingRelays: errorStrings(miss)}
	for _, k := range d.Keys {
		out.Missing = append(out.Missing, stragglers(k.Missing)...)
	}
	return out, nil
}

func (a adminServer) Wait(req *adminpb.WaitRequest, stream adminpb.Admin_WaitServer) error {
	share := req.GetShare()
	if !(share > 0 && share <= 1) {
		return status.Error(codes.InvalidArgument, "share must be in (0, 1]")
	}
	timeout := defaultWaitTimeout
	if d := req.GetTimeout(); d != nil {
		if err := d.CheckValid(); err != nil || d.AsDuration() <= 0 {
			return status.Error(codes.InvalidArgument, "timeout must be a positive duration")
		}
		timeout = min(d.AsDuration(), maxWaitTimeout)
	}
	ctx, cancel := context.WithTimeout(stream.Context(), timeout)
	defer cancel()
	var last ledger.Convergence
	sent, serr := false, error(nil)
	v, err := a.wait(ctx, selectorScope(req.GetSelector()), share, func(v view) {
		if c := v.convergence(); serr == nil && (!sent || c != last) {
			serr = stream.Send(convergence(v))
			last, sent = c, true
		}
	})
	switch {
	case serr != nil:
		return serr
	case err == nil:
		msg := convergence(v)
		msg.Reached = true
		return stream.Send(msg)
	case stream.Context().Err() != nil:
		return stream.Context().Err()
	}
	// The timeout: a last word, with the stragglers, from the latest
	// complete gather.
	msg := convergence(v)
	msg.Stragglers = stragglers(v.stragglers(0))
	if err := stream.Send(msg); err != nil {
		return err
	}
	c := v.convergence()
	return status.Errorf(codes.DeadlineExceeded, "%d of %d Envoys on their key's current version after %v, want a share of %g",
		c.Current, c.Envoys, timeout, share)
}

// wait is relay.TierWait for the Envoys ctx's caller sees, handing
// progress each gather short of share. An admin's is TierWait itself. A
// scoped caller's Envoys are some of the scope's, whose share says nothing
// of theirs: TierWait is asked for a share of 1 (every Envoy of the scope
// current, the caller's among them), and the first complete gather in
// which the caller's Envoys reach share ends it early.
func (a adminServer) wait(ctx context.Context, scope ledger.Scope, share float64, progress func(view)) (view, error) {
	c := admin.CallerFrom(ctx)
	if c.Admin {
		tl, err := a.n.relay.TierWait(ctx, scope, share, func(tl relay.TierLedger) { progress(view{tl, c}) })
		return view{tl, c}, err
	}
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	var reached *view
	tl, err := a.n.relay.TierWait(wctx, scope, 1, func(tl relay.TierLedger) {
		v := view{tl, c}
		if len(tl.Missing) == 0 && v.convergence().Share() >= share {
			reached = &v
			stop()
			return
		}
		progress(v)
	})
	switch {
	case err == nil:
		return view{tl, c}, nil
	case reached != nil:
		return *reached, nil
	}
	return view{tl, c}, err
}

func (a adminServer) Drain(ctx context.Context, req *adminpb.DrainRequest) (*adminpb.DrainResponse, error) {
	if c := admin.CallerFrom(ctx); !c.Admin {
		return nil, status.Errorf(codes.PermissionDenied, "Drain is for admins: %s is not one", c)
	}
	if !a.n.cfg.AllowMutations {
		return nil, status.Error(codes.PermissionDenied, "this relay's admin API is read-only: start it with --admin-allow-mutations to drain through it")
	}
	if req.GetRelay() != a.n.relay.ID() && req.GetRelay() != a.n.name() {
		return nil, status.Errorf(codes.FailedPrecondition, "this is relay %s (%s), not %q: ask that relay's own admin address (relayctl drain finds it in the ring)",
			a.n.relay.ID(), a.n.name(), req.GetRelay())
	}
	streams, started := a.n.Drain(ctx)
	return &adminpb.DrainResponse{Relay: a.n.name(), Streams: int64(streams), Period: durationpb.New(a.n.cfg.DrainPeriod), Already: !started}, nil
}

func counts(c ledger.Convergence) *adminpb.Counts {
	return &adminpb.Counts{Envoys: int64(c.Envoys), Current: int64(c.Current), Share: c.Share()}
}

func convergence(v view) *adminpb.Convergence {
	out := &adminpb.Convergence{Tier: counts(v.convergence()), ByKey: map[string]*adminpb.Counts{}, ByRelay: map[string]*adminpb.Counts{}, Missing: missing(v.TierLedger)}
	for k, c := range v.byKey() {
		out.ByKey[k] = counts(c)
	}
	for r, c := range v.byRelay() {
		out.ByRelay[r] = counts(c)
	}
	return out
}

func stragglers(ss []ledger.Straggler) []*adminpb.Straggler {
	out := make([]*adminpb.Straggler, 0, len(ss))
	for _, s := range ss {
		p := &adminpb.Straggler{Node: s.Node, Key: s.Key, Relay: s.Relay, Type: s.Type, Reason: string(s.Reason), Since: timestamp(s.Since)}
		if n := s.NACK; n != nil {
			p.Nack = &adminpb.NACK{Fingerprint: string(n.Fingerprint), Version: n.Version, Detail: n.Detail, At: timestamp(n.At)}
		}
		out = append(out, p)
	}
	return out
}

func timestamp(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

func missing(tl relay.TierLedger) map[string]string { return errorStrings(tl.Missing) }

func errorStrings(m map[string]error) map[string]string {
	if len(m) == 0 {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, err := range m {
		out[k] = err.Error()
	}
	return out
}

func (a adminServer) LocateEnvoy(ctx context.Context, req *adminpb.LocateEnvoyRequest) (*adminpb.EnvoyInfo, error) {
	if req.GetNode() == "" {
		return nil, status.Error(codes.InvalidArgument, "node is required")
	}
	if err := mayAskNode(admin.CallerFrom(ctx), req.GetNode()); err != nil {
		return nil, err
	}
	v := a.tierLedger(ctx, ledger.Scope{}, ledger.Full) // every time of its types
	for _, e := range v.envoys() {
		if e.State.Node == req.GetNode() {
			return envoyInfo(v.TierLedger, e, a.keyViews(v.TierLedger)), nil
		}
	}
	if len(v.Missing) > 0 {
		return nil, status.Errorf(codes.NotFound, "node %q: not on the relays that answered (%d did not)", req.GetNode(), len(v.Missing))
	}
	return nil, status.Errorf(codes.NotFound, "node %q: not on the tier", req.GetNode())
}

func (a adminServer) ListEnvoys(ctx context.Context, req *adminpb.ListEnvoysRequest) (*adminpb.EnvoyList, error) {
	if req.GetLimit() < 0 {
		return nil, status.Error(codes.InvalidArgument, "limit must not be negative")
	}
	// The basic view is a status per type: Brief gives the same.
	d := ledger.Full
	if req.GetView() == adminpb.EnvoyView_ENVOY_VIEW_BASIC {
		d = ledger.Brief
	}
	v := a.tierLedger(ctx, selectorScope(req.GetSelector()), d)
	tl := v.TierLedger
	out := &adminpb.EnvoyList{Missing: missing(tl)}
	var picked []ledger.EnvoyReport
	for _, e := range v.envoys() {
		switch {
		case req.GetRelay() != "" && e.Relay != req.GetRelay():
			continue
		case req.GetLagging() && e.Behind == nil:
			continue
		case req.GetNacking() && !nacking(e.State):
			continue
		}
		picked = append(picked, e)
		if l := int(req.GetLimit()); l > 0 && len(picked) == l {
			break
		}
	}
	if req.GetView() != adminpb.EnvoyView_ENVOY_VIEW_BASIC {
		keys := a.keyViews(tl)
		for _, e := range picked {
			out.Envoys = append(out.Envoys, envoyInfo(tl, e, keys))
		}
		return out, nil
	}
	// The basic view: a status per type, the types listed once.
	index := map[string]int{}
	for _, e := range picked {
		for _, et := range e.State.Types {
			index[et.Type] = 0
		}
	}
	out.StatusTypes = slices.SortedFunc(maps.Keys(index), ledger.TypeOrder)
	for i, t := range out.StatusTypes {
		index[t] = i
	}
	out.Envoys = make([]*adminpb.EnvoyInfo, 0, len(picked))
	for _, e := range picked {
		st := e.State
		info := &adminpb.EnvoyInfo{Node: st.Node, Key: e.Key, Relay: e.Relay, Connected: st.Connected(), Current: e.Behind == nil,
			Statuses: make([]adminpb.SyncStatus, len(out.StatusTypes))}
		if e.Behind != nil {
			info.Reason = string(e.Behind.Reason)
		}
		for _, et := range st.Types {
			info.Statuses[index[et.Type]] = syncStatuses[tl.Status(e, et)]
		}
		out.Envoys = append(out.Envoys, info)
	}
	return out, nil
}

// syncStatuses are the ledger's statuses as the API's enum.
var syncStatuses = map[ledger.SyncStatus]adminpb.SyncStatus{
	ledger.StatusSynced: adminpb.SyncStatus_SYNCED, ledger.StatusNotSent: adminpb.SyncStatus_NOT_SENT,
	ledger.StatusStale: adminpb.SyncStatus_STALE, ledger.StatusNACKed: adminpb.SyncStatus_NACKED,
	ledger.StatusDisconnected: adminpb.SyncStatus_DISCONNECTED,
}

func nacking(st *ledger.EnvoyState) bool {
	for _, et := range st.Types {
		if et.NACK != nil {
			return true
		}
	}
	return false
}

// keyView is what every Envoy of a key shares, computed once per query:
// the key's owner and its current view of a type (and the view's hex).
type keyView struct {
	owner string
	view  ledger.Hash
	hex   string
}

// keyViews returns a memo of keyView by key and type ("" for the owner
// alone).
func (a adminServer) keyViews(tl relay.TierLedger) func(key, typeURL string) keyView {
	type kt struct{ key, typeURL string }
	memo := map[kt]keyView{}
	return func(key, typeURL string) keyView {
		if kv, ok := memo[kt{key, typeURL}]; ok {
			return kv
		}
		var kv keyView
		if typeURL == "" {
			if m, found := a.n.locate(key); found {
				kv.owner = m.Name
			}
		} else if v, known := tl.Reference(key, typeURL); known {
			kv.view, kv.hex = v.Root, v.Root.String()
		}
		memo[kt{key, typeURL}] = kv
		return kv
	}
}

// envoyInfo is one Envoy in the API's terms (the full view). A root the
// Envoy shares with its key's current view is given as that view's hex,
// built once per key.
func envoyInfo(tl relay.TierLedger, e ledger.EnvoyReport, keys func(key, typeURL string) keyView) *adminpb.EnvoyInfo {
	st := e.State
	out := &adminpb.EnvoyInfo{Node: st.Node, Key: e.Key, Relay: e.Relay, Connected: st.Connected(), Current: e.Behind == nil,
		Owner: keys(e.Key, "").owner}
	if e.Behind != nil {
		out.Reason = string(e.Behind.Reason)
	}
	out.ConnectedAt, out.DisconnectedAt = timestamp(st.ConnectedAt), timestamp(st.DisconnectedAt)
	out.Types = make([]*adminpb.EnvoyType, 0, len(st.Types))
	for _, et := range st.Types {
		t := &adminpb.EnvoyType{Type: et.Type, Status: string(tl.Status(e, et))}
		out.Types = append(out.Types, t)
		kv := keys(e.Key, et.Type)
		hex := func(h ledger.Hash) string {
			switch {
			case h.IsZero():
				return ""
			case h == kv.view:
				return kv.hex
			}
			return h.String()
		}
		t.Acked, t.AckedAt, t.Sent, t.SentAt, t.Pending, t.CurrentView = hex(et.Acked), timestamp(et.AckedAt), hex(et.Sent), timestamp(et.SentAt), et.Pending, kv.hex
		if n := et.NACK; n != nil {
			t.Nack = &adminpb.NACK{Fingerprint: string(n.Fingerprint), Version: n.Version, Detail: n.Detail, At: timestamp(n.At)}
		}
	}
	return out
}
