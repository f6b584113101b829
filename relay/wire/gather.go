package wire

import (
	"math/bits"
	"sync"

	"google.golang.org/grpc/mem"
)

// gather returns data in one buffer, to be read in one piece: gRPC's own
// if the message came in one HTTP/2 frame, else a copy from gatherPool.
// The caller frees it.
func gather(data mem.BufferSlice) mem.Buffer { return data.MaterializeToBuffer(gatherPool) }

// gatherPool holds the buffers messages that came in several frames are
// gathered into. gRPC's default pool rounds every size from 32 KiB to 1 MiB
// up to 1 MiB and clears the whole buffer on every Get: a SotW ACK naming
// 1,000 endpoints (about 60 KB) cost a MiB of memory clearing, a quarter
// of the relay's CPU over the changes of 1,000 SotW Envoys (loadtest
// fanout, profile of the change phase). Its public pools all clear what
// they hand out; gathering overwrites every byte it hands on, so this one
// does not, and has a tier at every power of two.
var gatherPool mem.BufferPool = &tieredPool{}

const (
	minTier = 8  // 256 B: smaller messages come in one frame
	maxTier = 24 // 16 MiB: larger ones are rare (a large CDS from istiod), allocated as they come
)

// tieredPool is a mem.BufferPool of buffers whose capacity is a power of
// two from 2^minTier to 2^maxTier, handed out as they were put back (not
// cleared): for callers that write every byte they read.
type tieredPool struct {
	tiers [maxTier + 1]sync.Pool
}

func (p *tieredPool) Get(n int) *[]byte {
	t := max(minTier, bits.Len(uint(max(n, 1)-1))) // the smallest power of two ≥ n
	if t > maxTier {
		b := make([]byte, n)
		return &b
	}
	if b, ok := p.tiers[t].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<t)
	return &b
}

func (p *tieredPool) Put(b *[]byte) {
	c := cap(*b)
	t := bits.Len(uint(c)) - 1
	if c == 0 || c != 1<<t || t < minTier || t > maxTier {
		return // not one of ours
	}
	p.tiers[t].Put(b)
}
