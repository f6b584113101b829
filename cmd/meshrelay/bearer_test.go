package main

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"testing"
)

// TestBearerTransportOnlyToTheAPIServer: the pod's token goes to the
// configured host over HTTPS, and nowhere else: not over plain HTTP, not
// to another host (a key set named elsewhere, a redirect).
func TestBearerTransportOnlyToTheAPIServer(t *testing.T) {
	seen := map[string]string{} // server → Authorization it got
	handler := func(name string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { seen[name] = r.Header.Get("Authorization") })
	}
	api := httptest.NewTLSServer(handler("api"))
	defer api.Close()
	otherTLS := httptest.NewTLSServer(handler("other-https"))
	defer otherTLS.Close()
	plain := httptest.NewServer(handler("plain"))
	defer plain.Close()
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte("pod-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	apiURL, _ := url.Parse(api.URL)
	c := &http.Client{Transport: &bearerTransport{host: apiURL.Host, cluster: api.Client().Transport,
		other: otherTLS.Client().Transport, tokenFile: tokenFile}}
	for _, u := range []string{api.URL, otherTLS.URL, plain.URL} {
		resp, err := c.Get(u + "/openid/v1/jwks")
		if err != nil {
			t.Fatalf("GET %s: %v", u, err)
		}
		resp.Body.Close()
	}
	if seen["api"] != "Bearer pod-token" {
		t.Errorf("the API server got Authorization %q, want the pod's token", seen["api"])
	}
	for _, name := range []string{"other-https", "plain"} {
		if a, ok := seen[name]; !ok || a != "" {
			t.Errorf("%s got Authorization %q (reached: %v), want none", name, a, ok)
		}
	}
}
