package snapshot

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/sensitive"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Config configures a Store. Start from DefaultConfig.
type Config struct {
	// Endpoints are the etcd client URLs. Required.
	Endpoints []string
	// TLS, if set, secures the connection to etcd.
	TLS *tls.Config
	// Username and Password authenticate to etcd if Username is set.
	Username, Password string
	// DialTimeout bounds the first connection to etcd. Default 5s.
	DialTimeout time.Duration
	// RequestTimeout bounds each etcd request. Default 10s.
	RequestTimeout time.Duration

	// Prefix is where the store's keys live in etcd; Cluster is appended so
	// that two tiers sharing an etcd never mix. Default "/meshrelay/" and
	// "default".
	Prefix  string
	Cluster string
	// Member names this relay incarnation in the fence records: the etcd
	// write of whoever claimed a key last wins, and a deposed member's
	// writes are refused. Required.
	Member string

	// SealKey, if set (32 bytes), encrypts with AES-256-GCM, before it is
	// written, every resource that sets a field Envoy marks sensitive
	// anywhere in it (udpa.annotations.sensitive: an SDS Secret, a Cluster
	// with a private key inline in its TLS context, a listener's session
	// ticket keys, …; relay/sensitive finds them) and every Secret. If nil,
	// no such resource is persisted: Secrets are left out of every
	// snapshot, and so is a key's view of any other type while it holds
	// one (that type starts cold).
	SealKey []byte

	// FlushInterval is how long the writer gathers changes before writing:
	// the changes of every key in that time are one batch record. A change
	// reaches the keys that see it over a few hundred milliseconds (one
	// upstream stream each), so a second gathers one change of 100 keys
	// into one record: a restarted relay may start up to this much behind,
	// and catches up from its source. Default 1s.
	FlushInterval time.Duration
	// RetryMax bounds the backoff between attempts while etcd fails.
	// Default 10s.
	RetryMax time.Duration
	// CompactAfter is the number of log records after which a key's base
	// index is rewritten. Default 256.
	CompactAfter int
	// GCInterval is how often unreferenced resources are looked for; one
	// is deleted when two passes in a row found it unreferenced and
	// unchanged. Default 10m; negative disables collection.
	GCInterval time.Duration
	// Owns reports whether the tier's ring says this relay owns key.
	// The collector runs on the owner of GCLeaderKey, and a deposed key is
	// claimed back (ReclaimAfter) only while its owner is this relay.
	// Default: every key.
	Owns func(key string) bool
	// ReclaimAfter is how long a member whose write was fenced off by
	// another member's claim waits before it claims the key back, if the
	// ring still says it owns the key and nothing changed its ring
	// meanwhile. Without it, a member whose ring never moved (a peer cut
	// off from the gossip believed itself the owner of every key for a
	// while, and claimed them) would leave the key's persisted views
	// behind for good. Two members that both believe they own a key (a
	// partition) take turns, each once per ReclaimAfter at most. Default
	// 10s.
	ReclaimAfter time.Duration

	// Logger receives the store's logs. Default: discard.
	Logger *slog.Logger
	// Registerer receives the store's metrics. Default: none.
	Registerer prometheus.Registerer
}

