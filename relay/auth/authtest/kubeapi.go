package authtest

import (
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
)

// TokenReviewPath is where the Kubernetes API serves TokenReviews.
const TokenReviewPath = "/apis/authentication.k8s.io/v1/tokenreviews"

// Verdict decides a TokenReview: token is its spec.token, audiences its
// spec.audiences. It runs on the server's goroutines, so it must be safe
// for concurrent use.
type Verdict func(token string, audiences []string) authenticationv1.TokenReviewStatus

// ServiceAccount is the status the API server answers for a valid token of
// service account ns/sa bound to audiences.
func ServiceAccount(ns, sa string, audiences ...string) authenticationv1.TokenReviewStatus {
	return authenticationv1.TokenReviewStatus{
		Authenticated: true,
		User: authenticationv1.UserInfo{
			Username: "system:serviceaccount:" + ns + ":" + sa,
			UID:      "00000000-0000-0000-0000-000000000001",
			Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
		},
		Audiences: audiences,
	}
}

// Unauthenticated is the status the API server answers for a token it
// refuses; msg is its status.error ("" for none).
func Unauthenticated(msg string) authenticationv1.TokenReviewStatus {
	return authenticationv1.TokenReviewStatus{Error: msg}
}

// KubeAPI is an HTTP server that speaks the Kubernetes API's JSON for
// TokenReviews (POST /apis/authentication.k8s.io/v1/tokenreviews) and
// answers every other path with a Kubernetes Status 404. It decodes each
// request as a real authentication.k8s.io/v1 TokenReview and fails the test
// on anything a client must not send. Safe for concurrent use; it is
// closed when the test ends.
type KubeAPI struct {
	t         testing.TB  // nil when made by StartKubeAPI
	report    func(error) // StartKubeAPI's; nil: dropped
	addr      string
	clientset *kubernetes.Clientset

	mu      sync.Mutex
	srv     *httptest.Server // nil while stopped
	verdict Verdict
	delay   time.Duration
	failure int

	requests, inflight, maxInflight atomic.Int64
}

// NewKubeAPI starts a KubeAPI that answers with verdict (nil: every token
// is refused).
func NewKubeAPI(t testing.TB, verdict Verdict) *KubeAPI {
	t.Helper()
	k, err := startKubeAPI(&KubeAPI{t: t}, verdict)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Stop)
	return k
}

// StartKubeAPI starts a KubeAPI outside a test (a benchmark's fake API
// server, in a binary): what NewKubeAPI would fail the test for (a request
// a client must not send, an address taken on Start) is handed to report
// instead (nil: dropped), from the server's goroutines. The caller must
// call Stop.
func StartKubeAPI(verdict Verdict, report func(error)) (*KubeAPI, error) {
	return startKubeAPI(&KubeAPI{report: report}, verdict)
}

// startKubeAPI serves k and gives it a clientset pointed at it.
func startKubeAPI(k *KubeAPI, verdict Verdict) (*KubeAPI, error) {
	k.SetVerdict(verdict)
	k.srv = httptest.NewServer(http.HandlerFunc(k.serve))
	k.addr = k.srv.Listener.Addr().String()
	// QPS -1: no client-side rate limit (client-go's default of 5 a
	// second would otherwise bound every test).
	cs, err := kubernetes.NewForConfig(&rest.Config{Host: k.URL(), QPS: -1})
	if err != nil {
		k.Stop()
		return nil, fmt.Errorf("kubeapi: clientset: %w", err)
	}
	k.clientset = cs
	return k, nil
}

// errorf fails the test, or reports the error outside one.
func (k *KubeAPI) errorf(format string, args ...any) {
	if k.t != nil {
		k.t.Helper()
		k.t.Errorf(format, args...)
		return
	}
	if k.report != nil {
		k.report(fmt.Errorf(format, args...))
	}
}

// URL is the server's base URL; it stays the same across Stop and Start.
func (k *KubeAPI) URL() string { return "http://" + k.addr }

// Clientset returns a real client-go clientset pointed at the server,
// without a client-side rate limit.
func (k *KubeAPI) Clientset() *kubernetes.Clientset { return k.clientset }

// SetVerdict replaces the verdict (nil: every token is refused).
func (k *KubeAPI) SetVerdict(v Verdict) {
	if v == nil {
		v = func(string, []string) authenticationv1.TokenReviewStatus {
			return Unauthenticated("invalid bearer token")
		}
	}
	k.mu.Lock()
	k.verdict = v
	k.mu.Unlock()
}

// SetDelay makes every TokenReview take d before it is answered (or until
// the client gives up), so that concurrent reviews overlap.
func (k *KubeAPI) SetDelay(d time.Duration) {
	k.mu.Lock()
	k.delay = d
	k.mu.Unlock()
}

// SetFailure makes every TokenReview fail with a Kubernetes Status of HTTP
// code (403: the caller may not create tokenreviews; 500 …); 0 answers
// them again.
func (k *KubeAPI) SetFailure(code int) {
	k.mu.Lock()
	k.failure = code
	k.mu.Unlock()
}

// Requests is the number of TokenReview requests received.
func (k *KubeAPI) Requests() int { return int(k.requests.Load()) }

// MaxConcurrent is the most TokenReview requests that were in progress at
// once.
func (k *KubeAPI) MaxConcurrent() int { return int(k.maxInflight.Load()) }

