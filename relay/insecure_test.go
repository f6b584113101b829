package relay

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/meshrelay/meshrelay/relay/auth"
)

// nobodyAuthenticator authenticates no one: enough for a relay whose xDS
// port authenticates.
type nobodyAuthenticator struct{}

func (nobodyAuthenticator) Authenticate(context.Context) (auth.Identity, error) {
	return auth.Identity{}, errors.New("nobody is authenticated here")
}

func (nobodyAuthenticator) Token(context.Context, auth.Identity) (string, time.Time, bool) {
	return "", time.Time{}, false
}

// A relay whose xDS port authenticates is refused in a tier without mTLS
// between relays: whoever claimed to be a relay on the port relays dial
// was served every key's config, SDS private keys included (issue 31,
// finding 1). Tier.InsecureForDevelopment lets it start, loudly.
func TestAuthenticatingTierNeedsPeerMTLS(t *testing.T) {
	base := func() Config {
		cfg := DefaultConfig()
		cfg.Upstream.Addr = "unused:1"
		cfg.XDS.TLS, cfg.XDS.TLSListen = &tls.Config{MinVersion: tls.VersionTLS12}, "127.0.0.1:0"
		cfg.XDS.Authenticator = nobodyAuthenticator{}
		cfg.Tier.Owners = newFakeOwners("127.0.0.1:1", true)
		return cfg
	}
	for _, tc := range []struct {
		name    string
		mod     func(*Config)
		refused bool
	}{
		{"peer port without mTLS", func(c *Config) { c.Tier.Listen = "127.0.0.1:0" }, true},
		{"relays dialling the plaintext xDS port, with the peer secret", func(c *Config) { c.Tier.Secret = []byte("s") }, true},
		{"peer port with mTLS", func(c *Config) {
			c.Tier.Listen, c.Tier.TLS = "127.0.0.1:0", &tls.Config{MinVersion: tls.VersionTLS12}
		}, false},
		{"without mTLS, for development", func(c *Config) { c.Tier.InsecureForDevelopment = true }, false},
		{"a relay alone", func(c *Config) { c.Tier.Owners = nil }, false},
		{"a tier whose xDS port authenticates no one", func(c *Config) {
			c.XDS.Authenticator, c.XDS.TLS = nil, nil
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base()
			tc.mod(&cfg)
			_, err := New(cfg)
			switch {
			case tc.refused && (err == nil || !strings.Contains(err.Error(), "Tier.TLS") || !strings.Contains(err.Error(), "--insecure-tier-for-development")):
				t.Fatalf("New: %v, want a refusal that names Tier.TLS and the development flag", err)
			case !tc.refused && err != nil:
				t.Fatalf("New: %v, want a relay", err)
			}
		})
	}
}

// A relay let into a tier without mTLS for development says so on
// /healthz, and what WarnInsecure records too.
func TestInsecureTierOnHealthz(t *testing.T) {
	e := newSecureEnv(t, auth.ModeAny, func(c *Config) {
		c.Tier.Owners = newFakeOwners("127.0.0.1:1", true)
		c.Tier.InsecureForDevelopment = true
		c.Admin.Listen = "127.0.0.1:0"
	})
	resp, err := http.Get("http://" + e.r.AdminAddr().String() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := "WARNING: INSECURE: relay-to-relay traffic without mTLS"; !strings.Contains(string(body), want) {
		t.Fatalf("/healthz says:\n%s\nwant %q", body, want)
	}
}

// What leaves a relay open is said again every minute, and nothing when
// nothing does.
func TestInsecureSaidEveryMinute(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var buf bytes.Buffer
		r := &Relay{log: slog.New(slog.NewTextHandler(&lockedWriter{mu: &mu, w: &buf}, nil))}
		r.WarnInsecure("gossip without a key")
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			r.warnInsecure(ctx)
		}()
		time.Sleep(3*insecureEvery - time.Second)
		synctest.Wait()
		cancel()
		<-done
		mu.Lock()
		defer mu.Unlock()
		if n := strings.Count(buf.String(), "gossip without a key"); n != 2 {
			t.Fatalf("said %d times in 3 minutes less a second, want 2 (Start says it first):\n%s", n, buf.String())
		}

		quiet := &Relay{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
		returned := make(chan struct{})
		go func() {
			defer close(returned)
			quiet.warnInsecure(context.Background()) // nothing to say: returns at once
		}()
		synctest.Wait()
		select {
		case <-returned:
		default:
			t.Fatal("warnInsecure of a relay with nothing open is still running")
		}
	})
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
