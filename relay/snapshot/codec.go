package snapshot

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/meshrelay/meshrelay/ledger"
)

// The store's values are small binary records, each starting with a kind
// byte and a format version so that a later format can be told apart:
//
//	resource  'R' 1  flags  type  name  (body | parts total)
//	chunk     'C' 1  n  (name hash)*                 part of a base index
//	head      'H' 1  key  ntypes  (type full root n nchunks chunk*)*
//	batch     'B' 1  ngroups  (nkeys keyID*  ntypes  (type flags root nset (name hash)* ndel name*)*)*
//
// Strings and counts are uvarint-prefixed; hashes are 32 raw bytes; a type
// URL is a one-byte code if it is one of knownTypes. What is
// read back comes from etcd, which anyone with access to it can write, so
// every decoder checks lengths against what is left and returns an error,
// never panics (FuzzDecode).
const (
	kindResource = 'R'
	kindChunk    = 'C'
	kindHead     = 'H'
	kindBatch    = 'B'
	formatV1     = 1
)

// Resource flags.
const (
	flagSealed = 1 << iota // the body is AES-GCM sealed (Secrets)
	flagParts              // the body is stored in parts under the resource's key
)

var errCorrupt = errors.New("snapshot: corrupt record")

// maxEntries bounds the entry count a head may claim for a type (it sizes
// a map when the view is rebuilt): ten times the largest mesh in sight.
const maxEntries = 1 << 22

// entry is one (name, content hash) of a view.
type entry struct {
	Name string
	Hash ledger.Hash
}

// resourceRecord is the stored form of one resource.
type resourceRecord struct {
	Flags byte
	Type  string
	Name  string
	Body  []byte // the body (sealed if flagSealed), unless flagParts
	Parts int    // with flagParts: the number of parts
	Total int    // with flagParts: the body's length
}

// headType is one type of a key's head: its base index.
type headType struct {
	Type   string
	Full   bool
	Root   ledger.Hash
	N      int           // entries in the base
	Chunks []ledger.Hash // the base's chunks, in order
}

// head is the root record of a key: its name and the base index of each
// type. Batch records written after it (a higher etcd revision) apply on
// top.
type head struct {
	Key   string
	Types []headType
}

// logType is the change of one type in a batch record.
type logType struct {
	Type string
	Full bool
	Drop bool        // the type is gone from the key
	Root ledger.Hash // the type's root after the change
	Set  []entry
	Del  []string
}

// keyID names a key in batch records and etcd keys: the first 8 bytes of
// SHA-256 of its name (a key name may be long; a batch names 100 keys).
type keyID [8]byte

// batchGroup is one change shared by several keys: the same types changed
// the same way.
type batchGroup struct {
	Keys  []keyID
	Types []logType
}

// batchRecord is one write of a writer's log: every key that changed in one
// flush, keys that changed alike sharing one group.
type batchRecord struct {
	Groups []batchGroup
}

// knownTypes are written as one byte (their index + 1) instead of their
// type URL, which would be most of a one-endpoint change's record. The list
// is append-only: an index, once written, means that type forever.
var knownTypes = []string{
	"type.googleapis.com/envoy.config.cluster.v3.Cluster",
	"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
	"type.googleapis.com/envoy.config.listener.v3.Listener",
	"type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
	"type.googleapis.com/envoy.config.route.v3.ScopedRouteConfiguration",
	"type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
	"type.googleapis.com/envoy.service.runtime.v3.Runtime",
	"type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
}

type encoder struct{ b []byte }

// typ writes a type URL: a known one as its code, any other as 0 and the
// string.
func (e *encoder) typ(t string) {
	if i := slices.Index(knownTypes, t); i >= 0 {
		e.byte(byte(i + 1))
		return
	}
	e.byte(0)
	e.str(t)
}

func (e *encoder) byte(c byte)        { e.b = append(e.b, c) }
func (e *encoder) uvarint(v uint64)   { e.b = binary.AppendUvarint(e.b, v) }
func (e *encoder) hash(h ledger.Hash) { e.b = append(e.b, h[:]...) }
func (e *encoder) str(s string) {
	e.uvarint(uint64(len(s)))
	e.b = append(e.b, s...)
}
func (e *encoder) bool(v bool) {
	if v {
		e.byte(1)
	} else {
		e.byte(0)
	}
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", errCorrupt, what)
	}
}

