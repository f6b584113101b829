package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"

	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// TestTokenReviewByKubeconfig: --kubeconfig points the TokenReview verifier
// at a Kubernetes API outside the pod (a VM tier, a test): the reviews go
// to the kubeconfig's server, and its verdicts decide. The API here speaks
// kube-apiserver's TokenReview JSON (authtest.KubeAPI); the real one runs
// in the Istio end-to-end suite.
func TestTokenReviewByKubeconfig(t *testing.T) {
	issuer := authtest.NewIssuer(t)
	good := issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})
	other := issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})
	api := authtest.NewKubeAPI(t, func(token string, audiences []string) authenticationv1.TokenReviewStatus {
		if token == good {
			return authtest.ServiceAccount("ns1", "app", audiences...)
		}
		return authtest.Unauthenticated("invalid bearer token")
	})
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, fmt.Appendf(nil, `apiVersion: v1
kind: Config
clusters:
- {name: test, cluster: {server: %q}}
users:
- {name: reviewer, user: {token: reviewer-token}}
contexts:
- {name: test, context: {cluster: test, user: reviewer}}
current-context: test
`, api.URL()), 0o600); err != nil {
		t.Fatal(err)
	}

	x := &xdsTLSFlags{verifier: "tokenreview", kubeconfig: kubeconfig, audiences: "istio-ca", trustDomain: "cluster.local"}
	v, err := x.tokenVerifier(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	id, err := v.VerifyToken(context.Background(), good)
	if err != nil || id.Namespace != "ns1" || id.ServiceAccount != "app" {
		t.Fatalf("a sidecar's token reviewed through --kubeconfig: %+v, %v; want ns1/app", id, err)
	}
	if _, err := v.VerifyToken(context.Background(), other); err == nil {
		t.Fatal("a token the API does not authenticate was taken")
	}

	x.kubeconfig = filepath.Join(t.TempDir(), "missing")
	if _, err := x.tokenVerifier(context.Background()); err == nil {
		t.Fatal("a missing --kubeconfig was taken")
	}
}