// DefaultConfig returns a Config with every default filled in.
func DefaultConfig() Config {
	return Config{
		DialTimeout:    5 * time.Second,
		RequestTimeout: 10 * time.Second,
		Prefix:         "/meshrelay/",
		Cluster:        "default",
		FlushInterval:  time.Second,
		RetryMax:       10 * time.Second,
		CompactAfter:   256,
		GCInterval:     10 * time.Minute,
		ReclaimAfter:   10 * time.Second,
		Logger:         slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

func (c *Config) validate() error {
	switch {
	case len(c.Endpoints) == 0:
		return errors.New("snapshot: Endpoints is empty")
	case c.Member == "":
		return errors.New("snapshot: Member is empty")
	case c.SealKey != nil && len(c.SealKey) != 32:
		return fmt.Errorf("snapshot: SealKey is %d bytes, want 32", len(c.SealKey))
	case c.DialTimeout <= 0 || c.RequestTimeout <= 0:
		return errors.New("snapshot: DialTimeout and RequestTimeout must be positive")
	case c.FlushInterval < 0 || c.RetryMax <= 0 || c.ReclaimAfter <= 0:
		return errors.New("snapshot: FlushInterval must not be negative, and RetryMax and ReclaimAfter must be positive")
	case c.CompactAfter < 1:
		return fmt.Errorf("snapshot: CompactAfter %d, want at least 1", c.CompactAfter)
	case c.Cluster == "" || strings.Contains(c.Cluster, "/"):
		return fmt.Errorf("snapshot: Cluster %q must be non-empty without '/'", c.Cluster)
	case !strings.HasPrefix(c.Prefix, "/") || !strings.HasSuffix(c.Prefix, "/"):
		return fmt.Errorf("snapshot: Prefix %q must start and end with '/'", c.Prefix)
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return nil
}

// Size limits. etcd refuses a request over 1.5 MiB (--max-request-bytes)
// and a transaction of more than 128 operations (--max-txn-ops): every
// write here stays under both.
const (
	partSize     = 1 << 20        // a resource body longer than this is stored in parts
	maxParts     = 64             // so a resource is at most 64 MiB
	batchBytes   = 1 << 20        // bytes of puts gathered in one transaction
	batchOps     = 100            // operations in one transaction
	chunkEntries = 256            // a base chunk holds about this many entries…
	chunkBytes   = 512 << 10      // …and at most this many bytes
	logMaxBytes  = 256 << 10      // a change larger than this rewrites the base instead
	batchKeys    = 100            // keys in one batch record (one fence compare each)
	listPage     = 2000           // keys read per range request
	gcLeaderKey  = "meshrelay/gc" // the tier key whose owner collects
	secretType   = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
)

// GCLeaderKey is the aggregation key whose owner collects garbage in a tier
// (pass it to the ring's Owner).
const GCLeaderKey = gcLeaderKey

// ErrDeposed is reported (in logs and metrics) when another relay claimed a
// key after this one: its writes for the key are refused.
var ErrDeposed = errors.New("snapshot: deposed: another relay claimed the key")

// Store persists the views of the keys a relay owns in etcd and loads them
// back at start (relay.Snapshots). The etcd client lives here and nowhere
// else.
//
// Layout under Prefix+Cluster+"/":
//
//	res/<hash>               a resource, content-addressed, shared by every key
//	res/<hash>/<part>        the parts of a resource larger than 1 MiB
//	chunk/<hash>             a piece of a base index, content-addressed
//	keys/<id>/fence          the member that claimed the key (the fence)
//	keys/<id>/head           the key's name and base index: per type, root and chunks
//	batch/<member>/<seq>     one flush's changes of every key the member writes
//	held/<id>/<type>/<root>  a version a drained SotW Envoy holds (held.go), leased
//
// <id> is 8 bytes of SHA-256 of the key's name, in hex. A key's views are
// its head plus the batch records that name it with a higher revision, in
// revision order.
//
// Every head and batch write is a transaction that holds only while the
// fences' mod revisions are the ones this store's claims produced: once
// another member claims a key, this one's writes for it fail (ErrDeposed)
// until it claims the key back: when its ring changes, or ReclaimAfter
// later if its ring still names it the owner. Resources and chunks are
// content-addressed, so anyone may write them; they, and batch records no
// key applies any more, are collected once nothing refers to them.
//
// A Store is safe for concurrent use. Save never blocks on etcd; the writer
// goroutine retries with backoff while etcd is unreachable. Start it with
// Start and stop it with Stop.
type Store struct {
	cfg    Config
	cli    *clientv3.Client
	root   string // Prefix + Cluster + "/"
	log    *slog.Logger
	m      *metrics
	sealer *sealer

	mu    sync.Mutex
	jobs  map[string]*job
	taken map[string]*job // jobs the writer is writing now
	// parked holds the latest views of keys another member claimed, until
	// ReclaimAfter tells whether to claim them back (see reclaimable).
	parked map[string]*job
	wake   chan struct{}
	known  map[ledger.Hash]struct{} // resources and chunks present in etcd

	// keys, batchSeq and epochRev are owned by the writer goroutine.
	keys     map[string]*keyRec
	batchSeq uint64
	// epochRev is the mod revision of the collector's epoch key as the
	// writer last saw it (-1: not read yet). Every head and batch write
	// holds only while it is still so; see Collect.
	epochRev int64

	gcPrev map[string]int64 // GC candidates of the previous pass: key → mod revision

	heldMu  sync.Mutex // guards the lease of held records (held.go)
	lease   clientv3.LeaseID
	leaseAt time.Time

	cancel context.CancelFunc
	wg     sync.WaitGroup
	state  int // 0 new, 1 started, 2 stopped
}

// job is the latest unsaved views of a key.
type job struct {
	term  uint64
	views []xds.View
	since time.Time // when the oldest change in it was handed over
}

// keyRec is what the writer knows of a key it writes.
type keyRec struct {
	claimRev    int64 // the fence's mod revision after our claim; 0: no claim
	deposed     bool
	deposedTerm uint64
	deposedAt   time.Time
	needBase    bool
	persisted   map[string]xds.View // what etcd holds now, by type
	logCount    int                 // batch records since the base
	logBytes    int                 // their bytes (this key's share)
	baseBytes   int
	unsealable  map[string]bool // types left out for want of a seal key (logged once)
}

// New validates cfg and connects to etcd (lazily: an unreachable etcd is
// not an error here; writes retry).
func New(cfg Config) (*Store, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	var sl *sealer
	if cfg.SealKey != nil {
		var err error
		if sl, err = newSealer(cfg.SealKey); err != nil {
			return nil, err
		}
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:          cfg.Endpoints,
		TLS:                cfg.TLS,
		Username:           cfg.Username,
		Password:           cfg.Password,
		DialTimeout:        cfg.DialTimeout,
		MaxCallSendMsgSize: 2 * batchBytes,
		MaxCallRecvMsgSize: 512 << 20,
		Logger:             zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("snapshot: etcd client: %w", err)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		cli.Close()
		return nil, err
	}
	s := &Store{
		cfg:    cfg,
		cli:    cli,
		root:   cfg.Prefix + cfg.Cluster + "/",
		log:    cfg.Logger,
		m:      m,
		sealer: sl,
		jobs:   make(map[string]*job),
		taken:  make(map[string]*job),
		parked: make(map[string]*job),
		wake:   make(chan struct{}, 1),
		known:  make(map[ledger.Hash]struct{}),
		keys:   make(map[string]*keyRec),

		epochRev: -1,
	}
	m.store = s
	return s, nil
}

// Start runs the writer (and the collector). It does not block.
func (s *Store) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state != 0 {
		return errors.New("snapshot: Start called twice")
	}
	s.state = 1
	ctx, s.cancel = context.WithCancel(context.WithoutCancel(ctx))
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.writer(ctx)
	}()
	if s.cfg.GCInterval > 0 {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.collector(ctx)
		}()
	}
	return nil
}

