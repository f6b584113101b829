package main

import (
	"fmt"
	"log/slog"
	"math"
	"os"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

// setMemoryLimit sets the Go runtime's soft memory limit (GOMEMLIMIT) to
// ratio of the memory limit provider reports (the container's, from its
// cgroup), so that the garbage collector works harder before the kernel's
// OOM killer would end the relay and lose its cache. It leaves a GOMEMLIMIT
// the operator set alone; ratio 0 leaves the runtime's default (no limit).
// It logs what it did. (The library also reads AUTOMEMLIMIT: "off", or a
// ratio that overrides this one.)
//
// automemlimit reads cgroup v1 and v2 as the kernel exposes them; this is
// the library the field uses for it, rather than parsing cgroup files by
// hand.
func setMemoryLimit(ratio float64, provider memlimit.Provider, log *slog.Logger) error {
	if ratio == 0 {
		log.Info("GOMEMLIMIT not set from the container's limit (--memory-limit-ratio 0)")
		return nil
	}
	if ratio < 0 || ratio > 1 {
		return fmt.Errorf("--memory-limit-ratio %v: want a fraction in (0, 1], or 0 for none", ratio)
	}
	if v := os.Getenv("GOMEMLIMIT"); v != "" {
		log.Info("GOMEMLIMIT set by the operator; kept", "gomemlimit", v)
		return nil
	}
	limit, err := memlimit.Set(memlimit.WithRatio(ratio), memlimit.WithProvider(provider))
	switch {
	case err != nil:
		// No cgroup to read (not in a container): the runtime's default
		// stays.
		log.Info("GOMEMLIMIT not set: the container's memory limit could not be read", "err", err)
	case limit == math.MaxInt64:
		log.Info("GOMEMLIMIT not set: the container has no memory limit")
	default:
		log.Info("GOMEMLIMIT set from the container's memory limit", "gomemlimit_bytes", limit, "ratio", ratio)
	}
	return nil
}
