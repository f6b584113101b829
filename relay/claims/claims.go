// Package claims finds out what a SotW client's claimed version held when
// the relay's own key history lacks it.
//
// A SotW client says of each type only the version it holds (version_info,
// a Merkle root). A relay whose key history has that version knows what the
// client holds. One that lacks it (the client came from a relay that was
// further on, or the version passed while this one was cut off) asks the
// tier's other relays, which answer from their histories (Content, served
// as the Inspect service's GetVersion), and then the snapshot store, where
// a relay that drained the client handed over what it held: after a rolling
// restart, no relay that served the version is left. Every answer is
// checked (Tree): each body present and matching its hash, the tree's root
// the version asked about.
//
// The relay asks (Lookup.Version) from a goroutine of its own per question
// and applies the answer to its streams; this package holds no state of a
// key.
package claims

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Conns gives a connection to the relay of the tier at addr (peers.Pool).
type Conns interface {
	Conn(addr string) (*grpc.ClientConn, error)
}

// Held reads what a relay that drained a SotW client handed over to the
// snapshot store: the version root of typeURL kept for key, with the bodies
// of the entries has reports the caller lacks.
type Held interface {
	LoadHeld(ctx context.Context, key, typeURL string, root ledger.Hash, has func(ledger.Hash) bool) (xds.HeldVersion, bool, error)
}

// Config is what a Lookup asks with. Store, Conns and AsPeer are required.
type Config struct {
	// Store decodes the bodies answered and holds those the relay has.
	Store *xds.Store
	// Conns connects to the tier's relays.
	Conns Conns
	// Peers names the tier's other live relays, asked anew each round of
	// a lookup; nil: a relay alone, which asks only the store.
	Peers func() []string
	// Held is the snapshot store's hand-over; nil: none is kept.
	Held Held
	// AsPeer marks a call's context as the relay's to a relay of its tier.
	AsPeer func(context.Context) context.Context
	// WaitWarn is how long a lookup waits for a relay that may know before
	// it says so in the log (the relay's ResourceWaitTimeout).
	WaitWarn time.Duration
	// GatherTimeout bounds each round of questions to the tier, and the
	// read of the store.
	GatherTimeout time.Duration
	// MaxMsgSize bounds an answer's size, in bytes.
	MaxMsgSize int
	// Logger: discarded if nil.
	Logger *slog.Logger
}

// Lookup asks the tier and the store what a claimed version held. Safe for
// concurrent use.
type Lookup struct {
	cfg Config
	log *slog.Logger
}

