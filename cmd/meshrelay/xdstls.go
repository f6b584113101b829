package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"

	"github.com/spf13/pflag"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

// xdsTLSFlags configure the TLS xDS port (istiod's 15012) and how it
// proves who each stream is.
type xdsTLSFlags struct {
	certFile, keyFile, clientCA string
	authMode, trustDomain       string
	verifier                    string
	issuer, jwksFile, jwksURL   string
	audiences                   string
	kubeconfig                  string

	// The verifiers apply built, for the admin API (adminAuthenticator).
	certs  *auth.CertVerifier
	tokens auth.TokenVerifier
}

func (x *xdsTLSFlags) register(fs *pflag.FlagSet, cfg *relay.Config) {
	fs.StringVar(&cfg.XDS.TLSListen, "xds-tls-listen", cfg.XDS.TLSListen, "address of the TLS ADS server (istiod's 15012); open when --xds-tls-cert is set")
	fs.StringVar(&x.certFile, "xds-tls-cert", "", "PEM certificate chain the TLS xDS port serves (a name the mesh trusts: ISTIOD_SAN); read again when it changes")
	fs.StringVar(&x.keyFile, "xds-tls-key", "", "PEM key of --xds-tls-cert")
	fs.StringVar(&x.clientCA, "xds-client-ca", "", "PEM mesh root: client certificates chained to it prove SPIFFE identities (needed by --xds-auth mtls and any)")
	fs.StringVar(&x.authMode, "xds-auth", "", "how TLS streams prove who they are: none, jwt, mtls or any (default any with --xds-client-ca, else jwt)")
	fs.StringVar(&x.trustDomain, "trust-domain", "cluster.local", "the mesh's SPIFFE trust domain")
	fs.StringVar(&x.verifier, "jwt-verifier", "tokenreview", "how service-account tokens are verified: tokenreview (the Kubernetes API: in-cluster config, or --kubeconfig; verdicts cached) or local (signature against --jwt-jwks-file, --jwt-jwks-url, or else the key set --jwt-issuer's OIDC discovery document names)")
	fs.StringVar(&x.kubeconfig, "kubeconfig", "", "kubeconfig file of the Kubernetes API that reviews tokens (--jwt-verifier tokenreview) for a relay outside the cluster (a VM tier, a test); default: the in-cluster config of the pod's ServiceAccount")
	fs.StringVar(&x.issuer, "jwt-issuer", "https://kubernetes.default.svc.cluster.local", "token issuer (the API server's --service-account-issuer), for --jwt-verifier local")
	fs.StringVar(&x.jwksFile, "jwt-jwks-file", "", "JSON Web Key Set of the issuer (kubectl get --raw /openid/v1/jwks), for --jwt-verifier local")
	fs.StringVar(&x.jwksURL, "jwt-jwks-url", "", "URL of the issuer's JSON Web Key Set (in a cluster: https://kubernetes.default.svc/openid/v1/jwks), for --jwt-verifier local")
	fs.StringVar(&x.audiences, "jwt-audiences", "istio-ca", "comma-separated audiences a token must be bound to (istio-agent asks for istio-ca)")
}

// enabled reports whether the TLS port is configured.
func (x *xdsTLSFlags) enabled() bool { return x.certFile != "" || x.keyFile != "" }

// apply loads the serving pair and builds the authenticator into cfg.
func (x *xdsTLSFlags) apply(ctx context.Context, cfg *relay.Config) error {
	if !x.enabled() {
		if x.clientCA != "" || x.authMode != "" {
			return errors.New("--xds-client-ca and --xds-auth need --xds-tls-cert and --xds-tls-key")
		}
		return nil
	}
	if x.certFile == "" || x.keyFile == "" {
		return errors.New("--xds-tls-cert and --xds-tls-key go together")
	}
	pair, err := tlsfiles.LoadKeyPair(x.certFile, x.keyFile)
	if err != nil {
		return fmt.Errorf("--xds-tls-cert, --xds-tls-key: %w", err)
	}
	var roots *tlsfiles.CAPool
	if x.clientCA != "" {
		if roots, err = tlsfiles.LoadCAPool(x.clientCA); err != nil {
			return fmt.Errorf("--xds-client-ca: %w", err)
		}
	}
	// Client certificates are asked for, not verified in the handshake:
	// the authenticator verifies them, so that a bad one is refused with
	// a reason (counted) rather than a failed handshake, and a client
	// with a bad certificate but a good token still gets in, as on istiod.
	cfg.XDS.TLS = tlsfiles.ServerConfig(pair, roots, tls.RequestClientCert)
	mode := auth.Mode(x.authMode)
	if mode == "" {
		mode = auth.ModeJWT
		if roots != nil {
			mode = auth.ModeAny
		}
	}
	if mode, err = auth.ParseMode(string(mode)); err != nil {
		return fmt.Errorf("--xds-auth: %w", err)
	}
	if mode == auth.ModeNone {
		return nil
	}
	var certs *auth.CertVerifier
	if mode == auth.ModeMTLS || mode == auth.ModeAny {
		if roots == nil {
			return fmt.Errorf("--xds-auth %s needs --xds-client-ca (the mesh root)", mode)
		}
		certs = &auth.CertVerifier{TrustDomain: x.trustDomain, Roots: roots.Certificates}
	}
	var tokens auth.TokenVerifier
	if mode == auth.ModeJWT || mode == auth.ModeAny {
		if tokens, err = x.tokenVerifier(ctx); err != nil {
			return err
		}
	}
	x.certs, x.tokens = certs, tokens
	cfg.XDS.Authenticator, err = auth.NewAuthenticator(mode, certs, tokens)
	return err
}

