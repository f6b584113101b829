package loadtest

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/traffic"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
)

// The observation stream carries, from a fleet child to its parent, what
// the parent's Tracker would have seen of each Envoy had the fleet run in
// the parent: the Envoy's index, the event (ACKed or Declared), the type,
// the names and generations, and when. It is binary, on a pipe of its own
// (the child's file descriptor 3), so that 5,000 Envoys ACKing every
// change cost the parent little; strings are sent once and then named by
// their index in the order they were first sent:
//
//	's' uvarint(len) bytes                                 a new string
//	'o' uvarint(envoy) kind uvarint(type) varint(unixnano)
//	    uvarint(n) n × (uvarint(name) uvarint(generation)) an observation
//
// kind is obsACKed or obsDeclared. The time is the child's wall clock,
// which the parent compares with its own (the upstream's Change.At): both
// processes run on one machine and read the same CLOCK_REALTIME, so the
// difference is as good as the in-process one, but for a clock step
// (NTP) during a run, which would show as one odd sample.
const (
	obsString   = 's'
	obsRecord   = 'o'
	obsACKed    = 1
	obsDeclared = 2
)

// Bounds the decoder enforces, so that a corrupt stream fails fast
// instead of allocating without end.
const (
	maxObsString = 1 << 16
	maxObsNames  = 1 << 22
	maxObsTable  = 1 << 24
)

// noObservations is the floor at which a child forwards nothing.
const noObservations = math.MaxUint64

// obsWriter is the child's end of the observation stream: Envoys hand it
// their events (event, from their stream goroutines) and one goroutine
// encodes and writes them, flushing whenever it has nothing more to
// write. Only names whose generation is above the floor are sent (see
// FleetProcess.Track): every change a Tracker times after setting the
// floor has a larger generation, so the Tracker sees every observation
// that can count, and the initial sync costs nothing. Close it once the
// Envoys have stopped.
type obsWriter struct {
	floor    atomic.Uint64
	ch       chan observation // bounded: a slow parent slows the Envoys' ACK bookkeeping, as a slow Tracker would
	stopping chan struct{}
	done     chan struct{}
	stopOnce sync.Once

	mu  sync.Mutex
	err error // the first write error
}

type observation struct {
	envoy   int
	kind    byte
	typeURL string
	at      time.Time
	names   []string
	gens    []uint64
}

func newObsWriter(w io.Writer) *obsWriter {
	o := &obsWriter{ch: make(chan observation, 4096), stopping: make(chan struct{}), done: make(chan struct{})}
	o.floor.Store(noObservations)
	go o.run(w)
	return o
}

// event is a FleetConfig.OnEvent.
func (o *obsWriter) event(i int, ev envoy.Event) {
	var kind byte
	switch ev.Kind {
	case envoy.ACKed:
		kind = obsACKed
	case envoy.Declared:
		kind = obsDeclared
	default:
		return
	}
	floor := o.floor.Load()
	if floor == noObservations {
		return
	}
	ob := observation{envoy: i, kind: kind, typeURL: ev.TypeURL, at: ev.At}
	for j, name := range ev.Names {
		var g uint64
		if j < len(ev.Generations) {
			g = ev.Generations[j]
		}
		if g > floor {
			ob.names, ob.gens = append(ob.names, name), append(ob.gens, g)
		}
	}
	if len(ob.names) == 0 {
		return
	}
	select {
	case o.ch <- ob:
	case <-o.stopping:
	}
}

func (o *obsWriter) run(w io.Writer) {
	defer close(o.done)
	bw := bufio.NewWriterSize(w, 64<<10)
	enc := obsEncoder{ids: map[string]uint64{}}
	write := func(ob observation) {
		if o.Err() != nil {
			return // the parent is gone: drop, so that no Envoy blocks
		}
		err := enc.encode(bw, ob)
		if err == nil && len(o.ch) == 0 {
			err = bw.Flush()
		}
		o.setErr(err)
	}
	for {
		select {
		case ob := <-o.ch:
			write(ob)
		case <-o.stopping:
			for {
				select {
				case ob := <-o.ch:
					write(ob)
				default:
					if o.Err() == nil {
						o.setErr(bw.Flush())
					}
					return
				}
			}
		}
	}
}

func (o *obsWriter) setErr(err error) {
	if err == nil {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.err == nil {
		o.err = err
	}
}

// Err returns the first error writing the stream met.
func (o *obsWriter) Err() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.err
}

// Close writes what is queued and stops the writer; later events are
// dropped. It does not close the underlying writer.
func (o *obsWriter) Close() error {
	o.stopOnce.Do(func() { close(o.stopping) })
	<-o.done
	return o.Err()
}

// obsEncoder writes observations, defining each string before its first
// use.
type obsEncoder struct {
	ids map[string]uint64
	buf []byte
}

func (e *obsEncoder) id(s string) uint64 {
	if id, ok := e.ids[s]; ok {
		return id
	}
	id := uint64(len(e.ids))
	e.ids[s] = id
	e.buf = append(e.buf, obsString)
	e.buf = binary.AppendUvarint(e.buf, uint64(len(s)))
	e.buf = append(e.buf, s...)
	return id
}