// Stop closes the server and every connection to it: the API is down and
// connections are refused. It returns once every request has ended.
// Idempotent.
func (k *KubeAPI) Stop() {
	k.mu.Lock()
	srv := k.srv
	k.srv = nil
	k.mu.Unlock()
	if srv != nil {
		srv.CloseClientConnections()
		srv.Close()
	}
}

// Start serves again, at the same address, after Stop. Call it from the
// test's goroutine: it fails the test if the address is taken.
func (k *KubeAPI) Start() {
	if k.t != nil {
		k.t.Helper()
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.srv != nil {
		return
	}
	l, err := net.Listen("tcp", k.addr)
	if err != nil {
		if k.t == nil {
			k.errorf("kubeapi: listen again on %s: %v", k.addr, err)
			return
		}
		k.t.Fatalf("kubeapi: listen again on %s: %v", k.addr, err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(k.serve))
	srv.Listener.Close()
	srv.Listener = l
	srv.Start()
	k.srv = srv
}

// maxBodyBytes bounds a request body; the API server's own limit is 3 MiB.
const maxBodyBytes = 3 << 20

func (k *KubeAPI) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != TokenReviewPath {
		writeStatus(w, http.StatusNotFound, metav1.StatusReasonNotFound, "the server could not find the requested resource")
		return
	}
	if r.Method != http.MethodPost {
		k.errorf("kubeapi: %s %s, want POST", r.Method, r.URL.Path)
		writeStatus(w, http.StatusMethodNotAllowed, metav1.StatusReasonMethodNotAllowed, "the server does not allow this method on the requested resource")
		return
	}
	k.requests.Add(1)
	n := k.inflight.Add(1)
	defer k.inflight.Add(-1)
	for {
		m := k.maxInflight.Load()
		if n <= m || k.maxInflight.CompareAndSwap(m, n) {
			break
		}
	}

	review, err := decodeReview(r)
	if err != nil {
		k.errorf("kubeapi: bad TokenReview request: %v", err)
		writeStatus(w, http.StatusBadRequest, metav1.StatusReasonBadRequest, err.Error())
		return
	}

	k.mu.Lock()
	verdict, delay, failure := k.verdict, k.delay, k.failure
	k.mu.Unlock()
	if delay > 0 {
		tm := time.NewTimer(delay)
		select {
		case <-tm.C:
		case <-r.Context().Done():
			tm.Stop()
			return
		}
	}
	if failure != 0 {
		writeStatus(w, failure, reasonFor(failure), fmt.Sprintf("tokenreviews.authentication.k8s.io is failing with %d", failure))
		return
	}

	review.Status = verdict(review.Spec.Token, review.Spec.Audiences)
	review.TypeMeta = metav1.TypeMeta{APIVersion: authenticationv1.SchemeGroupVersion.String(), Kind: "TokenReview"}
	body, err := json.Marshal(review)
	if err != nil {
		k.errorf("kubeapi: encode TokenReview: %v", err)
		writeStatus(w, http.StatusInternalServerError, metav1.StatusReasonInternalError, "encode")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write(body)
}

// decodeReview decodes r's body as the API server does, with the client-go
// scheme's codecs (JSON or protobuf), and checks what the server checks.
func decodeReview(r *http.Request) (*authenticationv1.TokenReview, error) {
	ct, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		return nil, fmt.Errorf("content type %q: %w", r.Header.Get("Content-Type"), err)
	}
	if ct != runtime.ContentTypeJSON && ct != runtime.ContentTypeProtobuf {
		return nil, fmt.Errorf("content type %q, want JSON or protobuf", ct)
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBodyBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read body: %w", err)
	}
	if len(body) > maxBodyBytes {
		return nil, fmt.Errorf("body exceeds %d bytes", maxBodyBytes)
	}
	obj, gvk, err := scheme.Codecs.UniversalDeserializer().Decode(body, nil, nil)
	if err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	review, ok := obj.(*authenticationv1.TokenReview)
	if !ok {
		return nil, fmt.Errorf("body is a %s, want authentication.k8s.io/v1 TokenReview", gvk)
	}
	if review.Spec.Token == "" {
		return nil, fmt.Errorf("token is required for TokenReview in authentication")
	}
	return review, nil
}

// reasonFor is the Status reason the API server gives with code.
func reasonFor(code int) metav1.StatusReason {
	switch code {
	case http.StatusUnauthorized:
		return metav1.StatusReasonUnauthorized
	case http.StatusForbidden:
		return metav1.StatusReasonForbidden
	case http.StatusTooManyRequests:
		return metav1.StatusReasonTooManyRequests
	case http.StatusInternalServerError:
		return metav1.StatusReasonInternalError
	case http.StatusServiceUnavailable:
		return metav1.StatusReasonServiceUnavailable
	case http.StatusGatewayTimeout:
		return metav1.StatusReasonTimeout
	}
	return metav1.StatusReasonUnknown
}

// writeStatus answers with a Kubernetes Status, as the API server does for
// every error.
func writeStatus(w http.ResponseWriter, code int, reason metav1.StatusReason, msg string) {
	body, _ := json.Marshal(metav1.Status{
		TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"},
		Status:   metav1.StatusFailure,
		Message:  msg,
		Reason:   reason,
		Code:     int32(code),
	})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(body)
}