// New returns a Lookup asking with cfg.
func New(cfg Config) (*Lookup, error) {
	switch {
	case cfg.Store == nil:
		return nil, errors.New("claims: Store is required")
	case cfg.Conns == nil:
		return nil, errors.New("claims: Conns is required")
	case cfg.AsPeer == nil:
		return nil, errors.New("claims: AsPeer is required")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Lookup{cfg: cfg, log: log}, nil
}

// retry is how long a lookup waits before it asks again the relays that did
// not answer it.
const retry = time.Second

// Askable reports whether a lookup has anyone to ask: other relays, or a
// store that keeps what drained relays handed over.
func (l *Lookup) Askable() bool { return len(l.peers()) > 0 || l.cfg.Held != nil }

func (l *Lookup) peers() []string {
	if l.cfg.Peers == nil {
		return nil
	}
	return l.cfg.Peers()
}

// Version finds out what the version root of req held: from the tier's
// other relays (Peers), then from the snapshot store. from says which
// knew: "tier" or "store". It returns when it knows, when every relay
// answered that it does not and the store has nothing, or when ctx ends.
func (l *Lookup) Version(ctx context.Context, req *inspectpb.VersionRequest, root ledger.Hash) (t ledger.Tree[*xds.Resource], ok bool, from string) {
	if addrs := l.peers(); len(addrs) > 0 {
		if t, ok := l.askTier(ctx, addrs, req, root); ok {
			return t, true, "tier"
		}
		if ctx.Err() != nil {
			return t, false, ""
		}
	}
	t, ok = l.loadHeld(ctx, req, root)
	return t, ok, "store"
}

// askTier asks the tier what the version root of req held (ask) until it
// knows: some relay proves it, or every relay of the tier says it does not
// have it. A relay that does not answer (frozen, cut off, slow) may be the
// one that has it, and its Envoys are the ones that moved: the client's
// type waits, since a full-state answer given without knowing what it
// holds may remove a cluster its routes use (make-before-break). A wait
// past WaitWarn is logged; it ends when the relay answers or leaves the
// tier (Peers is asked anew each round).
func (l *Lookup) askTier(ctx context.Context, addrs []string, req *inspectpb.VersionRequest, root ledger.Hash) (ledger.Tree[*xds.Resource], bool) {
	start, told := time.Now(), false
	for {
		t, ok, definite := l.ask(ctx, addrs, req, root)
		if ok || definite {
			return t, ok
		}
		if !told && time.Since(start) >= l.cfg.WaitWarn {
			told = true
			l.log.Warn("a SotW client's version: a relay of the tier that may know it does not answer; its type waits", "key", req.GetKey(), "type", xds.ShortType(req.GetType()), "waited", time.Since(start).Round(time.Millisecond))
		}
		select {
		case <-ctx.Done():
			return ledger.Tree[*xds.Resource]{}, false
		case <-time.After(retry):
		}
		if addrs = l.peers(); len(addrs) == 0 {
			return ledger.Tree[*xds.Resource]{}, false
		}
	}
}

// loadHeld reads the version root of req from the snapshot store, if a
// relay that drained a client holding it handed it over, and checks it as
// it checks another relay's answer (Tree). A store that fails or does not
// answer in GatherTimeout leaves the claim unknown.
func (l *Lookup) loadHeld(ctx context.Context, req *inspectpb.VersionRequest, root ledger.Hash) (ledger.Tree[*xds.Resource], bool) {
	if l.cfg.Held == nil {
		return ledger.Tree[*xds.Resource]{}, false
	}
	ctx, cancel := context.WithTimeout(ctx, l.cfg.GatherTimeout)
	defer cancel()
	v, found, err := l.cfg.Held.LoadHeld(ctx, req.GetKey(), req.GetType(), root, func(h ledger.Hash) bool { return l.cfg.Store.Lookup(h) != nil })
	if err != nil {
		l.log.Warn("a SotW client's version: the snapshot store's hand-over not read", "key", req.GetKey(), "type", xds.ShortType(req.GetType()), "err", err)
		return ledger.Tree[*xds.Resource]{}, false
	}
	if !found {
		return ledger.Tree[*xds.Resource]{}, false
	}
	got := &inspectpb.VersionContent{Relay: "the snapshot store"}
	for _, e := range v.Entries {
		ve := &inspectpb.VersionEntry{Name: e.Name, Hash: e.Hash[:]}
		if e.Body != nil {
			ve.Body = &anypb.Any{TypeUrl: req.GetType(), Value: e.Body}
		}
		got.Entries = append(got.Entries, ve)
	}
	t, err := Tree(l.cfg.Store, req.GetType(), got, root)
	if err != nil {
		l.log.Warn("a SotW client's version: the snapshot store's hand-over is not whole", "key", req.GetKey(), "type", xds.ShortType(req.GetType()), "err", err)
		return ledger.Tree[*xds.Resource]{}, false
	}
	return t, true
}

// ask asks the relays at addrs, all at once, what the version root of req
// held, and returns the first answer that proves to be it. It gives up when
// every relay has answered otherwise, or after GatherTimeout; definite
// reports that every relay answered that it does not have it.
func (l *Lookup) ask(ctx context.Context, addrs []string, req *inspectpb.VersionRequest, root ledger.Hash) (t ledger.Tree[*xds.Resource], ok, definite bool) {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.GatherTimeout)
	defer cancel()
	ctx = l.cfg.AsPeer(ctx)
	type answer struct {
		t   ledger.Tree[*xds.Resource]
		err error
	}
	answers := make(chan answer, len(addrs))
	for _, addr := range addrs {
		go func() {
			t, err := l.askOne(ctx, addr, req, root)
			if err != nil {
				l.log.Debug("claimed version: a relay's answer failed", "addr", addr, "key", req.GetKey(), "type", xds.ShortType(req.GetType()), "err", err)
			}
			answers <- answer{t, err}
		}()
	}
	definite = true
	for range addrs {
		a := <-answers
		if a.err == nil {
			return a.t, true, true
		}
		if !answered(a.err) {
			definite = false
		}
	}
	return ledger.Tree[*xds.Resource]{}, false, definite
}