func (e *obsEncoder) encode(w io.Writer, ob observation) error {
	e.buf = e.buf[:0]
	typeID := e.id(ob.typeURL)
	nameIDs := make([]uint64, len(ob.names))
	for i, n := range ob.names {
		nameIDs[i] = e.id(n)
	}
	e.buf = append(e.buf, obsRecord)
	e.buf = binary.AppendUvarint(e.buf, uint64(ob.envoy))
	e.buf = append(e.buf, ob.kind)
	e.buf = binary.AppendUvarint(e.buf, typeID)
	e.buf = binary.AppendVarint(e.buf, ob.at.UnixNano())
	e.buf = binary.AppendUvarint(e.buf, uint64(len(ob.names)))
	for i := range ob.names {
		e.buf = binary.AppendUvarint(e.buf, nameIDs[i])
		e.buf = binary.AppendUvarint(e.buf, ob.gens[i])
	}
	_, err := w.Write(e.buf)
	return err
}

// readObservations decodes an observation stream until EOF, handing each
// observation of Envoy i < envoys to emit as the envoy.Event a Tracker
// observes (Names and Generations are fresh slices; At has no monotonic
// reading, so it is compared by wall clock). It returns nil at a clean
// EOF and an error at anything malformed.
func readObservations(r io.Reader, envoys int, emit func(i int, ev envoy.Event)) error {
	br := bufio.NewReaderSize(r, 64<<10)
	var table []string
	str := func(what string) (string, error) {
		id, err := binary.ReadUvarint(br)
		if err != nil {
			return "", fmt.Errorf("%s: %w", what, noEOF(err))
		}
		if id >= uint64(len(table)) {
			return "", fmt.Errorf("%s: string %d not defined (%d are)", what, id, len(table))
		}
		return table[id], nil
	}
	for n := 0; ; n++ {
		tag, err := br.ReadByte()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("loadtest: observation stream: %w", err)
		}
		fail := func(err error) error {
			return fmt.Errorf("loadtest: observation stream, record %d: %w", n, err)
		}
		switch tag {
		case obsString:
			l, err := binary.ReadUvarint(br)
			if err != nil {
				return fail(noEOF(err))
			}
			if l > maxObsString || len(table) >= maxObsTable {
				return fail(fmt.Errorf("string of %d bytes, the %dth: too large", l, len(table)+1))
			}
			b := make([]byte, l)
			if _, err := io.ReadFull(br, b); err != nil {
				return fail(noEOF(err))
			}
			table = append(table, string(b))
		case obsRecord:
			i, err := binary.ReadUvarint(br)
			if err != nil {
				return fail(noEOF(err))
			}
			if i >= uint64(envoys) {
				return fail(fmt.Errorf("Envoy %d of %d", i, envoys))
			}
			kind, err := br.ReadByte()
			if err != nil {
				return fail(noEOF(err))
			}
			ev := envoy.Event{Kind: envoy.ACKed}
			switch kind {
			case obsACKed:
			case obsDeclared:
				ev.Kind = envoy.Declared
			default:
				return fail(fmt.Errorf("event kind %d", kind))
			}
			if ev.TypeURL, err = str("type"); err != nil {
				return fail(err)
			}
			at, err := binary.ReadVarint(br)
			if err != nil {
				return fail(noEOF(err))
			}
			ev.At = time.Unix(0, at)
			count, err := binary.ReadUvarint(br)
			if err != nil {
				return fail(noEOF(err))
			}
			if count == 0 || count > maxObsNames {
				return fail(fmt.Errorf("%d names", count))
			}
			ev.Names, ev.Generations = make([]string, count), make([]uint64, count)
			for k := range ev.Names {
				if ev.Names[k], err = str("name"); err != nil {
					return fail(err)
				}
				if ev.Generations[k], err = binary.ReadUvarint(br); err != nil {
					return fail(noEOF(err))
				}
			}
			emit(int(i), ev)
		default:
			return fail(fmt.Errorf("unknown tag %#x", tag))
		}
	}
}

// noEOF makes an EOF inside a record what it is: a truncated record.
func noEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// holdings is an order-independent digest of a set of resources (type,
// name, generation): its size and the sum of a 64-bit hash of each. Two
// sets with equal digests are equal but for a hash collision (about 2^-64
// a comparison). A fleet child compares each Envoy's holdings with the
// digest of what the upstream serves its group (WaitSynced), instead of
// the parent sending the whole expected state.
type holdings struct {
	N   int    `json:"n"`
	Sum uint64 `json:"sum"`
}

func (h *holdings) add(key traffic.ResourceKey, gen uint64) {
	f := fnv.New64a()
	_, _ = io.WriteString(f, key)
	var g [8]byte
	binary.LittleEndian.PutUint64(g[:], gen)
	_, _ = f.Write(g[:])
	// FNV's low bits mix poorly for sums; finish with splitmix64's mixer.
	x := f.Sum64()
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	h.N++
	h.Sum += x
}

// digestOf is the digest of a map of ResourceKey to generation (what
// expected returns).
func digestOf(m map[traffic.ResourceKey]uint64) holdings {
	var h holdings
	for k, g := range m {
		h.add(k, g)
	}
	return h
}

// envoyHoldings is the digest of the clusters and endpoints e holds (what
// holds compares).
func envoyHoldings(e *envoy.Envoy) holdings {
	var h holdings
	for _, typeURL := range []string{envoy.ClusterType, envoy.EndpointType} {
		for name, held := range e.Resources(typeURL) {
			h.add(traffic.ResourceKeyOf(typeURL, name), held.Generation)
		}
	}
	return h
}
