package main

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"

	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// TestTokenReviewByKubeconfig: --kubeconfig points the TokenReview verifier
// at a Kubernetes API outside the pod (a VM tier, a test): the reviews go
// to the kubeconfig's server, over its CA, with its credentials, and a
// sidecar's token is verified by them. The API here answers TokenReviews
// by the issuer's keys, as kube-apiserver does; the real one runs in the
// Istio end-to-end suite.
func TestTokenReviewByKubeconfig(t *testing.T) {
	mesh, issuer := authtest.NewCA(t, "mesh root"), authtest.NewIssuer(t)
	lcfg := auth.DefaultLocalConfig()
	lcfg.Issuer, lcfg.Keys = issuer.URL, auth.KeysFromFile(issuer.WriteJWKS(t))
	keys, err := auth.NewLocal(context.Background(), lcfg)
	if err != nil {
		t.Fatal(err)
	}
	scheme := runtime.NewScheme()
	if err := authenticationv1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	codecs := serializer.NewCodecFactory(scheme)
	const reviewer = "reviewer-token"
	var reviews atomic.Int32
	api := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/apis/authentication.k8s.io/v1/tokenreviews" || r.Header.Get("Authorization") != "Bearer "+reviewer {
			http.Error(w, "forbidden", http.StatusForbidden)
			return
		}
		// client-go sends protobuf (and takes JSON back), as to kube-apiserver.
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var tr authenticationv1.TokenReview
		if _, _, err := codecs.UniversalDeserializer().Decode(body, nil, &tr); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		reviews.Add(1)
		if id, err := keys.VerifyToken(r.Context(), tr.Spec.Token); err == nil {
			tr.Status = authenticationv1.TokenReviewStatus{Authenticated: true, Audiences: tr.Spec.Audiences, User: authenticationv1.UserInfo{
				Username: fmt.Sprintf("system:serviceaccount:%s:%s", id.Namespace, id.ServiceAccount),
				Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + id.Namespace, "system:authenticated"},
			}}
		}
		tr.APIVersion, tr.Kind = "authentication.k8s.io/v1", "TokenReview"
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(&tr)
	}))
	api.TLS = &tls.Config{Certificates: []tls.Certificate{mesh.Serving(t, "127.0.0.1").TLS}, MinVersion: tls.VersionTLS12}
	api.StartTLS()
	defer api.Close()
	rootPEM, err := os.ReadFile(mesh.WriteRoot(t))
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, fmt.Appendf(nil, `apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {server: %q, certificate-authority-data: %s}
users:
- name: reviewer
  user: {token: %s}
contexts:
- name: test
  context: {cluster: test, user: reviewer}
current-context: test
`, api.URL, base64.StdEncoding.EncodeToString(rootPEM), reviewer), 0o600); err != nil {
		t.Fatal(err)
	}

	x := &xdsTLSFlags{verifier: "tokenreview", kubeconfig: kubeconfig, audiences: "istio-ca", trustDomain: "cluster.local"}
	v, err := x.tokenVerifier(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	id, err := v.VerifyToken(context.Background(), issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"}))
	if err != nil || id.Namespace != "ns1" || id.ServiceAccount != "app" {
		t.Fatalf("a sidecar's token reviewed through --kubeconfig: %+v, %v; want ns1/app", id, err)
	}
	stranger := authtest.NewIssuer(t).Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})
	if _, err := v.VerifyToken(context.Background(), stranger); err == nil {
		t.Fatal("a token the API does not authenticate was taken")
	}
	if n := reviews.Load(); n != 2 {
		t.Fatalf("the API reviewed %d tokens, want 2", n)
	}

	x.kubeconfig = filepath.Join(t.TempDir(), "missing")
	if _, err := x.tokenVerifier(context.Background()); err == nil {
		t.Fatal("a missing --kubeconfig was taken")
	}
}