// askOne asks one relay, and checks its answer.
func (l *Lookup) askOne(ctx context.Context, addr string, req *inspectpb.VersionRequest, root ledger.Hash) (ledger.Tree[*xds.Resource], error) {
	conn, err := l.cfg.Conns.Conn(addr)
	if err != nil {
		return ledger.Tree[*xds.Resource]{}, err
	}
	c := inspectpb.NewInspectClient(conn)
	got, err := c.GetVersion(ctx, req, grpc.MaxCallRecvMsgSize(l.cfg.MaxMsgSize))
	if err != nil {
		return ledger.Tree[*xds.Resource]{}, err
	}
	t, err := Tree(l.cfg.Store, req.GetType(), got, root)
	if errors.Is(err, errBodyMissing) && !req.GetBodies() {
		// This relay's view is not the answering one's: ask for them all.
		all := proto.CloneOf(req)
		all.Bodies = true
		if got, err = c.GetVersion(ctx, all, grpc.MaxCallRecvMsgSize(l.cfg.MaxMsgSize)); err != nil {
			return ledger.Tree[*xds.Resource]{}, err
		}
		t, err = Tree(l.cfg.Store, req.GetType(), got, root)
	}
	if err != nil {
		return ledger.Tree[*xds.Resource]{}, fmt.Errorf("%w: %w", errWrongAnswer, err)
	}
	return t, nil
}

// answered reports whether err is a relay's answer (NotFound: it does not
// hold the key or the version; a refusal; a wrong version: a body missing,
// a root that does not match), not the lack of one (it could not be
// reached, or did not answer in time): only a relay that did not answer may
// know better.
func answered(err error) bool {
	if errors.Is(err, errWrongAnswer) {
		return true
	}
	st, ok := status.FromError(err)
	if !ok {
		return false // no gRPC status: the relay was never reached
	}
	switch st.Code() {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled:
		return false
	}
	return true
}

// errWrongAnswer: a relay answered with a version that is not the one asked
// about, or not whole.
var errWrongAnswer = errors.New("claims: the answer is not the version asked about")

// errBodyMissing: an answer left out a resource's body, and this relay
// does not hold it.
var errBodyMissing = errors.New("claims: neither relay holds the resource")

// Tree builds what a relay answered for a version of typeURL: each
// resource from its body, or from s if the answer left it out. An answer
// that names a resource nobody has, carries a body that is not what it
// says, or is not the version root is an error. It decodes untrusted input
// (another relay's answer, or the store's).
func Tree(s *xds.Store, typeURL string, got *inspectpb.VersionContent, root ledger.Hash) (ledger.Tree[*xds.Resource], error) {
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, e := range got.GetEntries() {
		if len(e.GetHash()) != len(ledger.Hash{}) {
			return ledger.Tree[*xds.Resource]{}, fmt.Errorf("relay %s: resource %q has a hash of %d bytes", got.GetRelay(), e.GetName(), len(e.GetHash()))
		}
		h := ledger.Hash(e.GetHash())
		var res *xds.Resource
		if e.GetBody() != nil {
			var err error
			if res, err = s.Decode(typeURL, e.GetBody(), e.GetName()); err != nil {
				return ledger.Tree[*xds.Resource]{}, fmt.Errorf("relay %s: %w", got.GetRelay(), err)
			}
		} else if res = s.Lookup(h); res == nil {
			return ledger.Tree[*xds.Resource]{}, fmt.Errorf("relay %s: resource %q: %w", got.GetRelay(), e.GetName(), errBodyMissing)
		}
		if res.Hash != h || res.Name != e.GetName() {
			return ledger.Tree[*xds.Resource]{}, fmt.Errorf("relay %s: resource %q is not the content it names", got.GetRelay(), e.GetName())
		}
		b.Set(res.Name, res.Hash, res)
	}
	t := b.Tree()
	if t.Root() != root {
		return ledger.Tree[*xds.Resource]{}, fmt.Errorf("relay %s answered version %s, not %s", got.GetRelay(), t.Root(), root)
	}
	return t, nil
}

// Content is the answer to another relay's question about a version the
// relay relayID holds, held: every resource's name and hash, with the body
// of those view (the key's view now) does not hold as they are, or of
// every one if bodies. lookup finds a body the version holds by hash alone.
func Content(relayID string, held, view ledger.Tree[*xds.Resource], bodies bool, lookup func(ledger.Hash) *xds.Resource) *inspectpb.VersionContent {
	out := &inspectpb.VersionContent{Relay: relayID}
	for e := range held.All() {
		ve := &inspectpb.VersionEntry{Name: e.Name, Hash: e.Hash[:]}
		if cur, ok := view.Get(e.Name); bodies || !ok || cur.Hash != e.Hash {
			res := e.Value
			if res == nil {
				res = lookup(e.Hash)
			}
			if res != nil {
				ve.Body = res.Body
			}
		}
		out.Entries = append(out.Entries, ve)
	}
	return out
}