// adminAuthenticator proves admin API callers with the verifiers the TLS
// xDS port built: a SPIFFE client certificate or a service-account token,
// whichever of them the port takes. Nil if it takes neither.
func (x *xdsTLSFlags) adminAuthenticator() (relay.Authenticator, error) {
	mode := auth.ModeAny
	switch {
	case x.certs == nil && x.tokens == nil:
		return nil, nil
	case x.certs == nil:
		mode = auth.ModeJWT
	case x.tokens == nil:
		mode = auth.ModeMTLS
	}
	return auth.NewAuthenticator(mode, x.certs, x.tokens)
}

func (x *xdsTLSFlags) tokenVerifier(ctx context.Context) (auth.TokenVerifier, error) {
	var auds []string
	for a := range strings.SplitSeq(x.audiences, ",") {
		if a = strings.TrimSpace(a); a != "" {
			auds = append(auds, a)
		}
	}
	switch x.verifier {
	case "tokenreview":
		kc, err := x.kubeAPI()
		if err != nil {
			return nil, err
		}
		// client-go's default of 5 requests a second would throttle the
		// reviews of a reconnect storm far below the admission rate.
		kc.QPS, kc.Burst = 100, 200
		client, err := kubernetes.NewForConfig(kc)
		if err != nil {
			return nil, fmt.Errorf("--jwt-verifier tokenreview: %w", err)
		}
		tc := auth.DefaultTokenReviewConfig()
		tc.Client, tc.Audiences, tc.TrustDomain = client, auds, x.trustDomain
		return auth.NewTokenReview(tc)
	case "local":
		lc := auth.DefaultLocalConfig()
		lc.Issuer, lc.Audiences, lc.TrustDomain = x.issuer, auds, x.trustDomain
		switch {
		case x.jwksFile != "" && x.jwksURL != "":
			return nil, errors.New("--jwt-jwks-file and --jwt-jwks-url: give one")
		case x.jwksFile != "":
			lc.Keys = auth.KeysFromFile(x.jwksFile)
		case x.jwksURL != "":
			client, err := inClusterHTTPClient(x.jwksURL)
			if err != nil {
				return nil, err
			}
			lc.Keys = auth.KeysFromURL(x.jwksURL, client)
		default:
			// The issuer's OIDC discovery document names its key set
			// (the API server serves both).
			client, err := inClusterHTTPClient(x.issuer)
			if err != nil {
				return nil, err
			}
			lc.Keys = auth.KeysFromDiscovery(x.issuer, client)
		}
		v, err := auth.NewLocal(ctx, lc)
		if err != nil {
			return nil, fmt.Errorf("--jwt-verifier local: %w", err)
		}
		return v, nil
	}
	return nil, fmt.Errorf("--jwt-verifier %q: want tokenreview or local", x.verifier)
}

// Where a pod finds the API server's CA and its own token.
const (
	saCAFile    = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
	saTokenFile = "/var/run/secrets/kubernetes.io/serviceaccount/token"
)

// inClusterHTTPClient is an HTTP client for the API server's JWKS, at
// the host of the configured URL: when run in a pod, it trusts the cluster
// CA there and sends the pod's token (the endpoint needs the
// service-account-issuer-discovery role); else the default client.
func inClusterHTTPClient(configured string) (*http.Client, error) {
	u, err := url.Parse(configured)
	if err != nil {
		return nil, err
	}
	ca, err := os.ReadFile(saCAFile)
	if errors.Is(err, os.ErrNotExist) {
		return http.DefaultClient, nil
	}
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("%s: no PEM certificate", saCAFile)
	}
	return &http.Client{Transport: &bearerTransport{
		host:      u.Host,
		cluster:   &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}},
		other:     http.DefaultTransport,
		tokenFile: saTokenFile,
	}}, nil
}

// bearerTransport sends the pod's token, read at each request (kubelet
// rotates it), only over HTTPS to host, through cluster; any other request
// (plain HTTP, a key set or a redirect elsewhere) goes through other
// without it, so the token never leaves in clear text or to another party.
type bearerTransport struct {
	host      string
	cluster   http.RoundTripper
	other     http.RoundTripper
	tokenFile string
}

func (b *bearerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "https" || req.URL.Host != b.host {
		return b.other.RoundTrip(req)
	}
	tok, err := auth.TokenFile{Path: b.tokenFile, Flag: "the pod's service-account token"}.Token()
	if err != nil {
		return nil, err
	}
	req = req.Clone(req.Context())
	req.Header.Set("Authorization", "Bearer "+tok)
	return b.cluster.RoundTrip(req)
}

// kubeAPI returns the config of the Kubernetes API that reviews tokens:
// --kubeconfig's current context, else the pod's in-cluster config.
func (x *xdsTLSFlags) kubeAPI() (*rest.Config, error) {
	if x.kubeconfig != "" {
		kc, err := clientcmd.BuildConfigFromFlags("", x.kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig: %w", err)
		}
		return kc, nil
	}
	kc, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("--jwt-verifier tokenreview needs the Kubernetes API: %w; outside a cluster give --kubeconfig, or use --jwt-verifier local", err)
	}
	return kc, nil
}
