package loadtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"
)

// hungChildEnv, when set in the environment, makes this test binary a
// child that hangs: it listens on loopback, prints its ready line, then
// ignores SIGTERM, never reads its stdin (so never sees EOF) and never
// answers, as a child stuck in a deadlock would. Only SIGKILL ends it.
const hungChildEnv = "MESHRELAY_HUNG_CHILD"

func TestHungChildProcess(t *testing.T) {
	if os.Getenv(hungChildEnv) == "" {
		t.Skip("helper process for hung children; runs only when started by a test")
	}
	signal.Ignore(syscall.SIGTERM)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintf(os.Stderr, "hung child: %v\n", err)
		os.Exit(1)
	}
	defer lis.Close()
	fmt.Printf("%s%s\n", readyPrefix, lis.Addr())
	time.Sleep(time.Hour)
	os.Exit(1)
}

// startHungChild starts a hung child as a relay child would be started.
func startHungChild(ctx context.Context, _ RelayChildConfig) (*Child, error) {
	return StartChild(ctx, ChildConfig{
		Path: os.Args[0], Args: []string{"-test.run=^TestHungChildProcess$"},
		Env: []string{hungChildEnv + "=1"}, Stderr: os.Stderr,
	})
}

// hungFleetCommand runs a hung child as a fleet child: it never answers
// the start of its Envoys.
func hungFleetCommand(FleetChildConfig) (string, []string, []string, error) {
	return os.Args[0], []string{"-test.run=^TestHungChildProcess$"}, []string{hungChildEnv + "=1"}, nil
}

// shortStopTimeout makes the stops at the end of a run give up on a
// child, and kill it, after a second, for the rest of t.
func shortStopTimeout(t *testing.T) {
	old := stopTimeout
	stopTimeout = time.Second
	t.Cleanup(func() { stopTimeout = old })
}

// returnsWithin fails t if run does not return within d.
func returnsWithin(t *testing.T, d time.Duration, what string, run func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		run()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
	}
}
