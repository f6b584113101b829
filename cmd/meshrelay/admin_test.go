package main

import (
	"crypto/tls"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/shard/shardtest"
)

// TestAdminFlagsLoad: the admin flags load a certificate, the client CAs
// (mTLS) and the token into the relay's config.
func TestAdminFlagsLoad(t *testing.T) {
	certs := shardtest.NewCerts(t)
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte("  tok\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// Any pair the CA signed serves: the client's.
	a := adminFlags{certFile: certs.ClientCertFile, keyFile: certs.ClientKeyFile, clientCA: certs.CAFile, tokenFile: tokenFile}
	var cfg relay.Config
	if err := a.apply(&cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.AdminTLS == nil || cfg.AdminTLS.GetConfigForClient == nil {
		t.Fatalf("AdminTLS = %+v, want a config that reads the files at each handshake", cfg.AdminTLS)
	}
	hs, err := cfg.AdminTLS.GetConfigForClient(&tls.ClientHelloInfo{})
	if err != nil || len(hs.Certificates) != 1 || hs.ClientAuth != tls.RequireAndVerifyClientCert || hs.ClientCAs == nil ||
		!slices.Equal(hs.NextProtos, []string{"h2", "http/1.1"}) {
		t.Errorf("a handshake's config = %+v, %v; want a certificate, required client certificates, ALPN h2 and http/1.1", hs, err)
	}
	if cfg.AdminToken != "tok" {
		t.Errorf("AdminToken = %q, want the file's token, trimmed", cfg.AdminToken)
	}
	empty := filepath.Join(t.TempDir(), "empty")
	os.WriteFile(empty, []byte("\n"), 0o600)
	a.tokenFile = empty
	if err := a.apply(&relay.Config{}); err == nil {
		t.Error("an empty token file was accepted")
	}
}
