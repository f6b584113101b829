package traffic

import (
	"context"
	"slices"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// ResourceKey names a resource: "<type URL>|<name>".
type ResourceKey = string

// ResourceKeyOf is the ResourceKey of the resource typeURL/name.
func ResourceKeyOf(typeURL, name string) ResourceKey { return typeURL + "|" + name }

// Generations maps "type|name" to generation over the given types of a
// snapshot (every type if none is given).
func Generations(snap map[string]map[string]proto.Message, types ...string) map[ResourceKey]uint64 {
	out := map[ResourceKey]uint64{}
	for typeURL, res := range snap {
		if len(types) > 0 && !slices.Contains(types, typeURL) {
			continue
		}
		for name, m := range res {
			g, _ := upstream.Generation(m)
			out[ResourceKeyOf(typeURL, name)] = g
		}
	}
	return out
}

// EnvoyCounters are per-Envoy counters of a fleet, by Envoy index.
type EnvoyCounters struct {
	// Bytes is what each Envoy received (proto.Size of its responses).
	Bytes []uint64 `json:"bytes"`
	// Reconnects is the streams each reopened.
	Reconnects []uint64 `json:"reconnects"`
}

// SleepCtx waits d, or until ctx ends; it reports whether ctx is still
// live (d passed, or d was not positive).
func SleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
