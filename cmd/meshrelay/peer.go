package main

import (
	"crypto/tls"
	"errors"
	"fmt"
	"os"

	"github.com/spf13/pflag"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

// peerFlags configure the port the tier's relays talk to each other on.
type peerFlags struct {
	advertise                 string
	certFile, keyFile, caFile string
	identity                  string
}

func (p *peerFlags) register(fs *pflag.FlagSet, cfg *relay.Config) {
	fs.StringVar(&cfg.Tier.Listen, "peer-listen", "", "address of the port the tier's relays dial (relay-to-relay ADS, ledger, inspect), e.g. :15011; empty: they use --xds-listen")
	fs.StringVar(&p.advertise, "advertise-peer", "", "host:port other relays dial for --peer-listen (default: $POD_IP with its port)")
	fs.StringVar(&p.certFile, "peer-tls-cert", "", "PEM certificate of the tier (SPIFFE ID --peer-identity) relays present to each other: mTLS on --peer-listen; read again when it changes")
	fs.StringVar(&p.keyFile, "peer-tls-key", "", "PEM key of --peer-tls-cert")
	fs.StringVar(&p.caFile, "peer-tls-ca", "", "PEM CAs the tier's certificates chain to")
	fs.StringVar(&p.identity, "peer-identity", "", "SPIFFE ID every relay's certificate must carry (default spiffe://<--trust-domain>/ns/$POD_NAMESPACE/sa/meshrelay)")
}

// apply builds the peer port's mTLS into cfg; trustDomain defaults the
// identity.
func (p *peerFlags) apply(cfg *relay.Config, trustDomain string) error {
	if p.certFile == "" && p.keyFile == "" && p.caFile == "" {
		if p.identity != "" {
			return errors.New("--peer-identity needs --peer-tls-cert, --peer-tls-key and --peer-tls-ca")
		}
		return nil
	}
	if p.certFile == "" || p.keyFile == "" || p.caFile == "" {
		return errors.New("--peer-tls-cert, --peer-tls-key and --peer-tls-ca go together")
	}
	if cfg.Tier.Listen == "" {
		return errors.New("--peer-tls-cert needs --peer-listen: relay-to-relay mTLS has a port of its own")
	}
	pair, err := tlsfiles.LoadKeyPair(p.certFile, p.keyFile)
	if err != nil {
		return fmt.Errorf("--peer-tls-cert, --peer-tls-key: %w", err)
	}
	roots, err := tlsfiles.LoadCAPool(p.caFile)
	if err != nil {
		return fmt.Errorf("--peer-tls-ca: %w", err)
	}
	id := p.identity
	if id == "" {
		ns := os.Getenv("POD_NAMESPACE")
		if ns == "" {
			ns = "istio-system"
		}
		id = "spiffe://" + trustDomain + "/ns/" + ns + "/sa/meshrelay"
	}
	server, client, err := auth.PeerTLS(pair, roots, id)
	if err != nil {
		return fmt.Errorf("--peer-identity: %w", err)
	}
	cfg.Tier.TLS = server
	cfg.Tier.DialOptions = append(cfg.Tier.DialOptions, grpcTLS(client))
	return nil
}

func grpcTLS(tc *tls.Config) grpc.DialOption {
	return grpc.WithTransportCredentials(credentials.NewTLS(tc))
}
