package main

import (
	"bytes"
	"log/slog"
	"os"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

// TestSetMemoryLimit: GOMEMLIMIT becomes the ratio of the provider's
// limit; an operator's GOMEMLIMIT, ratio 0 and no limit found leave the
// runtime's limit alone; a ratio out of range is refused.
func TestSetMemoryLimit(t *testing.T) {
	before := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetMemoryLimit(before) })
	// The test's own environment must not decide (t.Setenv restores them).
	t.Setenv("GOMEMLIMIT", "")
	t.Setenv("AUTOMEMLIMIT", "")
	os.Unsetenv("AUTOMEMLIMIT")
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))

	if err := setMemoryLimit(0.5, memlimit.Limit(1<<30), log); err != nil {
		t.Fatal(err)
	}
	if got := debug.SetMemoryLimit(-1); got != 1<<29 {
		t.Errorf("GOMEMLIMIT = %d after ratio 0.5 of 1 GiB, want %d", got, 1<<29)
	}

	debug.SetMemoryLimit(before)
	if err := setMemoryLimit(0, memlimit.Limit(1<<30), log); err != nil {
		t.Fatal(err)
	}
	if got := debug.SetMemoryLimit(-1); got != before {
		t.Errorf("ratio 0 changed GOMEMLIMIT to %d", got)
	}
	t.Setenv("GOMEMLIMIT", "3GiB")
	if err := setMemoryLimit(0.9, memlimit.Limit(1<<30), log); err != nil {
		t.Fatal(err)
	}
	if got := debug.SetMemoryLimit(-1); got != before {
		t.Errorf("an operator's GOMEMLIMIT was overridden: %d", got)
	}
	t.Setenv("GOMEMLIMIT", "")
	noLimit := func() (uint64, error) { return 0, memlimit.ErrNoLimit }
	debug.SetMemoryLimit(before)
	if err := setMemoryLimit(0.9, noLimit, log); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []float64{-0.1, 1.5} {
		if err := setMemoryLimit(bad, memlimit.Limit(1<<30), log); err == nil {
			t.Errorf("ratio %v accepted", bad)
		}
	}
	for _, want := range []string{"GOMEMLIMIT set from the container's memory limit", "kept", "--memory-limit-ratio 0", "the container has no memory limit"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the log does not say %q:\n%s", want, logs.String())
		}
	}
}
