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
	hd := head{Key: "sidecar/ns-1/app#1", Types: []headType{{Type: "t", Full: true, Root: h1, N: 3, Chunks: []ledger.Hash{h1, h2}}, {Type: "u", Root: h2}}}
	if got, err := decodeHead(encodeHead(hd)); err != nil || !reflect.DeepEqual(got, hd) {
		t.Errorf("decodeHead(encodeHead(%+v)) = %+v, %v", hd, got, err)
	}
	br := batchRecord{Groups: []batchGroup{
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
	f.Fuzz(func(t *testing.T, b []byte) {
		if hd, err := decodeHead(b); err == nil && !bytes.Equal(encodeHead(hd), b) {
			t.Errorf("head does not re-encode to its bytes")
		}
		if br, err := decodeBatch(b); err == nil && !bytes.Equal(encodeBatch(br), b) {
			t.Errorf("batch record does not re-encode to its bytes")
		}
		if es, err := decodeChunk(b); err == nil && !bytes.Equal(encodeChunk(es), b) {
			t.Errorf("chunk does not re-encode to its bytes")
		}
		if rr, err := decodeResource(b); err == nil && rr.Flags&flagParts != 0 && (rr.Parts == 0 || rr.Parts > maxParts) {
			t.Errorf("resource with %d parts accepted", rr.Parts)
		}
	})
}
