package snapshot

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sync"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Embedded is an etcd server running in this process: the single-machine
// default (`meshrelay serve --etcd embedded`, `meshrelay demo`) and the
// etcd of the tests. It listens on loopback only.
type Embedded struct {
	e    *embed.Etcd
	once sync.Once
}

// EmbeddedConfig configures StartEmbedded.
type EmbeddedConfig struct {
	// Dir holds etcd's data. Required; it survives restarts, which is the
	// point.
	Dir string
	// ClientAddr is the loopback host:port clients connect to. Default
	// "127.0.0.1:0" (any free port; see Endpoints).
	ClientAddr string
	// StartTimeout bounds the wait for the server to be ready. Default 30s.
	StartTimeout time.Duration
}

// StartEmbedded starts an in-process etcd and waits until it serves. Close
// stops it.
func StartEmbedded(ctx context.Context, cfg EmbeddedConfig) (*Embedded, error) {
	if cfg.Dir == "" {
		return nil, errors.New("snapshot: embedded etcd needs a data directory")
	}
	if cfg.ClientAddr == "" {
		cfg.ClientAddr = "127.0.0.1:0"
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = 30 * time.Second
	}
	ec := embed.NewConfig()
	ec.Name = "meshrelay"
	ec.Dir = cfg.Dir
	// Its logs would drown the relay's (it logs every listener it closes
	// as an error); the relay reports what matters through the client.
	ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	client := url.URL{Scheme: "http", Host: cfg.ClientAddr}
	peer := url.URL{Scheme: "http", Host: "127.0.0.1:0"}
	ec.ListenClientUrls, ec.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
	ec.ListenPeerUrls, ec.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
	ec.InitialCluster = ec.InitialClusterFromName(ec.Name)
	// History is only needed for a consistent read of a load or a
	// collection pass; keep a few minutes of it.
	ec.AutoCompactionMode = embed.CompactorModePeriodic
	ec.AutoCompactionRetention = "5m"
	e, err := embed.StartEtcd(ec)
	if err != nil {
		return nil, fmt.Errorf("snapshot: start embedded etcd: %w", err)
	}
	t := time.NewTimer(cfg.StartTimeout)
	defer t.Stop()
	select {
	case <-e.Server.ReadyNotify():
		return &Embedded{e: e}, nil
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("snapshot: embedded etcd: %w", err)
	case <-t.C:
		e.Close()
		return nil, fmt.Errorf("snapshot: embedded etcd not ready after %s", cfg.StartTimeout)
	case <-ctx.Done():
		e.Close()
		return nil, ctx.Err()
	}
}

// Endpoints returns the client URLs to give Config.Endpoints.
func (e *Embedded) Endpoints() []string {
	var out []string
	for _, l := range e.e.Clients {
		out = append(out, "http://"+l.Addr().String())
	}
	return out
}

// Close stops the server and waits for it. It is idempotent.
func (e *Embedded) Close() { e.once.Do(e.e.Close) }
