package main

import (
	"context"
	"crypto/tls"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/shard"
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
	if cfg.Admin.TLS == nil || cfg.Admin.TLS.GetConfigForClient == nil {
		t.Fatalf("Admin.TLS = %+v, want a config that reads the files at each handshake", cfg.Admin.TLS)
	}
	hs, err := cfg.Admin.TLS.GetConfigForClient(&tls.ClientHelloInfo{})
	if err != nil || len(hs.Certificates) != 1 || hs.ClientAuth != tls.RequireAndVerifyClientCert || hs.ClientCAs == nil ||
		!slices.Equal(hs.NextProtos, []string{"h2", "http/1.1"}) {
		t.Errorf("a handshake's config = %+v, %v; want a certificate, required client certificates, ALPN h2 and http/1.1", hs, err)
	}
	if cfg.Admin.Token != "tok" {
		t.Errorf("Admin.Token = %q, want the file's token, trimmed", cfg.Admin.Token)
	}
	empty := filepath.Join(t.TempDir(), "empty")
	os.WriteFile(empty, []byte("\n"), 0o600)
	a.tokenFile = empty
	if err := a.apply(&relay.Config{}); err == nil {
		t.Error("an empty token file was accepted")
	}
}

func TestAdminIdentitiesFlags(t *testing.T) {
	certs := shardtest.NewCerts(t)
	withTLS := func(ids string) adminFlags {
		return adminFlags{certFile: certs.ClientCertFile, keyFile: certs.ClientKeyFile, identities: ids}
	}
	authn := relay.Authenticator(&auth.Authenticator{})
	for _, tc := range []struct {
		name  string
		flags adminFlags
		authn relay.Authenticator
		want  []string
		err   string
	}{
		{"none", withTLS(""), authn, nil, ""},
		{"two", withTLS(" spiffe://cluster.local/ns/istio-system/sa/istioctl, ,spiffe://td.example/ns/ops/sa/oncall "), authn,
			[]string{"spiffe://cluster.local/ns/istio-system/sa/istioctl", "spiffe://td.example/ns/ops/sa/oncall"}, ""},
		{"not a SPIFFE ID", withTLS("istioctl"), authn, nil, `--admin-identities: "istioctl"`},
		{"not a workload", withTLS("spiffe://cluster.local/ns/istio-system"), authn, nil, "--admin-identities"},
		{"not as written", withTLS("spiffe://Cluster.Local/ns/a/sa/b"), authn, nil, "--admin-identities"},
		{"no TLS", adminFlags{identities: "spiffe://cluster.local/ns/a/sa/b"}, authn, nil, "needs --admin-tls-cert"},
		{"no xDS authenticator", withTLS("spiffe://cluster.local/ns/a/sa/b"), nil, nil, "needs --xds-tls-cert"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var cfg relay.Config
			err := tc.flags.apply(&cfg)
			if err == nil {
				err = tc.flags.applyIdentities(&cfg, tc.authn)
			}
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("apply = %v, want an error containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(cfg.Admin.Identities, tc.want) {
				t.Errorf("Admin.Identities = %q, want %q", cfg.Admin.Identities, tc.want)
			}
			if wantAuthn := len(tc.want) > 0; (cfg.Admin.Authenticator != nil) != wantAuthn || wantAuthn && cfg.Admin.Authenticator != tc.authn {
				t.Errorf("Admin.Authenticator = %v, want the xDS port's: %v", cfg.Admin.Authenticator, wantAuthn)
			}
		})
	}
}

// TestAdminIdentitiesServe: a relay configured by the serve flags (the
// TLS xDS port with a local JWT verifier, admin TLS, --admin-identities)
// takes service-account tokens on its admin listener: the admin's makes
// an admin (pprof answered), another proves a caller of its namespace
// (the admin API answers, pprof is forbidden), none is Unauthenticated.
func TestAdminIdentitiesServe(t *testing.T) {
	const adminID = "spiffe://cluster.local/ns/istio-system/sa/istioctl"
	mesh, issuer := authtest.NewCA(t, "mesh root"), authtest.NewIssuer(t)
	xdsCert, xdsKey := mesh.Serving(t).Write(t, "")
	adminCert, adminKey := mesh.Serving(t).Write(t, "")
	cfg := relay.DefaultConfig()
	fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	var admin adminFlags
	admin.register(fs)
	var x xdsTLSFlags
	x.register(fs, &cfg)
	if err := fs.Parse([]string{"--xds-tls-cert", xdsCert, "--xds-tls-key", xdsKey, "--xds-client-ca", mesh.WriteRoot(t), "--xds-tls-listen", "127.0.0.1:0",
		"--jwt-verifier", "local", "--jwt-jwks-file", issuer.WriteJWKS(t),
		"--admin-tls-cert", adminCert, "--admin-tls-key", adminKey, "--admin-identities", adminID}); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := admin.apply(&cfg); err != nil {
		t.Fatal(err)
	}
	if err := x.apply(ctx, &cfg); err != nil {
		t.Fatal(err)
	}
	// What serve must do once both are applied.
	if err := admin.applyIdentities(&cfg, cfg.XDS.Authenticator); err != nil {
		t.Fatal(err)
	}
	cfg.Upstream.Addr, cfg.XDS.Listen, cfg.Admin.Listen = "127.0.0.1:1", "", "127.0.0.1:0"
	node, err := shard.NewNode(shard.NodeConfig{Relay: cfg})
	if err != nil {
		t.Fatal(err)
	}
	if err := node.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { node.Stop(context.Background()) })
	r := node.Relay()

	tc := &tls.Config{RootCAs: mesh.Pool(), MinVersion: tls.VersionTLS12}
	conn, err := grpc.NewClient(r.AdminAddr().String(), grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: tc}, Timeout: 10 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)
	for _, c := range []struct {
		name  string
		token string
		code  codes.Code
		pprof int
	}{
		{"admin", issuer.Sign(t, authtest.Token{Namespace: "istio-system", ServiceAccount: "istioctl"}), codes.OK, http.StatusOK},
		{"ns1", issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"}), codes.OK, http.StatusForbidden},
		{"nothing", "", codes.Unauthenticated, http.StatusUnauthorized},
	} {
		t.Run(c.name, func(t *testing.T) {
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			if c.token != "" {
				cctx = metadata.AppendToOutgoingContext(cctx, "authorization", "Bearer "+c.token)
			}
			st, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(cctx)
			if err == nil {
				// A Send to a stream the server already refused returns
				// io.EOF; the refusal is Recv's.
				_ = st.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}})
				_, err = st.Recv()
			}
			if status.Code(err) != c.code {
				t.Errorf("reflection: %v, want %s", err, c.code)
			}
			req, _ := http.NewRequestWithContext(cctx, http.MethodGet, "https://"+r.AdminAddr().String()+"/debug/pprof/", nil)
			if c.token != "" {
				req.Header.Set("Authorization", "Bearer "+c.token)
			}
			resp, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != c.pprof {
				t.Errorf("GET /debug/pprof/: %d, want %d", resp.StatusCode, c.pprof)
			}
		})
	}
}
