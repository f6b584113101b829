package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/spf13/pflag"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

// upstreamAuthFlags say how the relay's streams to istiod are
// authenticated.
type upstreamAuthFlags struct {
	mode      string
	caFile    string
	san       string
	tokenFile string
}

// The --upstream-auth modes.
const (
	upstreamPlaintext     = "plaintext"
	upstreamForward       = "forward"
	upstreamRelayIdentity = "relay-identity"
)

func (u *upstreamAuthFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&u.mode, "upstream-auth", "", "how streams to istiod are authenticated: plaintext (istiod's 15010, no credentials), forward (TLS to 15012, each key's stream presenting one of its Envoys' own token), or relay-identity (TLS, the relay's own --upstream-token-file, for an istiod with XDS_AUTH=false). Default: forward when the TLS xDS port verifies tokens (--xds-auth jwt or any), else plaintext")
	fs.StringVar(&u.caFile, "upstream-ca", "", "PEM CAs istiod's serving certificate chains to (the mesh root); default: the system's roots")
	fs.StringVar(&u.san, "upstream-san", "", "name istiod's certificate must carry (ISTIOD_SAN); default: the host of --upstream")
	fs.StringVar(&u.tokenFile, "upstream-token-file", "", "for relay-identity: file holding the relay's token (a projected service-account token), read again at every stream")
}

// apply sets the upstream's transport and credentials in cfg. tokens says
// whether the relay's TLS xDS port verifies service-account tokens
// (--xds-auth jwt or any): forward presents those tokens, so it is the
// default then, and is refused without them (with --xds-auth mtls no
// Envoy's token is verified, and a key's stream would have none to
// present: istiod would refuse it at every retry).
func (u *upstreamAuthFlags) apply(cfg *relay.Config, tokens bool) error {
	mode := u.mode
	if mode == "" {
		mode = upstreamPlaintext
		if tokens {
			mode = upstreamForward
		}
	}
	switch mode {
	case upstreamPlaintext:
		if u.caFile != "" || u.san != "" || u.tokenFile != "" {
			return errors.New("--upstream-ca, --upstream-san and --upstream-token-file need --upstream-auth forward or relay-identity")
		}
		return nil
	case upstreamForward:
		if !tokens {
			return errors.New("--upstream-auth forward presents the tokens Envoys bring to the TLS port: it needs --xds-tls-cert and --xds-auth jwt or any (with --xds-auth mtls, use relay-identity)")
		}
		if u.tokenFile != "" {
			return errors.New("--upstream-token-file is for --upstream-auth relay-identity")
		}
		cfg.Upstream.ForwardCredentials = true
	case upstreamRelayIdentity:
		if u.tokenFile == "" {
			return errors.New("--upstream-auth relay-identity needs --upstream-token-file")
		}
		tf := auth.TokenFile{Path: u.tokenFile, Flag: "--upstream-token-file"}
		if _, err := tf.Token(); err != nil {
			return err
		}
		cfg.Upstream.DialOptions = append(cfg.Upstream.DialOptions, grpc.WithPerRPCCredentials(tf))
	default:
		return fmt.Errorf("--upstream-auth %q: want plaintext, forward or relay-identity", mode)
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: u.san}
	if tc.ServerName == "" {
		host, _, err := net.SplitHostPort(strings.TrimPrefix(cfg.Upstream.Addr, "dns:///"))
		if err != nil {
			host = cfg.Upstream.Addr
		}
		tc.ServerName = host
	}
	if u.caFile != "" {
		roots, err := tlsfiles.LoadCAPool(u.caFile)
		if err != nil {
			return fmt.Errorf("--upstream-ca: %w", err)
		}
		// The root is read again when it rotates; each handshake verifies
		// against the current one (Go's own check would use a fixed pool).
		tc.InsecureSkipVerify = true //nolint:gosec // verified in VerifyConnection against the current roots
		tc.VerifyConnection = func(cs tls.ConnectionState) error {
			return verifyServer(cs, roots, tc.ServerName)
		}
	}
	cfg.Upstream.DialOptions = append(cfg.Upstream.DialOptions, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	return nil
}

// verifyServer verifies a server's chain against the current roots and
// its name.
func verifyServer(cs tls.ConnectionState, roots *tlsfiles.CAPool, name string) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("upstream presented no certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: roots.Pool(), Intermediates: inter, DNSName: name})
	return err
}
