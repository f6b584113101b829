package main

import (
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

// adminFlags configure who may use the admin listener.
type adminFlags struct {
	certFile, keyFile, clientCA string
	tokenFile                   string
	allowMutations              bool
}

func (a *adminFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&a.certFile, "admin-tls-cert", "", "PEM certificate the admin listener serves TLS with (with --admin-tls-key); default: cleartext")
	fs.StringVar(&a.keyFile, "admin-tls-key", "", "PEM key of --admin-tls-cert")
	fs.StringVar(&a.clientCA, "admin-client-ca", "", "PEM CAs whose client certificates the admin listener requires (mTLS); needs --admin-tls-cert")
	fs.StringVar(&a.tokenFile, "admin-token-file", "", "file holding a bearer token every admin gRPC call but health, and pprof, must carry; needs --admin-tls-cert")
	fs.BoolVar(&a.allowMutations, "admin-allow-mutations", false, "let the admin API change the tier (Drain); default: read-only")
}

// apply loads the certificates and the token into cfg.
func (a *adminFlags) apply(cfg *relay.Config) error {
	if (a.certFile == "") != (a.keyFile == "") {
		return errors.New("--admin-tls-cert and --admin-tls-key go together")
	}
	if a.certFile == "" {
		if a.clientCA != "" || a.tokenFile != "" {
			return errors.New("--admin-client-ca and --admin-token-file need --admin-tls-cert: a token or an identity must not cross the network in clear text")
		}
		return nil
	}
	// Both files are read again when they change (cert-manager, Secret
	// volumes): a handshake gets the current pair, open connections keep
	// theirs.
	pair, err := tlsfiles.LoadKeyPair(a.certFile, a.keyFile)
	if err != nil {
		return fmt.Errorf("--admin-tls-cert, --admin-tls-key: %w", err)
	}
	var cas *tlsfiles.CAPool
	if a.clientCA != "" {
		if cas, err = tlsfiles.LoadCAPool(a.clientCA); err != nil {
			return fmt.Errorf("--admin-client-ca: %w", err)
		}
	}
	tc := tlsfiles.ServerConfig(pair, cas, tls.RequireAndVerifyClientCert, "h2", "http/1.1")
	cfg.AdminTLS = tc
	if a.tokenFile != "" {
		b, err := os.ReadFile(a.tokenFile)
		if err != nil {
			return fmt.Errorf("--admin-token-file: %w", err)
		}
		if cfg.AdminToken = strings.TrimSpace(string(b)); cfg.AdminToken == "" {
			return fmt.Errorf("--admin-token-file %s is empty", a.tokenFile)
		}
	}
	return nil
}
