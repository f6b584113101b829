package snapshot

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Embedded is an etcd server running in this process: the single-machine
// default (`meshrelay serve --etcd embedded`, `meshrelay demo`) and the
// etcd of the tests. It holds what the store writes (sealed where it must
// be), and answers any client that reaches it, so it is reachable only as
// its data is: by default it listens on a unix socket in its data
// directory (both the directory and the socket private to this user), and
// on no TCP port at all, not even for peers (it is a one-member cluster).
// A TCP client port (EmbeddedConfig.ClientAddr) takes only TLS clients
// that present a certificate from a CA it is given.
type Embedded struct {
	e      *embed.Etcd
	socket string
	tlsURL string
	once   sync.Once
}

// EmbeddedConfig configures StartEmbedded.
type EmbeddedConfig struct {
	// Dir holds etcd's data and its client socket (etcd.sock). Required;
	// it survives restarts, which is the point. It is made, or narrowed,
	// to mode 0700. Its absolute path must leave room for the socket's
	// name within the 107 bytes a unix socket's path may have.
	Dir string
	// ClientAddr, if set, is a TCP host:port the server also listens on
	// for clients from elsewhere ("127.0.0.1:0": any free port, see
	// TLSEndpoint), TLS only: CertFile and KeyFile are its certificate,
	// and a client must present one that ClientCAFile signs. Default ""
	// (the unix socket alone; the relay itself always uses the socket).
	ClientAddr string
	// CertFile, KeyFile and ClientCAFile are PEM files, required with
	// ClientAddr and unused without it.
	CertFile, KeyFile, ClientCAFile string
	// StartTimeout bounds the wait for the server to be ready. Default 30s.
	StartTimeout time.Duration
}

// socketName is the client socket's name in the data directory.
const socketName = "etcd.sock"

// maxSocketPath is the longest path a unix socket may have on Linux
// (sun_path is 108 bytes, one of them the terminating NUL).
const maxSocketPath = 107

// ErrClientCertsRequired is returned by StartEmbedded when it is asked to
// listen on TCP without what it needs to require client certificates.
var ErrClientCertsRequired = errors.New("snapshot: an embedded etcd listens on TCP only with a certificate, its key, and a CA for client certificates")

// StartEmbedded starts an in-process etcd and waits until it serves. Close
// stops it.
func StartEmbedded(ctx context.Context, cfg EmbeddedConfig) (*Embedded, error) {
	if cfg.Dir == "" {
		return nil, errors.New("snapshot: embedded etcd needs a data directory")
	}
	if cfg.ClientAddr != "" && (cfg.CertFile == "" || cfg.KeyFile == "" || cfg.ClientCAFile == "") {
		return nil, fmt.Errorf("%w (listening on %s)", ErrClientCertsRequired, cfg.ClientAddr)
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = 30 * time.Second
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("snapshot: embedded etcd data directory: %w", err)
	}
	socket := filepath.Join(dir, socketName)
	if len(socket) > maxSocketPath {
		return nil, fmt.Errorf("snapshot: embedded etcd socket %s is %d bytes long, over the %d a unix socket's path may have: choose a shorter data directory", socket, len(socket), maxSocketPath)
	}
	// Private to this user: the data and the socket both.
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("snapshot: embedded etcd data directory: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("snapshot: embedded etcd data directory: %w", err)
	}
	ec := embed.NewConfig()
	ec.Name = "meshrelay"
	ec.Dir = dir
	// Its logs would drown the relay's (it logs every listener it closes
	// as an error); the relay reports what matters through the client.
	ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	unix := url.URL{Scheme: "unix", Path: socket}
	ec.ListenClientUrls, ec.AdvertiseClientUrls = []url.URL{unix}, []url.URL{unix}
	if cfg.ClientAddr != "" {
		tcp := url.URL{Scheme: "https", Host: cfg.ClientAddr}
		ec.ListenClientUrls = append(ec.ListenClientUrls, tcp)
		ec.ClientTLSInfo.CertFile, ec.ClientTLSInfo.KeyFile = cfg.CertFile, cfg.KeyFile
		ec.ClientTLSInfo.TrustedCAFile, ec.ClientTLSInfo.ClientCertAuth = cfg.ClientCAFile, true
	}
	// A one-member cluster has no peers to listen for (a peer port would
	// take raft messages from anyone who reaches it); the member's peer
	// URL is a name, never dialled.
	peer := url.URL{Scheme: "unix", Path: filepath.Join(dir, "no-peers")}
	ec.ListenPeerUrls, ec.AdvertisePeerUrls = nil, []url.URL{peer}
	ec.InitialCluster = ec.InitialClusterFromName(ec.Name)
	// History is only needed for a consistent read of a load or a
	// collection pass; keep a few minutes of it.
	ec.AutoCompactionMode = embed.CompactorModePeriodic
	ec.AutoCompactionRetention = "5m"
	e, err := embed.StartEtcd(ec)
	if err != nil {
		return nil, fmt.Errorf("snapshot: start embedded etcd: %w", err)
	}
	em := &Embedded{e: e, socket: socket}
	if err := os.Chmod(socket, 0o600); err != nil {
		e.Close()
		return nil, fmt.Errorf("snapshot: embedded etcd socket: %w", err)
	}
	for _, l := range e.Clients {
		if l.Addr().Network() == "tcp" {
			em.tlsURL = "https://" + l.Addr().String()
		}
	}
	t := time.NewTimer(cfg.StartTimeout)
	defer t.Stop()
	select {
	case <-e.Server.ReadyNotify():
		return em, nil
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

// Endpoints returns the client URLs to give Config.Endpoints: the unix
// socket's.
func (e *Embedded) Endpoints() []string { return []string{"unix://" + e.socket} }

// TLSEndpoint returns the URL of the TCP client port (ClientAddr), "" if
// there is none.
func (e *Embedded) TLSEndpoint() string { return e.tlsURL }

// Close stops the server and waits for it. It is idempotent.
func (e *Embedded) Close() { e.once.Do(e.e.Close) }