// Stop flushes what is pending (until ctx ends), stops the goroutines and
// closes the etcd client. It is idempotent.
func (s *Store) Stop(ctx context.Context) error {
	s.mu.Lock()
	st := s.state
	s.state = 2
	s.mu.Unlock()
	if st == 1 {
		s.flushPending(ctx)
		s.cancel()
		s.wg.Wait()
	}
	if st != 2 {
		return s.cli.Close()
	}
	return nil
}

// flushPending gives the writer until ctx ends to write what is pending.
func (s *Store) flushPending(ctx context.Context) {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		if n, _ := s.Behind(); n == 0 {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// SetOwns replaces Config.Owns (a tier's ring is built after the store).
// Call it before Start.
func (s *Store) SetOwns(fn func(key string) bool) { s.cfg.Owns = fn }

func (s *Store) owns(key string) bool { return s.cfg.Owns == nil || s.cfg.Owns(key) }

// Save implements relay.Snapshots. It never blocks on etcd.
func (s *Store) Save(key string, term uint64, views []xds.View) {
	now := time.Now()
	s.mu.Lock()
	if j := s.jobs[key]; j != nil {
		now = j.since
	}
	s.jobs[key] = &job{term: term, views: views, since: now}
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Behind reports the keys whose latest views are not in etcd yet, and how
// long the oldest has waited: a health detail.
func (s *Store) Behind() (keys int, oldest time.Duration) {
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, j := range s.jobs {
		oldest = max(oldest, now.Sub(j.since))
	}
	keys = len(s.jobs)
	for k, j := range s.taken {
		oldest = max(oldest, now.Sub(j.since))
		if s.jobs[k] == nil {
			keys++
		}
	}
	return keys, oldest
}

func (s *Store) writer(ctx context.Context) {
	retry := time.Duration(0)
	for {
		var reclaim <-chan time.Time
		if due, ok := s.nextReclaim(); ok {
			reclaim = time.After(time.Until(due)) // collected unfired (Go 1.23)
		}
		select {
		case <-ctx.Done():
			return
		case <-s.wake:
		case <-reclaim:
			if !s.unpark() {
				continue
			}
		}
		// Gather: changes within FlushInterval are one write.
		if !sleepCtx(ctx, s.cfg.FlushInterval) {
			return
		}
		for {
			s.mu.Lock()
			jobs := s.jobs
			s.jobs, s.taken = make(map[string]*job), jobs
			s.mu.Unlock()
			if len(jobs) == 0 {
				break
			}
			failed := s.flush(ctx, jobs)
			s.mu.Lock()
			var firstErr error
			for key, err := range failed {
				// Again later, unless newer views came meanwhile.
				j := jobs[key]
				if cur := s.jobs[key]; cur != nil {
					cur.since = j.since
				} else {
					s.jobs[key] = j
				}
				firstErr = err
			}
			clear(s.taken)
			s.mu.Unlock()
			if len(failed) > 0 {
				s.m.writes.WithLabelValues("error").Add(float64(len(failed)))
				s.log.Warn("snapshot writes failed; retrying", "keys", len(failed), "err", firstErr, "retry_in", retry)
			}
			if ctx.Err() != nil {
				return
			}
			if len(failed) == 0 {
				// What arrived meanwhile woke s.wake: gather it for a
				// FlushInterval too.
				retry = 0
				break
			}
			retry = min(max(2*retry, 100*time.Millisecond), s.cfg.RetryMax)
			if !sleepCtx(ctx, retry) {
				return
			}
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Key layout.
func (s *Store) resKey(h ledger.Hash) string         { return s.root + "res/" + h.String() }
func (s *Store) partKey(h ledger.Hash, i int) string { return fmt.Sprintf("%s/%06d", s.resKey(h), i) }
func (s *Store) chunkKey(h ledger.Hash) string       { return s.root + "chunk/" + h.String() }
func (s *Store) keyDir(id keyID) string              { return s.root + "keys/" + hex.EncodeToString(id[:]) + "/" }
func (s *Store) fenceKey(id keyID) string            { return s.keyDir(id) + "fence" }
func (s *Store) headKey(id keyID) string             { return s.keyDir(id) + "head" }
func (s *Store) epochKey() string                    { return s.root + "gc/epoch" }
func (s *Store) batchKey(seq uint64) string {
	return fmt.Sprintf("%sbatch/%s/%016x", s.root, s.cfg.Member, seq)
}

// epochRev is the mod revision of the epoch key as read (0: absent).
func epochRev(kvs []*mvccpb.KeyValue) int64 {
	if len(kvs) == 1 {
		return kvs[0].ModRevision
	}
	return 0
}

func idOf(key string) keyID {
	sum := sha256.Sum256([]byte(key))
	var id keyID
	copy(id[:], sum[:])
	return id
}

func (s *Store) isKnown(h ledger.Hash) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.known[h]
	return ok
}

func (s *Store) addKnown(hs ...ledger.Hash) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, h := range hs {
		s.known[h] = struct{}{}
	}
}

// mustSeal reports whether r may be written only sealed: a Secret, or a
// resource that sets a field Envoy marks sensitive anywhere in it. What
// cannot be checked (a type this binary does not know, a body that does
// not parse) is taken to hold one.
func mustSeal(r *xds.Resource) bool {
	return mustSealBody(r.Type, r.Body.GetValue())
}

func mustSealBody(typeURL string, body []byte) bool {
	if typeURL == secretType {
		return true
	}
	found, err := sensitive.In(typeURL, body)
	return found || err != nil
}

// persistable drops what is never written: Secrets without a seal key.
// (prepare drops the views of other types that hold a resource that must
// be sealed.)
func (s *Store) persistable(views []xds.View) map[string]xds.View {
	out := make(map[string]xds.View, len(views))
	for _, v := range views {
		if v.Type == secretType && s.sealer == nil {
			continue
		}
		out[v.Type] = v
	}
	return out
}

// pend is a key the writer is writing now.
type pend struct {
	key     string
	id      keyID
	rec     *keyRec
	j       *job
	views   map[string]xds.View
	changes []logType
	size    int  // bytes of changes
	base    bool // write a new base, not a change record
}

// flush writes the latest views of every key in jobs: first the resources
// etcd does not hold, then a new base for the keys that need one (first
// write, or a log grown long), then one batch record for all the others,
// where keys that changed alike share one group. Every head and batch write
// is fenced by the claims of the keys in it. It returns the keys that
// failed, to be tried again.
func (s *Store) flush(ctx context.Context, jobs map[string]*job) map[string]error {
	failed := make(map[string]error)
	if err := s.syncEpoch(ctx); err != nil {
		for key := range jobs {
			failed[key] = err
		}
		return failed
	}
	var bases, logs []*pend
	fresh := make(map[ledger.Hash]*xds.Resource)
	for _, key := range slices.Sorted(maps.Keys(jobs)) {
		j := jobs[key]
		p, err := s.prepare(ctx, key, j, fresh)
		switch {
		case err != nil:
			failed[key] = err
		case p == nil:
		case p.base:
			bases = append(bases, p)
		default:
			logs = append(logs, p)
		}
	}
	if err := s.putResources(ctx, fresh); err != nil {
		for _, p := range append(bases, logs...) {
			failed[p.key] = err
		}
		return failed
	}
	for _, p := range bases {
		ok, err := s.writeBase(ctx, p)
		switch {
		case err != nil:
			failed[p.key] = err
		case !ok:
			s.deposed(p)
		default:
			s.written(p)
		}
	}
	for len(logs) > 0 {
		// At most batchKeys keys (a fence compare each) and about
		// batchBytes of changes (each key's are under logMaxBytes) a record.
		n, size := 0, 0
		for n < len(logs) && n < batchKeys && (n == 0 || size+logs[n].size <= batchBytes) {
			size += logs[n].size
			n++
		}
		if err := s.appendBatch(ctx, logs[:n]); err != nil {
			for _, p := range logs[:n] {
				failed[p.key] = err
			}
		}
		logs = logs[n:]
	}
	return failed
}

// prepare claims key if it must, and works out what changed since the last
// write. It returns nil if there is nothing to write.
func (s *Store) prepare(ctx context.Context, key string, j *job, fresh map[ledger.Hash]*xds.Resource) (*pend, error) {
	rec := s.keys[key]
	if rec == nil {
		rec = &keyRec{persisted: map[string]xds.View{}, unsealable: map[string]bool{}}
		s.keys[key] = rec
	}
	if rec.deposed && j.term <= rec.deposedTerm && !s.reclaimable(key, rec, j) {
		return nil, nil // another member writes this key for now
	}
	p := &pend{key: key, id: idOf(key), rec: rec, j: j, views: s.persistable(j.views)}
	s.mu.Lock()
	delete(s.parked, key) // j is newer
	s.mu.Unlock()
	if rec.claimRev == 0 || rec.deposed {
		rev, err := s.claim(ctx, p.id)
		if err != nil {
			return nil, err
		}
		rec.claimRev, rec.deposed, rec.needBase = rev, false, true
	}
	// A key that gets a new base needs no change record: only the
	// resources etcd lacks.
	p.base = rec.needBase || rec.logCount >= s.cfg.CompactAfter
	for _, t := range slices.Sorted(maps.Keys(p.views)) {
		v := p.views[t]
		old, had := rec.persisted[t]
		lt := logType{Type: t, Full: v.Full, Root: v.Tree.Root()}
		differs, unsealable, size := false, "", 0
		add := map[ledger.Hash]*xds.Resource{}
		ledger.Diff(old.Tree, v.Tree, func(c ledger.Change[*xds.Resource]) bool {
			differs = true
			if c.New != nil && fresh[c.New.Hash] == nil && add[c.New.Hash] == nil && !s.isKnown(c.New.Hash) {
				// Without a seal key, what must be sealed is not written,
				// nor the view that holds it. (Everything in what etcd
				// holds now was checked when it was written, so only what
				// changed is checked.)
				if s.sealer == nil && mustSeal(c.New.Value) {
					unsealable = c.Name
					return false
				}
				add[c.New.Hash] = c.New.Value
			}
			if p.base {
				return true
			}
			if c.New == nil {
				lt.Del = append(lt.Del, c.Name)
				size += len(c.Name) + 2
			} else {
				lt.Set = append(lt.Set, entry{Name: c.Name, Hash: c.New.Hash})
				size += len(c.Name) + 34
			}
			if p.size+size > logMaxBytes {
				p.base = true // a change this large is cheaper as a base
			}
			return true
		})
		if unsealable != "" {
			delete(p.views, t)
			if !rec.unsealable[t] {
				rec.unsealable[t] = true
				s.log.Warn("not persisting a view: a resource in it holds a field Envoy marks sensitive and there is no seal key (--snapshot-seal-key-file)",
					"key", key, "type", t, "resource", unsealable)
			}
			continue
		}
		delete(rec.unsealable, t)
		maps.Copy(fresh, add)
		p.size += size
		if !had || differs || old.Full != v.Full {
			p.changes = append(p.changes, lt)
			p.size += 36
		}
	}
	for _, t := range slices.Sorted(maps.Keys(rec.persisted)) {
		if _, ok := p.views[t]; !ok {
			p.changes = append(p.changes, logType{Type: t, Drop: true, Root: ledger.EmptyRoot()})
			p.size += 36
		}
	}
	if len(p.changes) == 0 && !rec.needBase {
		return nil, nil
	}
	if p.base || rec.logBytes+p.size > max(64<<10, rec.baseBytes/2) {
		p.base, p.changes = true, nil
	}
	return p, nil
}

// written records that p's views are in etcd.
func (s *Store) written(p *pend) {
	p.rec.persisted = p.views
	s.m.writes.WithLabelValues("ok").Inc()
	s.m.lag.Observe(time.Since(p.j.since).Seconds())
}

// deposed records that another member claimed p's key, and parks its
// views until the key may be claimed back.
func (s *Store) deposed(p *pend) {
	p.rec.deposed, p.rec.deposedTerm, p.rec.deposedAt = true, p.j.term, time.Now()
	s.m.deposed.Inc()
	s.m.writes.WithLabelValues("deposed").Inc()
	s.log.Warn("not writing key: another relay claimed it", "key", p.key, "err", ErrDeposed)
	s.park(p.key, p.j)
}

// reclaimable reports whether j, views of a key another member claimed
// in j's term, is to be written all the same: ReclaimAfter has passed since
// and the ring still says this relay owns the key. A term that grew (the
// ring moved) claims the key at once, without asking. If it is not yet
// time, j is parked; if the key is not ours, j is dropped.
//
// Without it a claim made on a mistaken ring would hold for good: a relay
// cut off from the gossip believes it owns every key, and claims those it
// serves; the owners, whose rings may never have moved, saw their writes
// fenced off, and the partitioned relay stops writing once it rejoins.
func (s *Store) reclaimable(key string, rec *keyRec, j *job) bool {
	if !s.owns(key) {
		s.m.writes.WithLabelValues("deposed").Inc()
		s.mu.Lock()
		delete(s.parked, key)
		s.mu.Unlock()
		return false
	}
	if time.Since(rec.deposedAt) < s.cfg.ReclaimAfter {
		s.m.writes.WithLabelValues("deposed").Inc()
		s.park(key, j)
		return false
	}
	s.m.reclaims.Inc()
	s.log.Info("claiming a key back: the ring still says this relay owns it", "key", key, "deposed_for", time.Since(rec.deposedAt))
	return true
}

// park keeps j, the latest views of a key another member claimed, until the
// key may be claimed back (unpark).
func (s *Store) park(key string, j *job) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.parked[key] = j
}

// nextReclaim returns when the earliest parked key may be claimed back.
func (s *Store) nextReclaim() (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var due time.Time
	for key := range s.parked {
		// s.keys is the writer's, and so is this call.
		if at := s.keys[key].deposedAt.Add(s.cfg.ReclaimAfter); due.IsZero() || at.Before(due) {
			due = at
		}
	}
	return due, !due.IsZero()
}

// unpark hands the parked keys whose time has come back to the writer,
// unless newer views of them came meanwhile. It reports whether it handed
// any.
func (s *Store) unpark() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	handed := false
	for key, j := range s.parked {
		if time.Since(s.keys[key].deposedAt) < s.cfg.ReclaimAfter {
			continue
		}
		delete(s.parked, key)
		if s.jobs[key] == nil {
			s.jobs[key] = j
		}
		handed = true
	}
	return handed
}

// claim makes this member the key's writer: whoever claimed before is
// fenced off from now on. It returns the fence's new mod revision.
func (s *Store) claim(ctx context.Context, id keyID) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	k := s.fenceKey(id)
	resp, err := s.cli.Put(ctx, k, s.cfg.Member)
	if err != nil {
		return 0, fmt.Errorf("claim: %w", err)
	}
	s.m.bytes.Add(float64(len(k) + len(s.cfg.Member)))
	return resp.Header.Revision, nil
}

func (s *Store) fence(p *pend) clientv3.Cmp {
	return clientv3.Compare(clientv3.ModRevision(s.fenceKey(p.id)), "=", p.rec.claimRev)
}

// epochCmp holds a write to the collection epoch the writer knows: one
// that refers to a resource or chunk it believes etcd holds must not land
// after a collection pass began that may delete it.
func (s *Store) epochCmp() clientv3.Cmp {
	return clientv3.Compare(clientv3.ModRevision(s.epochKey()), "=", s.epochRev)
}

// syncEpoch reads the collection epoch if the writer has not yet.
func (s *Store) syncEpoch(ctx context.Context) error {
	if s.epochRev >= 0 {
		return nil
	}
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	resp, err := s.cli.Get(rctx, s.epochKey())
	if err != nil {
		return fmt.Errorf("read collection epoch: %w", err)
	}
	s.newEpoch(resp.Kvs)
	return nil
}

// newEpoch takes the epoch key as read (absent: none yet). A new epoch
// means a collection pass may delete what no key referred to: from now on
// nothing is taken to be in etcd until written or read again.
func (s *Store) newEpoch(kvs []*mvccpb.KeyValue) {
	rev := int64(0)
	if len(kvs) == 1 {
		rev = kvs[0].ModRevision
	}
	if rev == s.epochRev {
		return
	}
	if s.epochRev >= 0 {
		s.mu.Lock()
		clear(s.known)
		s.mu.Unlock()
		s.log.Debug("collection epoch changed: writing what keys refer to again", "revision", rev)
	}
	s.epochRev = rev
}

// appendBatch writes one batch record for ps (at most batchKeys keys), held
// only while every one of them is still claimed by this member. Keys
// another member claimed since are found, marked deposed and left out, and
// the rest written again.
func (s *Store) appendBatch(ctx context.Context, ps []*pend) error {
	for len(ps) > 0 {
		groups := map[string]*batchGroup{}
		var order []string
		for _, p := range ps {
			sig := string(encodeChanges(p.changes))
			g := groups[sig]
			if g == nil {
				g = &batchGroup{Types: p.changes}
				groups[sig] = g
				order = append(order, sig)
			}
			g.Keys = append(g.Keys, p.id)
		}
		var rec batchRecord
		for _, sig := range order {
			rec.Groups = append(rec.Groups, *groups[sig])
		}
		b := encodeBatch(rec)
		// A new key for every attempt: an attempt that failed may still
		// have committed, and what is written again re-applies its changes.
		k := s.batchKey(s.batchSeq)
		s.batchSeq++
		cmps := make([]clientv3.Cmp, 0, len(ps)+1)
		gets := make([]clientv3.Op, 0, len(ps)+1)
		for _, p := range ps {
			cmps = append(cmps, s.fence(p))
			gets = append(gets, clientv3.OpGet(s.fenceKey(p.id)))
		}
		cmps = append(cmps, s.epochCmp())
		gets = append(gets, clientv3.OpGet(s.epochKey()))
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		resp, err := s.cli.Txn(rctx).If(cmps...).Then(clientv3.OpPut(k, string(b))).Else(gets...).Commit()
		cancel()
		if err != nil {
			// It may have committed all the same: then a record of the
			// changes since what is persisted now would be applied on top
			// of it, and undo nothing it added. A new base is right
			// whatever happened.
			for _, p := range ps {
				p.rec.needBase = true
			}
			return fmt.Errorf("write batch: %w", err)
		}
		if resp.Succeeded {
			s.m.bytes.Add(float64(len(k) + len(b)))
			share := len(b) / len(ps)
			for _, p := range ps {
				p.rec.logCount++
				p.rec.logBytes += share
				s.written(p)
			}
			return nil
		}
		if epoch := resp.Responses[len(ps)].GetResponseRange().GetKvs(); epochRev(epoch) != s.epochRev {
			// A collection pass began: write what the changes refer to
			// again (the next flush does, from a known set now empty).
			s.newEpoch(epoch)
			return errors.New("write batch: a collection pass began; writing again")
		}
		var still []*pend
		for i, p := range ps {
			kvs := resp.Responses[i].GetResponseRange().GetKvs()
			if len(kvs) == 1 && kvs[0].ModRevision == p.rec.claimRev {
				still = append(still, p)
			} else {
				s.deposed(p)
			}
		}
		if len(still) == len(ps) {
			return errors.New("write batch: refused, yet every fence holds")
		}
		ps = still
	}
	return nil
}

// writeBase writes every type's index as chunks, then the head, in one
// transaction fenced by the claim. Batch records written before the head
// no longer apply to the key.
func (s *Store) writeBase(ctx context.Context, p *pend) (bool, error) {
	h := head{Key: p.key}
	var puts []clientv3.Op
	var newChunks []ledger.Hash
	total := 0
	for _, t := range slices.Sorted(maps.Keys(p.views)) {
		v := p.views[t]
		ht := headType{Type: t, Full: v.Full, Root: v.Tree.Root(), N: v.Tree.Len()}
		for _, c := range chunksOf(v.Tree) {
			b := encodeChunk(c)
			ch := ledger.HashBytes(b)
			ht.Chunks = append(ht.Chunks, ch)
			total += len(b)
			if s.isKnown(ch) || slices.Contains(newChunks, ch) {
				continue
			}
			newChunks = append(newChunks, ch)
			puts = append(puts, clientv3.OpPut(s.chunkKey(ch), string(b)))
		}
		h.Types = append(h.Types, ht)
	}
	if err := s.commitBatches(ctx, puts); err != nil {
		return false, err
	}
	s.addKnown(newChunks...)
	hb := encodeHead(h)
	if len(hb) > batchBytes {
		return false, fmt.Errorf("write %s: head of %d bytes exceeds %d", p.key, len(hb), batchBytes)
	}
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	resp, err := s.cli.Txn(rctx).If(s.fence(p), s.epochCmp()).
		Then(clientv3.OpPut(s.headKey(p.id), string(hb))).
		Else(clientv3.OpGet(s.epochKey())).
		Commit()
	cancel()
	if err != nil {
		return false, fmt.Errorf("write %s: %w", p.key, err)
	}
	if !resp.Succeeded {
		if epoch := resp.Responses[0].GetResponseRange().GetKvs(); epochRev(epoch) != s.epochRev {
			s.newEpoch(epoch)
			return false, errors.New("write base: a collection pass began; writing again")
		}
		return false, nil
	}
	s.m.bytes.Add(float64(len(s.headKey(p.id)) + len(hb)))
	s.m.bases.Inc()
	p.rec.needBase, p.rec.logCount, p.rec.logBytes, p.rec.baseBytes = false, 0, 0, total
	return true, nil
}

// chunksOf cuts a view's entries, sorted by name, into content-defined
// chunks: a chunk ends after a name whose hash is 0 modulo chunkEntries
// (or at chunkBytes), so an edit changes only the chunk it falls in and
// views that share most entries share most chunks.
func chunksOf(t ledger.Tree[*xds.Resource]) [][]entry {
	es := make([]entry, 0, t.Len())
	for e := range t.All() {
		es = append(es, entry{Name: e.Name, Hash: e.Hash})
	}
	slices.SortFunc(es, func(a, b entry) int { return cmp.Compare(a.Name, b.Name) })
	var out [][]entry
	start, size := 0, 0
	for i, e := range es {
		size += len(e.Name) + 34
		f := fnv.New64a()
		f.Write([]byte(e.Name))
		if f.Sum64()%chunkEntries == 0 || size >= chunkBytes || i == len(es)-1 {
			out = append(out, es[start:i+1])
			start, size = i+1, 0
		}
	}
	return out
}

// putResources writes resources etcd does not hold yet, in transactions
// within etcd's limits; a resource over partSize goes in parts first.
func (s *Store) putResources(ctx context.Context, rs map[ledger.Hash]*xds.Resource) error {
	var ops []clientv3.Op
	var hs []ledger.Hash
	for _, r := range rs { // one per content: prepare gathered them by hash
		body := r.Body.GetValue()
		rr := resourceRecord{Type: r.Type, Name: r.Name, Body: body}
		if mustSeal(r) {
			if s.sealer == nil {
				return fmt.Errorf("resource %s holds a sensitive field: not written without a seal key", r.Name)
			}
			sealed, err := s.sealer.seal(body, r.Hash)
			if err != nil {
				return err
			}
			rr.Body, rr.Flags = sealed, flagSealed
		}
		if len(rr.Body) > partSize {
			if err := s.putParts(ctx, r.Hash, &rr); err != nil {
				return err
			}
		}
		ops = append(ops, clientv3.OpPut(s.resKey(r.Hash), string(encodeResource(rr))))
		hs = append(hs, r.Hash)
	}
	if err := s.commitBatches(ctx, ops); err != nil {
		return err
	}
	s.addKnown(hs...)
	return nil
}

// putParts writes a large body in parts, one transaction each, and turns
// rr into the record that points at them.
func (s *Store) putParts(ctx context.Context, h ledger.Hash, rr *resourceRecord) error {
	n := (len(rr.Body) + partSize - 1) / partSize
	if n > maxParts {
		return fmt.Errorf("resource %s: %d bytes exceed %d", rr.Name, len(rr.Body), maxParts*partSize)
	}
	for i := range n {
		part := rr.Body[i*partSize : min((i+1)*partSize, len(rr.Body))]
		if err := s.commitBatches(ctx, []clientv3.Op{clientv3.OpPut(s.partKey(h, i), string(part))}); err != nil {
			return err
		}
	}
	rr.Flags |= flagParts
	rr.Parts, rr.Total, rr.Body = n, len(rr.Body), nil
	return nil
}

// commitBatches commits puts in transactions of at most batchOps
// operations and about batchBytes bytes.
func (s *Store) commitBatches(ctx context.Context, ops []clientv3.Op) error {
	for len(ops) > 0 {
		n, size := 0, 0
		for n < len(ops) && n < batchOps {
			sz := len(ops[n].KeyBytes()) + len(ops[n].ValueBytes())
			if n > 0 && size+sz > batchBytes {
				break
			}
			size += sz
			n++
		}
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		_, err := s.cli.Txn(rctx).Then(ops[:n]...).Commit()
		cancel()
		if err != nil {
			return fmt.Errorf("write resources: %w", err)
		}
		s.m.bytes.Add(float64(size))
		ops = ops[n:]
	}
	return nil
}
