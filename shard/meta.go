package shard

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
)

// meta is what each relay gossips about itself, in its memberlist node
// metadata (at most memberlist.MetaMaxSize, 512 bytes).
type meta struct {
	// V is the format version; a relay ignores members of a newer format's
	// fields it does not know, and refuses a format it cannot read.
	V int `json:"v"`
	// XDS is the relay's ADS address for peers.
	XDS string `json:"xds"`
	// Conns is its Envoy stream count.
	Conns int `json:"conns"`
	// Admin is its admin API's address, if it serves one (added in
	// format 1 without a version change: older relays ignore it).
	Admin string `json:"admin,omitempty"`
}

const (
	metaVersion = 1
	metaMaxSize = 512 // memberlist.MetaMaxSize
	maxConns    = 1 << 30
)

func (m meta) encode() ([]byte, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	if len(b) > metaMaxSize {
		return nil, fmt.Errorf("shard: node metadata is %d bytes, over memberlist's %d (xDS address too long?)", len(b), metaMaxSize)
	}
	return b, nil
}

// decodeMeta parses a member's gossiped metadata. It comes from the network:
// anything malformed is an error, never a panic.
func decodeMeta(b []byte) (meta, error) {
	if len(b) == 0 {
		return meta{}, errors.New("shard: member has no metadata (not a meshrelay?)")
	}
	if len(b) > metaMaxSize {
		return meta{}, fmt.Errorf("shard: member metadata is %d bytes, over %d", len(b), metaMaxSize)
	}
	var m meta
	if err := json.Unmarshal(b, &m); err != nil {
		return meta{}, fmt.Errorf("shard: member metadata: %w", err)
	}
	if m.V != metaVersion {
		return meta{}, fmt.Errorf("shard: member metadata format %d, this relay reads %d", m.V, metaVersion)
	}
	if err := checkAddr("xDS", m.XDS); err != nil {
		return meta{}, err
	}
	if err := checkAddr("admin", m.Admin); m.Admin != "" && err != nil {
		return meta{}, err
	}
	if m.Conns < 0 || m.Conns > maxConns {
		return meta{}, fmt.Errorf("shard: member reports %d connections", m.Conns)
	}
	return m, nil
}

// checkAddr accepts host:port with a port in 1-65535 and a non-empty host;
// what names the address in the error.
func checkAddr(what, addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("shard: %s address %q: %w", what, addr, err)
	}
	if host == "" {
		return fmt.Errorf("shard: %s address %q has no host", what, addr)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("shard: %s address %q: bad port", what, addr)
	}
	return nil
}