func (d *decoder) byte() byte {
	if d.err != nil || len(d.b) < 1 {
		d.fail("short")
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 || n != uvarintLen(v) {
		// A varint longer than it needs to be is not what the encoder
		// writes: one value, one encoding.
		d.fail("bad varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func uvarintLen(v uint64) int {
	var buf [binary.MaxVarintLen64]byte
	return binary.PutUvarint(buf[:], v)
}

// count reads a count of items each at least min bytes long, so that a
// corrupt count cannot make the caller allocate more than the record holds.
func (d *decoder) count(min int) int {
	v := d.uvarint()
	if d.err == nil && v > uint64(len(d.b)/min) {
		d.fail("count larger than the record")
		return 0
	}
	return int(v)
}

func (d *decoder) str() string {
	n := d.uvarint()
	if d.err != nil || n > uint64(len(d.b)) {
		d.fail("string longer than the record")
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

func (d *decoder) hash() ledger.Hash {
	var h ledger.Hash
	if d.err != nil || len(d.b) < len(h) {
		d.fail("short hash")
		return h
	}
	copy(h[:], d.b)
	d.b = d.b[len(h):]
	return h
}

func (d *decoder) typ() string {
	c := d.byte()
	switch {
	case d.err != nil:
		return ""
	case c == 0:
		t := d.str()
		if d.err == nil && slices.Contains(knownTypes, t) {
			d.fail("known type written in full") // one encoding per value
		}
		return t
	case int(c) <= len(knownTypes):
		return knownTypes[c-1]
	}
	d.fail("unknown type code")
	return ""
}

func (d *decoder) bool() bool {
	switch d.byte() {
	case 0:
		return false
	case 1:
		return true
	}
	d.fail("bad bool")
	return false
}

func (d *decoder) start(kind byte) {
	if k := d.byte(); d.err == nil && k != kind {
		d.fail(fmt.Sprintf("kind %q, want %q", k, kind))
	}
	if v := d.byte(); d.err == nil && v != formatV1 {
		d.fail(fmt.Sprintf("format %d", v))
	}
}

func (d *decoder) end() error {
	if d.err == nil && len(d.b) != 0 {
		d.fail("trailing bytes")
	}
	return d.err
}

func encodeResource(r resourceRecord) []byte {
	e := encoder{b: make([]byte, 0, 16+len(r.Type)+len(r.Name)+len(r.Body))}
	e.byte(kindResource)
	e.byte(formatV1)
	e.byte(r.Flags)
	e.typ(r.Type)
	e.str(r.Name)
	if r.Flags&flagParts != 0 {
		e.uvarint(uint64(r.Parts))
		e.uvarint(uint64(r.Total))
	} else {
		e.b = append(e.b, r.Body...)
	}
	return e.b
}

// decodeResource decodes a resource record. Body aliases b.
func decodeResource(b []byte) (resourceRecord, error) {
	d := decoder{b: b}
	d.start(kindResource)
	var r resourceRecord
	r.Flags = d.byte()
	r.Type = d.typ()
	r.Name = d.str()
	if d.err == nil && r.Flags&^(flagSealed|flagParts) != 0 {
		d.fail("unknown flags")
	}
	if r.Flags&flagParts != 0 {
		parts, total := d.uvarint(), d.uvarint()
		if d.err == nil && (parts == 0 || parts > maxParts || total > maxParts*partSize) {
			d.fail("bad parts")
		}
		r.Parts, r.Total = int(parts), int(total)
		return r, d.end()
	}
	if d.err != nil {
		return resourceRecord{}, d.err
	}
	r.Body = d.b
	return r, nil
}

func encodeChunk(es []entry) []byte {
	e := encoder{b: make([]byte, 0, 8+len(es)*80)}
	e.byte(kindChunk)
	e.byte(formatV1)
	e.uvarint(uint64(len(es)))
	for _, x := range es {
		e.str(x.Name)
		e.hash(x.Hash)
	}
	return e.b
}

func decodeChunk(b []byte) ([]entry, error) {
	d := decoder{b: b}
	d.start(kindChunk)
	n := d.count(1 + len(ledger.Hash{}))
	es := make([]entry, 0, n)
	for range n {
		es = append(es, entry{Name: d.str(), Hash: d.hash()})
	}
	return es, d.end()
}

func encodeHead(h head) []byte {
	e := encoder{}
	e.byte(kindHead)
	e.byte(formatV1)
	e.str(h.Key)
	e.uvarint(uint64(len(h.Types)))
	for _, t := range h.Types {
		e.typ(t.Type)
		e.bool(t.Full)
		e.hash(t.Root)
		e.uvarint(uint64(t.N))
		e.uvarint(uint64(len(t.Chunks)))
		for _, c := range t.Chunks {
			e.hash(c)
		}
	}
	return e.b
}

func decodeHead(b []byte) (head, error) {
	d := decoder{b: b}
	d.start(kindHead)
	var h head
	h.Key = d.str()
	n := d.count(3 + len(ledger.Hash{}))
	for range n {
		t := headType{Type: d.typ(), Full: d.bool(), Root: d.hash()}
		if n := d.uvarint(); d.err == nil && n > maxEntries {
			d.fail("entry count out of range")
		} else {
			t.N = int(n)
		}
		nc := d.count(len(ledger.Hash{}))
		for range nc {
			t.Chunks = append(t.Chunks, d.hash())
		}
		h.Types = append(h.Types, t)
	}
	return h, d.end()
}

// Batch record type flags.
const (
	logFull = 1 << iota
	logDrop
)

func (e *encoder) logTypes(ts []logType) {
	e.uvarint(uint64(len(ts)))
	for _, t := range ts {
		e.typ(t.Type)
		var f byte
		if t.Full {
			f |= logFull
		}
		if t.Drop {
			f |= logDrop
		}
		e.byte(f)
		e.hash(t.Root)
		e.uvarint(uint64(len(t.Set)))
		for _, x := range t.Set {
			e.str(x.Name)
			e.hash(x.Hash)
		}
		e.uvarint(uint64(len(t.Del)))
		for _, n := range t.Del {
			e.str(n)
		}
	}
}

func (d *decoder) logTypes() []logType {
	n := d.count(2 + len(ledger.Hash{}))
	var out []logType
	for range n {
		t := logType{Type: d.typ()}
		f := d.byte()
		if d.err == nil && f&^(logFull|logDrop) != 0 {
			d.fail("unknown log flags")
		}
		t.Full, t.Drop = f&logFull != 0, f&logDrop != 0
		t.Root = d.hash()
		ns := d.count(1 + len(ledger.Hash{}))
		for range ns {
			t.Set = append(t.Set, entry{Name: d.str(), Hash: d.hash()})
		}
		nd := d.count(1)
		for range nd {
			t.Del = append(t.Del, d.str())
		}
		out = append(out, t)
	}
	return out
}

// encodeChanges encodes a group's changes alone: keys whose changes encode
// alike share a group.
func encodeChanges(ts []logType) []byte {
	e := encoder{}
	e.logTypes(ts)
	return e.b
}

func encodeBatch(r batchRecord) []byte {
	e := encoder{}
	e.byte(kindBatch)
	e.byte(formatV1)
	e.uvarint(uint64(len(r.Groups)))
	for _, g := range r.Groups {
		e.uvarint(uint64(len(g.Keys)))
		for _, k := range g.Keys {
			e.b = append(e.b, k[:]...)
		}
		e.logTypes(g.Types)
	}
	return e.b
}

func decodeBatch(b []byte) (batchRecord, error) {
	d := decoder{b: b}
	d.start(kindBatch)
	var r batchRecord
	n := d.count(2)
	for range n {
		var g batchGroup
		nk := d.count(len(keyID{}))
		for range nk {
			var k keyID
			if d.err == nil {
				copy(k[:], d.b)
				d.b = d.b[len(k):]
			}
			g.Keys = append(g.Keys, k)
		}
		g.Types = d.logTypes()
		r.Groups = append(r.Groups, g)
	}
	return r, d.end()
}
