package main

import (
	"crypto/tls"
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/pflag"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

// adminFlags configure who may use the admin listener.
type adminFlags struct {
	certFile, keyFile, clientCA string
	tokenFile                   string
	identities                  string
	allowMutations              bool
}

func (a *adminFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&a.certFile, "admin-tls-cert", "", "PEM certificate the admin listener serves TLS with (with --admin-tls-key); default: cleartext")
	fs.StringVar(&a.keyFile, "admin-tls-key", "", "PEM key of --admin-tls-cert")
	fs.StringVar(&a.clientCA, "admin-client-ca", "", "PEM CAs whose client certificates the admin listener requires (mTLS; with --admin-identities: verifies when given, so a caller may prove itself with a token instead); needs --admin-tls-cert")
	fs.StringVar(&a.tokenFile, "admin-token-file", "", "file holding a bearer token every admin gRPC call but health, and pprof, must carry; needs --admin-tls-cert")
	fs.StringVar(&a.identities, "admin-identities", "", "comma-separated SPIFFE IDs of admins, e.g. spiffe://cluster.local/ns/istio-system/sa/istioctl. "+
		"With them the admin API also takes callers that prove an identity with the TLS xDS port's verifiers (a service-account token, or a SPIFFE client certificate when --admin-client-ca is the mesh root): "+
		"these are admins, any other identity sees only its own namespace's Envoys, keys and config and may not drain. "+
		"Debug requests (istioctl proxy-status) on the TLS xDS port follow the same rule. Needs --admin-tls-cert and --xds-auth jwt, mtls or any")
	fs.BoolVar(&a.allowMutations, "admin-allow-mutations", false, "let the admin API change the tier (Drain); default: read-only (admins only in any case)")
}

// apply loads the certificates, the token and the admin identities into
// cfg.
func (a *adminFlags) apply(cfg *relay.Config) error {
	ids, err := parseIdentities(a.identities)
	if err != nil {
		return err
	}
	cfg.Admin.Identities = ids
	if (a.certFile == "") != (a.keyFile == "") {
		return errors.New("--admin-tls-cert and --admin-tls-key go together")
	}
	if a.certFile == "" {
		if a.clientCA != "" || a.tokenFile != "" {
			return errors.New("--admin-client-ca and --admin-token-file need --admin-tls-cert: a token or an identity must not cross the network in clear text")
		}
		if len(ids) > 0 {
			return errors.New("--admin-identities needs --admin-tls-cert: a service-account token must not cross the network in clear text")
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
	// With admin identities a caller may prove itself with a token alone
	// (istioctl, relayctl --token-file): client certificates are verified
	// when given, not required.
	clientAuth := tls.RequireAndVerifyClientCert
	if len(ids) > 0 {
		clientAuth = tls.VerifyClientCertIfGiven
	}
	tc := tlsfiles.ServerConfig(pair, cas, clientAuth, "h2", "http/1.1")
	cfg.Admin.TLS = tc
	if a.tokenFile != "" {
		if cfg.Admin.Token, err = (auth.TokenFile{Path: a.tokenFile, Flag: "--admin-token-file"}).Token(); err != nil {
			return err
		}
	}
	return nil
}

// parseIdentities parses --admin-identities: SPIFFE IDs of Istio workloads
// (spiffe://<trust domain>/ns/<namespace>/sa/<service account>), comma
// separated, each as the identities callers prove are written.
func parseIdentities(s string) ([]string, error) {
	var ids []string
	for v := range strings.SplitSeq(s, ",") {
		if v = strings.TrimSpace(v); v == "" {
			continue
		}
		id, err := auth.ParseSPIFFEID(v)
		if err != nil {
			return nil, fmt.Errorf("--admin-identities: %q: %w", v, err)
		}
		if id.SPIFFEID() != v {
			return nil, fmt.Errorf("--admin-identities: %q: write it as %s", v, id.SPIFFEID())
		}
		ids = append(ids, v)
	}
	return ids, nil
}

// applyIdentities makes the admin API prove its callers with authn (the
// TLS xDS port's authenticator: its token verifier and certificate
// verifier) when --admin-identities names admins; without them the admin
// API is guarded by the token and the client CAs alone, as before. It must
// run once apply and the TLS xDS port's flags are applied.
func (a *adminFlags) applyIdentities(cfg *relay.Config, authn relay.Authenticator) error {
	if len(cfg.Admin.Identities) == 0 {
		return nil
	}
	if cfg.Admin.TLS == nil {
		return errors.New("--admin-identities needs --admin-tls-cert: a service-account token must not cross the network in clear text")
	}
	if authn == nil {
		return errors.New("--admin-identities needs --xds-tls-cert with --xds-auth jwt, mtls or any: the admin API proves its callers with the TLS xDS port's verifiers")
	}
	cfg.Admin.Authenticator = authn
	return nil
}
