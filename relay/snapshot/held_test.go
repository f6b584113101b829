package snapshot

import (
	"bytes"
	"context"
	"testing"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// TestHeldVersionRoundTrip: a version handed over is read back by another
// store with the bodies the reader lacks (those handed over, and those a
// key's snapshot keeps in etcd); a root never handed over is not found; a
// Secret is never kept in clear; a damaged record is an error, not a
// wrong version.
func TestHeldVersionRoundTrip(t *testing.T) {
	e := etcdFor(t)
	writer := storeFor(t, e.Endpoints(), "draining", nil)
	reader := storeFor(t, e.Endpoints(), "next", nil)
	ctx := t.Context()

	kept := res(typeCluster, "c0", []byte("in the key's snapshot"))
	writer.Save("k", 1, []xds.View{viewOf(typeCluster, true, kept)})
	waitWritten(t, writer)
	gone := res(typeCluster, "c2", randomBytes(partSize+100)) // removed since: only the hand-over has it, in parts
	local := res(typeCluster, "c1", []byte("the reader holds it"))
	v := viewOf(typeCluster, true, kept, local, gone)
	if err := writer.SaveHeld(ctx, "k", v, []*xds.Resource{gone}); err != nil {
		t.Fatal(err)
	}
	got, ok, err := reader.LoadHeld(ctx, "k", typeCluster, v.Tree.Root(), func(h ledger.Hash) bool { return h == local.Hash })
	if err != nil || !ok {
		t.Fatalf("LoadHeld = %v, %v; want the version", ok, err)
	}
	want := map[string][]byte{"c0": kept.Body.GetValue(), "c1": nil, "c2": gone.Body.GetValue()}
	if len(got.Entries) != len(want) {
		t.Fatalf("%d entries, want %d", len(got.Entries), len(want))
	}
	for _, he := range got.Entries {
		r, _ := v.Tree.Get(he.Name)
		if he.Hash != r.Hash || !bytes.Equal(he.Body, want[he.Name]) {
			t.Errorf("%s: hash %s body %q, want %s %q", he.Name, he.Hash, he.Body, r.Hash, want[he.Name])
		}
	}

	if _, ok, err := reader.LoadHeld(ctx, "k", typeCluster, ledger.HashBytes([]byte("never")), func(ledger.Hash) bool { return false }); ok || err != nil {
		t.Errorf("a root never handed over: ok %v, err %v", ok, err)
	}
	if _, ok, _ := reader.LoadHeld(ctx, "k", typeRoute, v.Tree.Root(), func(ledger.Hash) bool { return false }); ok {
		t.Error("a version of one type was found as another's")
	}

	secret := viewOf(secretType, false, res(secretType, "key", []byte("private")))
	if err := writer.SaveHeld(ctx, "k", secret, slicesOf(secret)); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := reader.LoadHeld(ctx, "k", secretType, secret.Tree.Root(), func(ledger.Hash) bool { return false }); ok {
		t.Error("a Secret was handed over without a SealKey")
	}

	if _, err := writer.cli.Put(ctx, writer.heldKey(idOf("k"), typeCluster, v.Tree.Root()), "damaged"); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := reader.LoadHeld(ctx, "k", typeCluster, v.Tree.Root(), func(ledger.Hash) bool { return true }); ok || err == nil {
		t.Errorf("a damaged record: ok %v, err %v; want an error", ok, err)
	}
	other := viewOf(typeCluster, true, kept)
	if err := writer.SaveHeld(ctx, "k", other, nil); err != nil {
		t.Fatal(err)
	}
	// The record of another key, or of another root, put where v's is.
	raw, _, _ := writer.getOne(ctx, writer.heldKey(idOf("k"), typeCluster, other.Tree.Root()))
	if _, err := writer.cli.Put(context.Background(), writer.heldKey(idOf("k"), typeCluster, v.Tree.Root()), string(raw)); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := reader.LoadHeld(ctx, "k", typeCluster, v.Tree.Root(), func(ledger.Hash) bool { return true }); ok || err == nil {
		t.Errorf("another version's record: ok %v, err %v; want an error", ok, err)
	}
}

func slicesOf(v xds.View) []*xds.Resource {
	var out []*xds.Resource
	for e := range v.Tree.All() {
		out = append(out, e.Value)
	}
	return out
}
