package relay

import (
	"bytes"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/meshrelay/meshrelay/relay/auth"
)

// logBuffer collects a relay's log lines; safe for concurrent use.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *logBuffer) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

func listenLoopback(t *testing.T) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return lis
}

// elsewhere is a listener that says it listens on a pod address, not
// loopback (it does listen on loopback: nothing leaves the machine).
type elsewhere struct{ net.Listener }

func (elsewhere) Addr() net.Addr { return &net.TCPAddr{IP: net.IPv4(10, 0, 0, 7), Port: 15014} }

// A relay says loudly at start what it leaves open: a plaintext xDS port
// (alone, or beside the TLS one), an admin API anyone reaching it may use;
// and that an admin API with nothing to prove its callers is closed on a
// relay whose xDS port authenticates.
func TestStartSaysWhatIsOpen(t *testing.T) {
	adminElsewhere := func(t *testing.T) net.Listener { return elsewhere{listenLoopback(t)} }
	for _, tc := range []struct {
		name   string
		start  func(t *testing.T, logs *logBuffer) *Relay
		want   []string // lines (level and message start) that must be logged
		absent []string // that must not
	}{
		{"plaintext relay", func(t *testing.T, logs *logBuffer) *Relay {
			up := newTestUpstream(t, "ns1")
			return startRelay(t, up, func(c *Config) {
				c.Logger, c.XDS.Listener, c.Admin.Listener = logs.logger(), elsewhere{listenLoopback(t)}, elsewhere{listenLoopback(t)}
			})
		}, []string{`level=WARN msg="PLAINTEXT xDS port open: it authenticates no one`, `level=WARN msg="admin API open to anyone`}, []string{"admin API closed", "loopback only"}},
		{"plaintext relay on loopback", func(t *testing.T, logs *logBuffer) *Relay {
			up := newTestUpstream(t, "ns1")
			return startRelay(t, up, func(c *Config) { c.Logger = logs.logger(); c.Admin.Listen = "127.0.0.1:0" })
		}, []string{`level=INFO msg="PLAINTEXT xDS port open: it authenticates no one`, "(on loopback only"}, []string{"admin API open", "admin API closed", "level=WARN"}},
		{"TLS relay", func(t *testing.T, logs *logBuffer) *Relay {
			return newSecureEnv(t, auth.ModeAny, func(c *Config) { c.Logger = logs.logger(); c.Admin.Listener = adminElsewhere(t) }).r
		}, []string{`level=INFO msg="admin API closed but for health checks and /metrics`}, []string{"PLAINTEXT", "admin API open"}},
		{"TLS relay with a plaintext port", func(t *testing.T, logs *logBuffer) *Relay {
			return newSecureEnv(t, auth.ModeAny, func(c *Config) { c.Logger = logs.logger(); c.XDS.Listener = elsewhere{listenLoopback(t)} }).r
		}, []string{`level=WARN msg="PLAINTEXT xDS port open beside the TLS one`}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logs := &logBuffer{}
			tc.start(t, logs)
			got := logs.String()
			for _, w := range tc.want {
				if !strings.Contains(got, w) {
					t.Errorf("log lacks %q; it is:\n%s", w, got)
				}
			}
			for _, a := range tc.absent {
				if strings.Contains(got, a) {
					t.Errorf("log has %q; it is:\n%s", a, got)
				}
			}
		})
	}
}

// /healthz names every xDS port, and a plaintext one with a warning.
func TestHealthzWarnsOfPlaintext(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	r := startRelay(t, up, func(c *Config) { c.Admin.Listen = "127.0.0.1:0" })
	resp, err := http.Get("http://" + r.AdminAddr().String() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	want := "xds plaintext: " + r.Addr().String() + ": WARNING: PLAINTEXT, serves anyone who reaches it"
	if !strings.Contains(string(body), want) {
		t.Fatalf("/healthz = %q, want a line %q", body, want)
	}
}
