package snapshot

import (
	"bytes"
	"reflect"
	"testing"

	"go.uber.org/goleak"

	"github.com/meshrelay/meshrelay/ledger"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// The embedded etcd's and its client's background goroutines that
		// outlive Close by a moment.
		goleak.IgnoreTopFunction("go.etcd.io/etcd/server/v3/storage/backend.(*backend).run"),
		goleak.IgnoreAnyFunction("go.opencensus.io/stats/view.(*worker).start"),
		goleak.IgnoreAnyFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
	)
}

func TestRecordsRoundTrip(t *testing.T) {
	h1, h2 := ledger.HashBytes([]byte("1")), ledger.HashBytes([]byte("2"))
	hd := head{Key: "sidecar/ns-1/app#1", Types: []headType{{Type: "t", Full: true, Root: h1, Stamp: 1 << 40, N: 3, Chunks: []ledger.Hash{h1, h2}}, {Type: "u", Root: h2}}}
	if got, err := decodeHead(encodeHead(hd)); err != nil || !reflect.DeepEqual(got, hd) {
		t.Errorf("decodeHead(encodeHead(%+v)) = %+v, %v", hd, got, err)
	}
	br := batchRecord{Stamp: 7<<32 + 3, Groups: []batchGroup{
		{Keys: []keyID{idOf("a"), idOf("b")}, Types: []logType{{Type: "t", Full: true, Root: h1, Set: []entry{{"a", h1}, {"b", h2}}, Del: []string{"c"}}, {Type: "u", Drop: true, Root: h2}}},
		{Keys: []keyID{idOf("c")}, Types: []logType{{Type: knownTypes[1], Root: h2}}},
	}}
	if got, err := decodeBatch(encodeBatch(br)); err != nil || !reflect.DeepEqual(got, br) {
		t.Errorf("decodeBatch(encodeBatch(%+v)) = %+v, %v", br, got, err)
	}
	ch := []entry{{"a", h1}, {"b", h2}}
	if got, err := decodeChunk(encodeChunk(ch)); err != nil || !reflect.DeepEqual(got, ch) {
		t.Errorf("decodeChunk = %+v, %v", got, err)
	}
	for _, rr := range []resourceRecord{
		{Type: "t", Name: "n", Body: []byte("body")},
		{Flags: flagSealed | flagParts, Type: "t", Name: "n", Parts: 3, Total: 3<<20 - 5},
	} {
		got, err := decodeResource(encodeResource(rr))
		if err != nil || got.Type != rr.Type || got.Name != rr.Name || got.Flags != rr.Flags || !bytes.Equal(got.Body, rr.Body) || got.Parts != rr.Parts || got.Total != rr.Total {
			t.Errorf("decodeResource(encodeResource(%+v)) = %+v, %v", rr, got, err)
		}
	}
}

// TestFormatV1Records: heads and batch records written before views had
// Stamps read with the zero Stamp (older than any stamped view).
func TestFormatV1Records(t *testing.T) {
	h := ledger.HashBytes([]byte("1"))
	hd := head{Key: "k", Types: []headType{{Type: "t", Full: true, Root: h, N: 1, Chunks: []ledger.Hash{h}}}}
	// Format 1: no stamp after the root.
	e := encoder{}
	e.byte(kindHead)
	e.byte(formatV1)
	e.str("k")
	e.uvarint(1)
	e.typ("t")
	e.bool(true)
	e.hash(h)
	e.uvarint(1)
	e.uvarint(1)
	e.hash(h)
	v1 := e.b
	got, err := decodeHead(v1)
	if err != nil || !reflect.DeepEqual(got, hd) {
		t.Fatalf("decodeHead(format 1) = %+v, %v; want %+v", got, err, hd)
	}
	br := batchRecord{Groups: []batchGroup{{Keys: []keyID{idOf("k")}, Types: []logType{{Type: "t", Root: h}}}}}
	b := encodeBatch(br)
	v1b := append([]byte{kindBatch, formatV1}, b[3:]...) // format 2 less its stamp (0, one byte)
	if got, err := decodeBatch(v1b); err != nil || !reflect.DeepEqual(got, br) {
		t.Fatalf("decodeBatch(format 1) = %+v, %v; want %+v", got, err, br)
	}
}

// FuzzDecode feeds every decoder what etcd might hold after someone wrote
// to it: they return an error or a value, never panic, and what decodes
// encodes back to the same bytes.
func FuzzDecode(f *testing.F) {
	h := ledger.HashBytes([]byte("x"))
	f.Add(encodeHead(head{Key: "k", Types: []headType{{Type: "t", Root: h, N: 1, Chunks: []ledger.Hash{h}}}}))
	f.Add(encodeBatch(batchRecord{Groups: []batchGroup{{Keys: []keyID{idOf("k")}, Types: []logType{{Type: "t", Root: h, Set: []entry{{"a", h}}, Del: []string{"b"}}}}}}))
	f.Add(encodeChunk([]entry{{"a", h}}))
	f.Add(encodeResource(resourceRecord{Type: "t", Name: "n", Body: []byte("b")}))
	f.Add(encodeResource(resourceRecord{Flags: flagParts, Type: "t", Name: "n", Parts: 2, Total: 10}))
	f.Add([]byte{kindBatch, formatV1, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add([]byte{kindHead, formatV1, 1, 'k', 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		// What decodes encodes back to the same bytes, or (a record of
		// format 1, written as format 2) to bytes that decode the same.
		if hd, err := decodeHead(b); err == nil && !bytes.Equal(encodeHead(hd), b) {
			if again, err := decodeHead(encodeHead(hd)); b[1] != formatV1 || err != nil || !reflect.DeepEqual(again, hd) {
				t.Errorf("head does not re-encode to its bytes")
			}
		}
		if br, err := decodeBatch(b); err == nil && !bytes.Equal(encodeBatch(br), b) {
			if again, err := decodeBatch(encodeBatch(br)); b[1] != formatV1 || err != nil || !reflect.DeepEqual(again, br) {
				t.Errorf("batch record does not re-encode to its bytes")
			}
		}
		if es, err := decodeChunk(b); err == nil && !bytes.Equal(encodeChunk(es), b) {
			t.Errorf("chunk does not re-encode to its bytes")
		}
		if rr, err := decodeResource(b); err == nil && rr.Flags&flagParts != 0 && (rr.Parts == 0 || rr.Parts > maxParts) {
			t.Errorf("resource with %d parts accepted", rr.Parts)
		}
	})
}
