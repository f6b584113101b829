package loadtest

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestDemo runs the demo briefly and checks that the tier converged with no
// protocol violation.
func TestDemo(t *testing.T) {
	cfg := DefaultDemoConfig()
	cfg.Envoys, cfg.Keys = 40, 8
	cfg.Duration = 6 * time.Second
	var out bytes.Buffer
	if err := RunDemo(context.Background(), cfg, &out); err != nil {
		t.Fatalf("RunDemo: %v\n%s", err, out.String())
	}
	t.Log(out.String())
	if !strings.Contains(out.String(), "changes reached all their Envoys") {
		t.Fatalf("no summary in the demo output:\n%s", out.String())
	}
}
