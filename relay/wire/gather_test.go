package wire

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/mem"
)

// TestTieredPool: a buffer fits what was asked in the smallest power of two
// at least as large (within the tiers), goes back to its tier, and a
// buffer of another shape is not pooled.
func TestTieredPool(t *testing.T) {
	p := &tieredPool{}
	for _, tc := range []struct{ n, cap int }{
		{0, 1 << minTier}, {1, 1 << minTier}, {256, 256}, {257, 512},
		{60_000, 1 << 16}, {1 << 16, 1 << 16}, {1 << maxTier, 1 << maxTier}, {1<<maxTier + 1, 1<<maxTier + 1},
	} {
		b := p.Get(tc.n)
		if len(*b) != tc.n || cap(*b) != tc.cap {
			t.Errorf("Get(%d): len %d cap %d, want len %d cap %d", tc.n, len(*b), cap(*b), tc.n, tc.cap)
		}
		p.Put(b)
	}
	odd := make([]byte, 1000)
	p.Put(&odd) // not a power of two: dropped, not handed out as 1 KiB
	if b := p.Get(1000); cap(*b) != 1024 {
		t.Errorf("Get(1000) after putting a 1,000-byte buffer: cap %d, want 1024", cap(*b))
	}
}

// TestGatherCopiesEveryByte: a message in several buffers is gathered
// whole into a reused (uncleared) buffer, never showing an earlier one's
// bytes.
func TestGatherCopiesEveryByte(t *testing.T) {
	dirty := gatherPool.Get(5000)
	for i := range *dirty {
		(*dirty)[i] = 0xff
	}
	gatherPool.Put(dirty)
	want := bytes.Repeat([]byte("abcdefg"), 700) // 4,900 bytes
	data := mem.BufferSlice{mem.SliceBuffer(want[:1000]), mem.SliceBuffer(want[1000:])}
	got := gather(data)
	defer got.Free()
	if !bytes.Equal(got.ReadOnlyData(), want) {
		t.Fatalf("gathered %d bytes differing from the message's %d", got.Len(), len(want))
	}
}
