package relay

import (
	"fmt"
	"runtime"
	"testing"

	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
)

// TestDroppedKeepsNewestWithinBudget: the store holds a resource only
// while something refers to it; dropped keeps the newest dropped ones
// alive within its byte budget, and lets the oldest go.
func TestDroppedKeepsNewestWithinBudget(t *testing.T) {
	s := newStore()
	d := &dropped{budget: 3 * 100}
	var hashes []ledger.Hash
	for i := range 5 {
		body := make([]byte, 100)
		copy(body, fmt.Sprint("resource ", i))
		r := s.intern(&Resource{Type: typeCluster, Name: fmt.Sprint("c", i), Hash: contentHash(typeCluster, body),
			Body: &anypb.Any{TypeUrl: typeCluster, Value: body}})
		hashes = append(hashes, r.Hash)
		d.keep([]*Resource{r, nil}) // a nil (no body) is skipped
	}
	if n, b := d.held(); n != 3 || b != 300 {
		t.Fatalf("held %d resources, %d bytes; want 3, 300", n, b)
	}
	runtime.GC()
	runtime.GC()
	for i, h := range hashes {
		if alive, want := s.lookup(h) != nil, i >= 2; alive != want {
			t.Errorf("resource %d alive = %v, want %v (the newest 3 kept, the others collected)", i, alive, want)
		}
	}
	runtime.KeepAlive(d)
	var none dropped // a zero budget keeps nothing
	none.keep([]*Resource{{Body: &anypb.Any{Value: []byte("x")}}})
	if n, _ := none.held(); n != 0 {
		t.Errorf("a zero budget kept %d", n)
	}
}
