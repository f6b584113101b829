package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/spf13/pflag"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshrelay/meshrelay/relay/snapshot"
)

// etcdFlags are serve's persistence flags.
type etcdFlags struct {
	mode         string
	endpoints    string
	dataDir      string
	listen       string
	listenCert   string
	listenKey    string
	listenCA     string
	prefix       string
	caFile       string
	certFile     string
	keyFile      string
	user         string
	passwordFile string
	sealKeyFile  string
}

func (f *etcdFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.mode, "etcd", "", `snapshot persistence: "" (none: the relay starts cold), "embedded" (an in-process etcd, for one machine), or "external" (--etcd-endpoints)`)
	fs.StringVar(&f.endpoints, "etcd-endpoints", "", "comma-separated etcd client URLs (implies --etcd external)")
	fs.StringVar(&f.dataDir, "etcd-data-dir", "meshrelay.etcd", "data directory of the embedded etcd")
	fs.StringVar(&f.listen, "etcd-listen", "", "TCP host:port on which the embedded etcd also serves other clients, over TLS with client certificates only (needs --etcd-listen-cert-file, --etcd-listen-key-file, --etcd-listen-client-ca-file); empty: none, the relay uses a unix socket in --etcd-data-dir private to its user")
	fs.StringVar(&f.listenCert, "etcd-listen-cert-file", "", "serving certificate of the embedded etcd on --etcd-listen")
	fs.StringVar(&f.listenKey, "etcd-listen-key-file", "", "key of --etcd-listen-cert-file")
	fs.StringVar(&f.listenCA, "etcd-listen-client-ca-file", "", "CA bundle whose certificates the embedded etcd's clients on --etcd-listen must present")
	fs.StringVar(&f.prefix, "etcd-prefix", "/meshrelay/", "etcd key prefix; the --cluster name is appended")
	fs.StringVar(&f.caFile, "etcd-ca-file", "", "CA bundle that signs the etcd servers' certificates (enables TLS)")
	fs.StringVar(&f.certFile, "etcd-cert-file", "", "client certificate for etcd (with --etcd-key-file)")
	fs.StringVar(&f.keyFile, "etcd-key-file", "", "client key for etcd")
	fs.StringVar(&f.user, "etcd-user", "", "etcd user name (with --etcd-password-file)")
	fs.StringVar(&f.passwordFile, "etcd-password-file", "", "file holding the etcd user's password")
	fs.StringVar(&f.sealKeyFile, "snapshot-seal-key-file", "", "file holding a base64 32-byte key that encrypts in etcd every resource that sets a field Envoy marks sensitive (Secrets, inline TLS keys, …) (head -c32 /dev/urandom | base64); without it those are not persisted, nor a key's view of their type")
}

// open builds the store the flags ask for, or returns nil if none. The
// returned close function stops the embedded etcd, if any, after the store.
func (f *etcdFlags) open(ctx context.Context, id, cluster string, log *slog.Logger, reg prometheus.Registerer) (*snapshot.Store, func(), error) {
	noop := func() {}
	if f.endpoints != "" && f.mode == "" {
		f.mode = "external"
	}
	cfg := snapshot.DefaultConfig()
	var embedded *snapshot.Embedded
	switch f.mode {
	case "":
		return nil, noop, nil
	case "embedded":
		if f.endpoints != "" {
			return nil, noop, errors.New("--etcd embedded and --etcd-endpoints exclude each other")
		}
		ec := snapshot.EmbeddedConfig{Dir: f.dataDir}
		if f.listen != "" {
			if f.listenCert == "" || f.listenKey == "" || f.listenCA == "" {
				return nil, noop, fmt.Errorf("--etcd-listen %s: the embedded etcd serves TCP clients only over TLS with client certificates: set --etcd-listen-cert-file, --etcd-listen-key-file and --etcd-listen-client-ca-file, or drop --etcd-listen (the relay reaches its etcd on a unix socket in --etcd-data-dir)", f.listen)
			}
			ec.ClientAddr, ec.CertFile, ec.KeyFile, ec.ClientCAFile = f.listen, f.listenCert, f.listenKey, f.listenCA
		}
		var err error
		embedded, err = snapshot.StartEmbedded(ctx, ec)
		if err != nil {
			return nil, noop, err
		}
		cfg.Endpoints = embedded.Endpoints()
		log.Info("embedded etcd started", "dir", f.dataDir, "endpoints", strings.Join(cfg.Endpoints, ","), "tls_endpoint", embedded.TLSEndpoint())
	case "external":
		if f.endpoints == "" {
			return nil, noop, errors.New("--etcd external needs --etcd-endpoints")
		}
		if f.listen != "" {
			return nil, noop, errors.New("--etcd-listen configures the embedded etcd (--etcd embedded), not an external one")
		}
		cfg.Endpoints = strings.Split(f.endpoints, ",")
		var err error
		if cfg.TLS, err = f.tlsConfig(); err != nil {
			return nil, noop, err
		}
		if f.user != "" {
			pw, err := os.ReadFile(f.passwordFile)
			if err != nil {
				return nil, noop, fmt.Errorf("--etcd-password-file: %w", err)
			}
			cfg.Username, cfg.Password = f.user, strings.TrimSpace(string(pw))
		}
	default:
		return nil, noop, fmt.Errorf("--etcd %q: want embedded or external", f.mode)
	}
	closeEmbedded := func() {
		if embedded != nil {
			embedded.Close()
		}
	}
	if f.sealKeyFile != "" {
		var err error
		if cfg.SealKey, err = snapshot.LoadSealKey(f.sealKeyFile); err != nil {
			closeEmbedded()
			return nil, noop, err
		}
	}
	cfg.Prefix, cfg.Cluster, cfg.Logger, cfg.Registerer = f.prefix, cluster, log, reg
	cfg.Member = id + "-" + incarnation()
	s, err := snapshot.New(cfg)
	if err != nil {
		closeEmbedded()
		return nil, noop, err
	}
	return s, closeEmbedded, nil
}

func (f *etcdFlags) tlsConfig() (*tls.Config, error) {
	if f.caFile == "" && f.certFile == "" {
		return nil, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if f.caFile != "" {
		pem, err := os.ReadFile(f.caFile)
		if err != nil {
			return nil, fmt.Errorf("--etcd-ca-file: %w", err)
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--etcd-ca-file %s: no certificate in it", f.caFile)
		}
	}
	if f.certFile != "" || f.keyFile != "" {
		cert, err := tls.LoadX509KeyPair(f.certFile, f.keyFile)
		if err != nil {
			return nil, fmt.Errorf("--etcd-cert-file/--etcd-key-file: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// incarnation tells this process's fence records from an earlier one's.
func incarnation() string {
	b := make([]byte, 4)
	rand.Read(b)
	return hex.EncodeToString(b)
}
