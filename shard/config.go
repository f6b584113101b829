package shard

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
)

// Config configures a Ring. Start from DefaultConfig.
type Config struct {
	// Name is the relay's ID. The memberlist name adds a random suffix, so
	// that a restarted relay is a new member rather than a resurrection of
	// the old one (memberlist refuses a name it still holds as dead for
	// DeadNodeReclaimTime). Required.
	Name string
	// XDSAddr is the address the tier's other relays dial for this
	// relay's ADS, ledger and inspect services (its peer port, or its
	// plaintext xDS port if it has none), host:port. Required.
	XDSAddr string
	// AdminAddr is the address of this relay's admin API, host:port,
	// gossiped so that relayctl finds a relay it names (drain). Default
	// "": not advertised.
	AdminAddr string

	// BindAddr and BindPort are where gossip listens (TCP and UDP).
	// Default 0.0.0.0:7946. Port 0 picks a free one. Ignored with Transport.
	BindAddr string
	BindPort int
	// AdvertiseAddr and AdvertisePort, if set, are what other relays are
	// told to gossip to (the pod IP). Default: derived from the bind
	// address.
	AdvertiseAddr string
	AdvertisePort int

	// Join lists where to find the tier: host:port addresses or DNS names
	// (a headless Service), each resolved to every address it has. A port
	// left out is BindPort. Empty: this relay starts a tier of its own.
	Join []string
	// RejoinInterval is how often the relay resolves Join again and joins
	// every address that is not a live member, so that a partition longer
	// than memberlist's dead-node timeout heals and a tier split by a mass
	// restart finds itself again. Default 15s.
	RejoinInterval time.Duration
	// Resolver resolves the hosts of Join. Default net.DefaultResolver.
	Resolver interface {
		LookupHost(ctx context.Context, host string) ([]string, error)
	}

	// SecretKey, if set, encrypts and authenticates gossip (AES-GCM; 16, 24
	// or 32 bytes). Every relay of a tier needs the same key. See
	// LoadKeyFile. Default: none (plaintext gossip).
	SecretKey []byte
	// Cluster labels every gossip message; a relay drops messages of
	// another label, so that two tiers sharing a network never merge.
	// Default "meshrelay".
	Cluster string

	// Partitions is the number of partitions of the hash ring. Keys hash
	// to partitions; partitions are placed on members. Default 1,009 (see
	// DefaultConfig for the measurements behind it).
	Partitions int
	// Load is the bounded-load factor: no member owns more than
	// ceil(Partitions/members × Load) partitions. 1 to 10. Default 1.25.
	Load float64

	// MetaInterval is how often the relay's connection count is gossiped
	// when it changed. Default 1s.
	MetaInterval time.Duration
	// LeaveTimeout bounds how long Leave waits for the leave message to
	// spread. Default 5s.
	LeaveTimeout time.Duration

	// Gossip selects memberlist's timing profile: "lan" (the default:
	// probes every second, dead after a few seconds of silence) or "local"
	// (tighter, for tests and a single machine).
	Gossip string
	// Transport, if set, carries gossip instead of UDP and TCP sockets
	// (tests use an in-memory network, see shardtest).
	Transport memberlist.Transport

	// Registerer, if set, receives the ring's metrics
	// (meshrelay_ring_members). Default: none.
	Registerer prometheus.Registerer
	// Logger receives structured logs, memberlist's included. Default:
	// discard.
	Logger *slog.Logger
}

// DefaultConfig returns a Config with every default filled in but Name and
// XDSAddr.
//
// Partitions 1,009 and Load 1.25 come from measuring, for tiers of 3 to 50
// relays and 1,000 keys, how many keys move when one relay is added, as a
// multiple of the ideal 1/(n+1) (TestMovedFraction logs it; worst / mean):
//
//	partitions  load 1.10    load 1.25    load 1.50
//	       271  8.00 / 1.76  4.31 / 1.32  1.89 / 1.03
//	     1,009  2.45 / 1.50  1.93 / 1.21  2.00 / 1.10
//	     4,099  2.54 / 1.44  2.06 / 1.17  1.89 / 1.09
//
// consistent's default of 271 partitions leaves too few per relay past 20
// relays: one more relay then moves over 4× its share. 1,009 (prime) stays
// under 2× everywhere; more partitions buy nothing. Load 1.25 caps the
// busiest relay at a quarter over its share; 1.5 moves slightly fewer keys
// on average but lets one relay hold half again its share of upstream
// streams.
func DefaultConfig() Config {
	return Config{
		BindAddr:       "0.0.0.0",
		BindPort:       7946,
		RejoinInterval: 15 * time.Second,
		Resolver:       net.DefaultResolver,
		Cluster:        "meshrelay",
		Partitions:     1009,
		Load:           1.25,
		MetaInterval:   time.Second,
		LeaveTimeout:   5 * time.Second,
		Gossip:         "lan",
		Logger:         slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

func (cfg *Config) validate() error {
	var errs []error
	bad := func(field, why string) { errs = append(errs, fmt.Errorf("shard: field %s %s", field, why)) }
	if cfg.Name == "" {
		bad("Name", "is empty")
	}
	if err := checkAddr("xDS", cfg.XDSAddr); err != nil {
		bad("XDSAddr", err.Error())
	}
	if err := checkAddr("admin", cfg.AdminAddr); cfg.AdminAddr != "" && err != nil {
		bad("AdminAddr", err.Error())
	}
	if cfg.Transport == nil && (cfg.BindPort < 0 || cfg.BindPort > 65535) {
		bad("BindPort", fmt.Sprintf("is %d", cfg.BindPort))
	}
	switch len(cfg.SecretKey) {
	case 0, 16, 24, 32:
	default:
		bad("SecretKey", fmt.Sprintf("is %d bytes, want 16, 24 or 32", len(cfg.SecretKey)))
	}
	if cfg.Cluster == "" {
		bad("Cluster", "is empty")
	}
	if err := validateRing(cfg.Partitions, cfg.Load); err != nil {
		errs = append(errs, err)
	}
	for name, d := range map[string]time.Duration{
		"RejoinInterval": cfg.RejoinInterval, "MetaInterval": cfg.MetaInterval, "LeaveTimeout": cfg.LeaveTimeout,
	} {
		if d <= 0 {
			bad(name, "must be positive")
		}
	}
	if cfg.Gossip != "lan" && cfg.Gossip != "local" {
		bad("Gossip", fmt.Sprintf("is %q, want lan or local", cfg.Gossip))
	}
	if cfg.Resolver == nil {
		cfg.Resolver = net.DefaultResolver
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return errors.Join(errs...)
}

// LoadKeyFile reads a gossip key: 16, 24 or 32 bytes, base64 encoded, as
// `openssl rand -base64 32` writes it (Consul's and Serf's format; a raw
// binary key is refused because 24 or 32 printable bytes are also valid
// base64). The key is never logged.
func LoadKeyFile(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("shard: gossip key: %w", err)
	}
	k, err := base64.StdEncoding.DecodeString(strings.TrimSpace(string(b)))
	if err != nil || !(len(k) == 16 || len(k) == 24 || len(k) == 32) {
		return nil, fmt.Errorf("shard: gossip key %s: want 16, 24 or 32 bytes, base64 encoded (openssl rand -base64 32)", path)
	}
	return k, nil
}
