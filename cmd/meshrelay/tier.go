package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/pflag"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/shard"
)

// tierFlags configure the relay's membership of a tier: gossip, joining,
// and the addresses it advertises to the other relays.
type tierFlags struct {
	gossip, gossipAdvertise string
	advertiseXDS            string
	advertiseAdmin          string
	join                    string
	keyFile                 string
	insecureDev             bool
}

func (t *tierFlags) register(fs *pflag.FlagSet, ring *shard.Config) {
	fs.StringVar(&t.gossip, "gossip-listen", ":7946", "address of the gossip (memberlist) listener, TCP and UDP; empty: no tier, this relay owns every key")
	fs.StringVar(&t.gossipAdvertise, "gossip-advertise", "", "host:port other relays gossip to (default: from --gossip-listen; set the pod IP in Kubernetes)")
	fs.StringVar(&t.advertiseXDS, "advertise-xds", "", "host:port other relays dial for this relay's ADS (default: $POD_IP with the --xds-listen port)")
	fs.StringVar(&t.join, "join", "", "comma-separated relays to join: host[:port] or a DNS name with an address per relay (the headless Service)")
	fs.StringVar(&t.keyFile, "gossip-key-file", "", "file holding the tier's gossip key, base64 (openssl rand -base64 32); encrypts gossip and authenticates relay-to-relay streams")
	fs.BoolVar(&t.insecureDev, "insecure-tier-for-development", false, "DEVELOPMENT ONLY: let a relay whose xDS port authenticates join a tier without relay-to-relay mTLS (--peer-tls-cert) or without --gossip-key-file, where whoever reaches those ports is served every key's config; said every minute in the log and on /healthz")
	fs.StringVar(&ring.Cluster, "cluster", ring.Cluster, "tier name: gossip of another name is dropped, so two tiers never merge")
	fs.DurationVar(&ring.RejoinInterval, "rejoin-interval", ring.RejoinInterval, "how often --join is resolved again and absent relays joined (heals partitions)")
	fs.IntVar(&ring.Partitions, "ring-partitions", ring.Partitions, "partitions of the consistent-hash ring")
	fs.Float64Var(&ring.Load, "ring-load", ring.Load, "bounded-load factor of the ring (1 to 10)")
	fs.StringVar(&t.advertiseAdmin, "advertise-admin", "", "host:port relayctl dials for this relay's admin API (default: $POD_IP with the --admin-listen port)")
}

// enabled reports whether the relay joins a tier (--gossip-listen set).
func (t *tierFlags) enabled() bool { return t.gossip != "" }

// apply fills ring for a relay of cfg, if it joins a tier; advertisePeer
// is --advertise-peer.
func (t *tierFlags) apply(ring *shard.Config, cfg relay.Config, advertisePeer string) error {
	if !t.enabled() {
		if t.insecureDev {
			return errors.New("--insecure-tier-for-development needs a tier (--gossip-listen)")
		}
		return nil
	}
	var err error
	if ring.BindAddr, ring.BindPort, err = splitHostPort(t.gossip); err != nil {
		return fmt.Errorf("--gossip-listen: %w", err)
	}
	if t.gossipAdvertise != "" {
		if ring.AdvertiseAddr, ring.AdvertisePort, err = splitHostPort(t.gossipAdvertise); err != nil {
			return fmt.Errorf("--gossip-advertise: %w", err)
		}
	}
	if t.join != "" {
		ring.Join = strings.Split(t.join, ",")
	}
	if t.keyFile != "" {
		if ring.SecretKey, err = shard.LoadKeyFile(t.keyFile); err != nil {
			return err
		}
	}
	switch {
	case cfg.Tier.Listen != "":
		if ring.XDSAddr, err = podAddr(advertisePeer, cfg.Tier.Listen); err != nil {
			return fmt.Errorf("--peer-listen: %w", err)
		}
	case cfg.XDS.Listen != "":
		if ring.XDSAddr, err = podAddr(t.advertiseXDS, cfg.XDS.Listen); err != nil {
			return fmt.Errorf("--xds-listen: %w", err)
		}
	default:
		return errors.New("a tier (--gossip-listen) needs a port its relays dial: --peer-listen (with --peer-tls-cert for mTLS), or --xds-listen")
	}
	if ring.AdminAddr, err = podAddr(t.advertiseAdmin, cfg.Admin.Listen); err != nil {
		return fmt.Errorf("--admin-listen: %w", err)
	}
	return nil
}
