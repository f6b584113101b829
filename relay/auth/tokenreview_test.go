package auth

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"

	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

var _ TokenVerifier = (*TokenReview)(nil)

// reviewEpoch is where the tests' clocks start.
var reviewEpoch = time.Unix(1_800_000_000, 0)

// reviewClock is a clock the test moves.
type reviewClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *reviewClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *reviewClock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// newTokenReview returns a TokenReview asking api, on a clock at
// reviewEpoch, with edit applied to the default config.
func newTokenReview(t *testing.T, api *authtest.KubeAPI, edit func(*TokenReviewConfig)) (*TokenReview, *reviewClock) {
	t.Helper()
	clk := &reviewClock{now: reviewEpoch}
	cfg := DefaultTokenReviewConfig()
	cfg.Client = api.Clientset()
	cfg.Now = clk.Now
	if edit != nil {
		edit(&cfg)
	}
	tr, err := NewTokenReview(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tr, clk
}

// jwtShaped returns an unsigned token shaped like a service-account JWT
// (an RS256 header, claims, a made-up signature): the fake API server, not
// a signature, decides its verdict.
func jwtShaped(t testing.TB, claims map[string]any) string {
	t.Helper()
	b, err := json.Marshal(claims)
	if err != nil {
		t.Fatal(err)
	}
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"RS256","kid":"k1","typ":"JWT"}`)) + "." + enc(b) + "." + enc([]byte("not a signature"))
}

// saToken is a token of ns/sa expiring exp after reviewEpoch (no exp claim
// if exp is 0).
func saToken(t testing.TB, ns, sa string, exp time.Duration) string {
	t.Helper()
	claims := map[string]any{"iss": authtest.DefaultIssuer, "sub": "system:serviceaccount:" + ns + ":" + sa, "aud": []string{"istio-ca"}}
	if exp != 0 {
		claims["exp"] = reviewEpoch.Add(exp).Unix()
	}
	return jwtShaped(t, claims)
}

// accounts answers a review of each token in m as its service account
// (bound to istio-ca), and refuses every other token. It fails the test if
// a review does not ask for exactly the istio-ca audience.
func accounts(t testing.TB, m map[string][2]string) authtest.Verdict {
	return func(token string, aud []string) authenticationv1.TokenReviewStatus {
		if !slices.Equal(aud, []string{"istio-ca"}) {
			t.Errorf("review spec.audiences = %q, want [istio-ca]", aud)
		}
		if sa, ok := m[token]; ok {
			return authtest.ServiceAccount(sa[0], sa[1], "istio-ca")
		}
		return authtest.Unauthenticated("invalid bearer token")
	}
}

func checkVerify(t *testing.T, what string, id Identity, err error, want Identity, reason Reason, token string) {
	t.Helper()
	if err != nil && strings.Contains(err.Error(), token) {
		t.Fatalf("%s: error %q holds the token", what, err)
	}
	if reason != "" {
		if err == nil {
			t.Fatalf("%s = %v, want a %s error", what, id, reason)
		}
		if got := ReasonOf(err); got != reason {
			t.Fatalf("%s: reason %s (%v), want %s", what, got, err, reason)
		}
		return
	}
	if err != nil {
		t.Fatalf("%s: %v, want %v", what, err, want)
	}
	if id.TrustDomain != want.TrustDomain || id.Namespace != want.Namespace || id.ServiceAccount != want.ServiceAccount ||
		id.Method != want.Method || !id.Expires.Equal(want.Expires) {
		t.Fatalf("%s = %+v, want %+v", what, id, want)
	}
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func TestNewTokenReviewValidates(t *testing.T) {
	api := authtest.NewKubeAPI(t, nil)
	for _, tc := range []struct {
		name  string
		edit  func(*TokenReviewConfig)
		field string // "": valid
	}{
		{"defaults", func(*TokenReviewConfig) {}, ""},
		{"nil clock", func(c *TokenReviewConfig) { c.Now = nil }, ""},
		{"no negative cache", func(c *TokenReviewConfig) { c.NegativeTTL = 0 }, ""},
		{"no client", func(c *TokenReviewConfig) { c.Client = nil }, "Client"},
		{"no audiences", func(c *TokenReviewConfig) { c.Audiences = nil }, "Audiences"},
		{"empty audience", func(c *TokenReviewConfig) { c.Audiences = []string{"istio-ca", ""} }, "Audiences"},
		{"no trust domain", func(c *TokenReviewConfig) { c.TrustDomain = "" }, "TrustDomain"},
		{"no cache", func(c *TokenReviewConfig) { c.CacheSize = 0 }, "CacheSize"},
		{"no max TTL", func(c *TokenReviewConfig) { c.MaxTTL = 0 }, "MaxTTL"},
		{"negative negative TTL", func(c *TokenReviewConfig) { c.NegativeTTL = -time.Second }, "NegativeTTL"},
		{"no in-flight reviews", func(c *TokenReviewConfig) { c.MaxInFlight = 0 }, "MaxInFlight"},
		{"no timeout", func(c *TokenReviewConfig) { c.Timeout = 0 }, "Timeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultTokenReviewConfig()
			cfg.Client = api.Clientset()
			tc.edit(&cfg)
			_, err := NewTokenReview(cfg)
			switch {
			case tc.field == "" && err != nil:
				t.Fatalf("NewTokenReview: %v, want success", err)
			case tc.field != "" && (err == nil || !strings.Contains(err.Error(), "auth: field "+tc.field+" ")):
				t.Fatalf("NewTokenReview: %v, want an error about field %s", err, tc.field)
			}
		})
	}
}

// TestTokenReviewVerdicts: how each answer of the API server is read, and
// that the answer is cached (the second call makes no review).
func TestTokenReviewVerdicts(t *testing.T) {
	exp := reviewEpoch.Add(time.Hour)
	app := Identity{TrustDomain: "cluster.local", Namespace: "ns1", ServiceAccount: "app", Method: MethodJWT, Expires: exp}
	sa := authtest.ServiceAccount
	for _, tc := range []struct {
		name   string
		status func(token string) authenticationv1.TokenReviewStatus
		want   Identity
		reason Reason
		msg    string // the error holds it
	}{
		{"service account", func(string) authenticationv1.TokenReviewStatus { return sa("ns1", "app", "istio-ca") }, app, "", ""},
		{"one of its audiences is ours", func(string) authenticationv1.TokenReviewStatus { return sa("ns1", "app", "vault", "istio-ca") }, app, "", ""},
		{"not authenticated", func(string) authenticationv1.TokenReviewStatus { return authtest.Unauthenticated("") }, Identity{}, ReviewDenied, "did not authenticate"},
		{"not authenticated, with a reason", func(string) authenticationv1.TokenReviewStatus {
			return authtest.Unauthenticated("service account token has been invalidated")
		}, Identity{}, ReviewDenied, "has been invalidated"},
		{"an error that repeats the token", func(tok string) authenticationv1.TokenReviewStatus {
			return authtest.Unauthenticated("token " + tok + " is bad")
		}, Identity{}, ReviewDenied, "token [token] is bad"},
		{"authenticated with an error", func(string) authenticationv1.TokenReviewStatus {
			st := sa("ns1", "app", "istio-ca")
			st.Error = "partial failure"
			return st
		}, Identity{}, ReviewDenied, "partial failure"},
		{"wrong audience", func(string) authenticationv1.TokenReviewStatus { return sa("ns1", "app", "vault") }, Identity{}, WrongAudience, `["vault"]`},
		{"bound to the API server only", func(string) authenticationv1.TokenReviewStatus { return sa("ns1", "app") }, Identity{}, WrongAudience, "[]"},
		{"a user, not a service account", func(string) authenticationv1.TokenReviewStatus {
			st := sa("ns1", "app", "istio-ca")
			st.User.Username, st.User.Groups = "alice@example.com", []string{"system:authenticated"}
			return st
		}, Identity{}, ReviewDenied, "alice@example.com"},
		{"a malformed service account user", func(string) authenticationv1.TokenReviewStatus {
			st := sa("ns1", "app", "istio-ca")
			st.User.Username = "system:serviceaccount:ns1"
			return st
		}, Identity{}, ReviewDenied, "not a service account"},
		{"outside the system:serviceaccounts group", func(string) authenticationv1.TokenReviewStatus {
			st := sa("ns1", "app", "istio-ca")
			st.User.Groups = []string{"system:authenticated"}
			return st
		}, Identity{}, ReviewDenied, "system:serviceaccounts"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			api := authtest.NewKubeAPI(t, func(tok string, aud []string) authenticationv1.TokenReviewStatus {
				if !slices.Equal(aud, []string{"istio-ca"}) {
					t.Errorf("review spec.audiences = %q, want [istio-ca]", aud)
				}
				return tc.status(tok)
			})
			tr, _ := newTokenReview(t, api, nil)
			token := saToken(t, "ns1", "app", time.Hour)
			for i := range 2 {
				what := fmt.Sprintf("VerifyToken #%d", i+1)
				id, err := tr.VerifyToken(context.Background(), token)
				checkVerify(t, what, id, err, tc.want, tc.reason, token)
				if tc.msg != "" && !strings.Contains(err.Error(), tc.msg) {
					t.Fatalf("%s: error %q, want it to say %q", what, err, tc.msg)
				}
			}
			if n := api.Requests(); n != 1 {
				t.Fatalf("API server saw %d reviews, want 1 (the second call is answered from the cache)", n)
			}
			if st := tr.Stats(); st.Reviews != 1 || st.Hits != 1 || st.Cached != 1 {
				t.Fatalf("Stats() = %+v, want 1 review, 1 hit, 1 cached", st)
			}
		})
	}
}

// TestTokenReviewSignedToken: a real signed token's exp is read for
// Identity.Expires.
func TestTokenReviewSignedToken(t *testing.T) {
	is := authtest.NewIssuer(t)
	token := is.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app", IssuedAt: reviewEpoch, TTL: time.Hour})
	api := authtest.NewKubeAPI(t, accounts(t, map[string][2]string{token: {"ns1", "app"}}))
	tr, _ := newTokenReview(t, api, nil)
	id, err := tr.VerifyToken(context.Background(), token)
	checkVerify(t, "VerifyToken", id, err, Identity{"cluster.local", "ns1", "app", MethodJWT, reviewEpoch.Add(time.Hour)}, "", token)
}

// TestTokenReviewRefusesWithoutReview: what is not a JWT, or has expired,
// is refused without asking the API server (which would accept it).
func TestTokenReviewRefusesWithoutReview(t *testing.T) {
	sig := base64.RawURLEncoding.EncodeToString([]byte("sig"))
	for _, tc := range []struct {
		name   string
		token  string
		reason Reason
	}{
		{"empty", "", BadToken},
		{"one part", "abcdefgh", BadToken},
		{"two parts", "abcd.efgh", BadToken},
		{"four parts", "abcd.efgh.ijkl.mnop", BadToken},
		{"an empty part", "abcd..ijkl", BadToken},
		{"an empty signature", "abcd.efgh.", BadToken},
		{"padding", "abcd.efgh.ij==", BadToken},
		{"standard base64", "ab+d.efgh.ijkl", BadToken},
		{"a newline", "abcd.ef\ngh.ijkl", BadToken},
		{"impossible length", "abcde.efgh.ijkl", BadToken},
		{"too long", strings.Repeat("a", MaxTokenBytes) + ".b." + sig, BadToken},
		{"expired", saToken(t, "ns1", "app", -time.Second), Expired},
		{"expiring now", jwtShaped(t, map[string]any{"sub": "system:serviceaccount:ns1:app", "exp": reviewEpoch.Unix()}), Expired},
	} {
		t.Run(tc.name, func(t *testing.T) {
			api := authtest.NewKubeAPI(t, func(string, []string) authenticationv1.TokenReviewStatus {
				return authtest.ServiceAccount("ns1", "app", "istio-ca")
			})
			tr, _ := newTokenReview(t, api, nil)
			_, err := tr.VerifyToken(context.Background(), tc.token)
			if err == nil || ReasonOf(err) != tc.reason {
				t.Fatalf("VerifyToken(%.40q) = %v, want a %s error", tc.token, err, tc.reason)
			}
			if tc.token != "" && strings.Contains(err.Error(), tc.token) {
				t.Fatalf("VerifyToken: error %q holds the token", err)
			}
			if n := api.Requests(); n != 0 {
				t.Fatalf("API server saw %d reviews, want none", n)
			}
		})
	}
}

// TestTokenReviewAPIErrors: a review that fails is a ReviewFailed error and
// is not cached: once the API server is back, the next call succeeds.
func TestTokenReviewAPIErrors(t *testing.T) {
	want := Identity{"cluster.local", "ns1", "app", MethodJWT, reviewEpoch.Add(time.Hour)}
	for _, tc := range []struct {
		name        string
		breakIt     func(*authtest.KubeAPI)
		mendIt      func(*authtest.KubeAPI)
		reached     int    // reviews the broken server saw
		msg         string // the error holds it
		deadlineErr bool   // errors.Is(err, context.DeadlineExceeded)
	}{
		{"server closed", (*authtest.KubeAPI).Stop, (*authtest.KubeAPI).Start, 0, "connection refused", false},
		{"forbidden", func(k *authtest.KubeAPI) { k.SetFailure(403) }, func(k *authtest.KubeAPI) { k.SetFailure(0) }, 1, "failing with 403", false},
		{"internal error", func(k *authtest.KubeAPI) { k.SetFailure(500) }, func(k *authtest.KubeAPI) { k.SetFailure(0) }, 1, "failing with 500", false},
		{"timeout", func(k *authtest.KubeAPI) { k.SetDelay(time.Hour) }, func(k *authtest.KubeAPI) { k.SetDelay(0) }, 1, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			token := saToken(t, "ns1", "app", time.Hour)
			api := authtest.NewKubeAPI(t, accounts(t, map[string][2]string{token: {"ns1", "app"}}))
			tr, _ := newTokenReview(t, api, func(c *TokenReviewConfig) { c.Timeout = 200 * time.Millisecond })

			tc.breakIt(api)
			start := time.Now()
			_, err := tr.VerifyToken(context.Background(), token)
			checkVerify(t, "VerifyToken (API broken)", Identity{}, err, Identity{}, ReviewFailed, token)
			if !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("VerifyToken (API broken): error %q, want it to say %q", err, tc.msg)
			}
			if tc.deadlineErr && !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("VerifyToken (API broken): error %q is not context.DeadlineExceeded", err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("VerifyToken (API broken) took %v, want about Timeout", d)
			}
			if n := api.Requests(); n != tc.reached {
				t.Fatalf("API server saw %d reviews, want %d", n, tc.reached)
			}

			tc.mendIt(api)
			id, err := tr.VerifyToken(context.Background(), token)
			checkVerify(t, "VerifyToken (API back)", id, err, want, "", token)
			if st := tr.Stats(); st.Reviews != 2 || st.Hits != 0 {
				t.Fatalf("Stats() = %+v, want 2 reviews and no hit: a failure is not cached", st)
			}
		})
	}
}

type reviewStep struct {
	advance time.Duration // the clock moves first
	reviews uint64        // reviews made so far
	reason  Reason        // "": the identity
}

func runSteps(t *testing.T, tr *TokenReview, clk *reviewClock, token string, want Identity, steps []reviewStep) {
	t.Helper()
	var elapsed time.Duration
	for i, s := range steps {
		clk.Add(s.advance)
		elapsed += s.advance
		id, err := tr.VerifyToken(context.Background(), token)
		what := fmt.Sprintf("step %d: VerifyToken at +%v", i+1, elapsed)
		checkVerify(t, what, id, err, want, s.reason, token)
		if got := tr.Stats().Reviews; got != s.reviews {
			t.Fatalf("%s: %d reviews so far, want %d", what, got, s.reviews)
		}
	}
}

// TestTokenReviewCacheLifetime: a positive verdict is cached for MaxTTL at
// most, and never past the token's exp; after exp the token is refused
// without a review.
func TestTokenReviewCacheLifetime(t *testing.T) {
	for _, tc := range []struct {
		name  string
		exp   time.Duration // the token's, from reviewEpoch; 0: no exp claim
		steps []reviewStep
	}{
		{"capped at exp", 2 * time.Minute, []reviewStep{
			{0, 1, ""}, {time.Minute, 1, ""}, {59 * time.Second, 1, ""},
			{time.Second, 1, Expired}, {time.Hour, 1, Expired},
		}},
		{"capped at MaxTTL", time.Hour, []reviewStep{
			{0, 1, ""}, {5*time.Minute - time.Second, 1, ""}, {time.Second, 2, ""}, {time.Minute, 2, ""},
		}},
		{"no exp: MaxTTL", 0, []reviewStep{
			{0, 1, ""}, {4 * time.Minute, 1, ""}, {time.Minute, 2, ""}, {time.Hour, 3, ""},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			token := saToken(t, "ns1", "app", tc.exp)
			api := authtest.NewKubeAPI(t, accounts(t, map[string][2]string{token: {"ns1", "app"}}))
			tr, clk := newTokenReview(t, api, func(c *TokenReviewConfig) { c.MaxTTL = 5 * time.Minute })
			want := Identity{"cluster.local", "ns1", "app", MethodJWT, time.Time{}}
			if tc.exp != 0 {
				want.Expires = reviewEpoch.Add(tc.exp)
			}
			runSteps(t, tr, clk, token, want, tc.steps)
			if n := api.Requests(); uint64(n) != tr.Stats().Reviews {
				t.Fatalf("API server saw %d reviews, Stats() says %d", n, tr.Stats().Reviews)
			}
		})
	}
}

// TestTokenReviewNegativeCache: a refusal is cached for NegativeTTL, even
// if the API server changed its mind meanwhile; with NegativeTTL 0 it is
// not cached.
func TestTokenReviewNegativeCache(t *testing.T) {
	for _, tc := range []struct {
		name        string
		negativeTTL time.Duration
		steps       []reviewStep // the API server accepts the token after step 1
	}{
		{"cached for NegativeTTL", 10 * time.Second, []reviewStep{
			{0, 1, ReviewDenied}, {0, 1, ReviewDenied}, {9 * time.Second, 1, ReviewDenied}, {time.Second, 2, ""}, {time.Second, 2, ""},
		}},
		{"not cached", 0, []reviewStep{
			{0, 1, ReviewDenied}, {0, 2, ""},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			token := saToken(t, "ns1", "app", time.Hour)
			api := authtest.NewKubeAPI(t, nil)
			tr, clk := newTokenReview(t, api, func(c *TokenReviewConfig) { c.NegativeTTL = tc.negativeTTL })
			want := Identity{"cluster.local", "ns1", "app", MethodJWT, reviewEpoch.Add(time.Hour)}
			runSteps(t, tr, clk, token, want, tc.steps[:1])
			api.SetVerdict(accounts(t, map[string][2]string{token: {"ns1", "app"}}))
			runSteps(t, tr, clk, token, want, tc.steps[1:])
		})
	}
}

// TestTokenReviewEviction: a full cache drops expired verdicts first, then
// the least recently used.
func TestTokenReviewEviction(t *testing.T) {
	type call struct {
		token   string
		advance time.Duration
		reviews uint64 // so far
	}
	for _, tc := range []struct {
		name  string
		calls []call
	}{
		{"least recently used", []call{
			{"a", 0, 1}, {"b", 0, 2}, {"a", 0, 2}, {"c", 0, 3}, // c evicts b, not a
			{"a", 0, 3}, {"b", 0, 4},
		}},
		{"expired first", []call{
			{"a", 0, 1}, {"bad", 0, 2}, // bad is the most recently used
			{"c", 11 * time.Second, 3}, // but its refusal has expired: c evicts it, not a
			{"a", 0, 3}, {"c", 0, 3},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tokens := map[string]string{}
			m := map[string][2]string{}
			for _, name := range []string{"a", "b", "c", "bad"} {
				tokens[name] = saToken(t, "ns1", name, time.Hour)
				if name != "bad" {
					m[tokens[name]] = [2]string{"ns1", name}
				}
			}
			api := authtest.NewKubeAPI(t, accounts(t, m))
			tr, clk := newTokenReview(t, api, func(c *TokenReviewConfig) { c.CacheSize = 2 })
			for i, c := range tc.calls {
				clk.Add(c.advance)
				_, err := tr.VerifyToken(context.Background(), tokens[c.token])
				if (err == nil) != (c.token != "bad") {
					t.Fatalf("call %d: VerifyToken(%s): %v", i+1, c.token, err)
				}
				if st := tr.Stats(); st.Reviews != c.reviews || st.Cached > 2 {
					t.Fatalf("call %d: VerifyToken(%s): Stats() = %+v, want %d reviews and at most 2 cached", i+1, c.token, st, c.reviews)
				}
			}
		})
	}
}

// TestTokenReviewCallerGivesUp: a caller whose context ends gets a
// ReviewFailed error at once; a review others still wait for goes on.
func TestTokenReviewCallerGivesUp(t *testing.T) {
	token := saToken(t, "ns1", "app", time.Hour)
	api := authtest.NewKubeAPI(t, accounts(t, map[string][2]string{token: {"ns1", "app"}}))
	api.SetDelay(time.Hour)
	tr, _ := newTokenReview(t, api, func(c *TokenReviewConfig) { c.Timeout = time.Hour })

	t.Run("alone", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		_, err := tr.VerifyToken(ctx, token)
		checkVerify(t, "VerifyToken", Identity{}, err, Identity{}, ReviewFailed, token)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("VerifyToken: %v, want context.DeadlineExceeded", err)
		}
	})

	t.Run("while another waits", func(t *testing.T) {
		api.SetDelay(0)
		block := make(chan struct{})
		api.SetVerdict(func(string, []string) authenticationv1.TokenReviewStatus {
			<-block
			return authtest.ServiceAccount("ns1", "app", "istio-ca")
		})
		before := tr.Stats()
		ctx, cancel := context.WithCancel(context.Background())
		first := make(chan error, 1)
		go func() {
			_, err := tr.VerifyToken(ctx, token)
			first <- err
		}()
		waitUntil(t, "the first caller's review", func() bool { return tr.Stats().Reviews == before.Reviews+1 })
		second := make(chan error, 1)
		var id Identity
		go func() {
			var err error
			id, err = tr.VerifyToken(context.Background(), token)
			second <- err
		}()
		waitUntil(t, "the second caller to join", func() bool { return tr.Stats().Shared == before.Shared+1 })
		cancel()
		if err := <-first; ReasonOf(err) != ReviewFailed || !errors.Is(err, context.Canceled) {
			t.Fatalf("first VerifyToken: %v, want ReviewFailed: context canceled", err)
		}
		close(block)
		err := <-second
		checkVerify(t, "second VerifyToken", id, err, Identity{"cluster.local", "ns1", "app", MethodJWT, reviewEpoch.Add(time.Hour)}, "", token)
		if got := tr.Stats().Reviews; got != before.Reviews+1 {
			t.Fatalf("%d reviews, want %d: the first caller leaving did not stop the shared review", got, before.Reviews+1)
		}
	})
}

// TestTokenReviewMaxInFlight: at most MaxInFlight reviews are in flight;
// a caller waiting for a slot honours its context.
func TestTokenReviewMaxInFlight(t *testing.T) {
	m := map[string][2]string{}
	var tokens []string
	for i := range 8 {
		tok := saToken(t, "ns1", fmt.Sprintf("sa-%d", i), time.Hour)
		tokens = append(tokens, tok)
		m[tok] = [2]string{"ns1", fmt.Sprintf("sa-%d", i)}
	}

	t.Run("bounded", func(t *testing.T) {
		api := authtest.NewKubeAPI(t, accounts(t, m))
		api.SetDelay(30 * time.Millisecond)
		tr, _ := newTokenReview(t, api, func(c *TokenReviewConfig) { c.MaxInFlight = 2 })
		var wg sync.WaitGroup
		for i, tok := range tokens {
			wg.Go(func() {
				id, err := tr.VerifyToken(context.Background(), tok)
				if err != nil || id.ServiceAccount != fmt.Sprintf("sa-%d", i) {
					t.Errorf("VerifyToken(token %d) = %v, %v", i, id, err)
				}
			})
		}
		wg.Wait()
		if got := api.MaxConcurrent(); got > 2 {
			t.Fatalf("API server saw %d reviews at once, want at most MaxInFlight 2", got)
		}
		if got := api.Requests(); got != len(tokens) {
			t.Fatalf("API server saw %d reviews, want %d", got, len(tokens))
		}
	})

	t.Run("waiting honours the context", func(t *testing.T) {
		api := authtest.NewKubeAPI(t, accounts(t, m))
		api.SetDelay(time.Hour)
		tr, _ := newTokenReview(t, api, func(c *TokenReviewConfig) { c.MaxInFlight = 1; c.Timeout = time.Hour })
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			_, err := tr.VerifyToken(ctx, tokens[0])
			done <- err
		}()
		waitUntil(t, "the first review", func() bool { return api.Requests() == 1 })

		wctx, wcancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer wcancel()
		_, err := tr.VerifyToken(wctx, tokens[1])
		if ReasonOf(err) != ReviewFailed || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("VerifyToken while the slot is taken: %v, want ReviewFailed: context deadline exceeded", err)
		}
		cancel()
		<-done
		if got := api.Requests(); got != 1 {
			t.Fatalf("API server saw %d reviews, want 1: the waiter gave up before its turn", got)
		}
	})
}

// TestTokenReviewStorm: 10,000 concurrent calls over 100 distinct tokens
// cost one review a token.
func TestTokenReviewStorm(t *testing.T) {
	const calls, distinct = 10_000, 100
	m := map[string][2]string{}
	tokens := make([]string, distinct)
	for i := range tokens {
		tokens[i] = saToken(t, fmt.Sprintf("ns-%d", i%7), fmt.Sprintf("sa-%d", i), time.Hour)
		m[tokens[i]] = [2]string{fmt.Sprintf("ns-%d", i%7), fmt.Sprintf("sa-%d", i)}
	}
	api := authtest.NewKubeAPI(t, accounts(t, m))
	api.SetDelay(20 * time.Millisecond)
	// The storm asserts what is asked, not how fast: on a loaded machine
	// ten thousand goroutines under -race may hold a review past the
	// default 5s, which would fail a call the test means to succeed.
	tr, _ := newTokenReview(t, api, func(c *TokenReviewConfig) { c.Timeout = 10 * time.Minute })

	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() {
			<-start
			n := i % distinct
			id, err := tr.VerifyToken(context.Background(), tokens[n])
			if err != nil || id.Namespace != fmt.Sprintf("ns-%d", n%7) || id.ServiceAccount != fmt.Sprintf("sa-%d", n) || id.Method != MethodJWT {
				t.Errorf("call %d: VerifyToken(token %d) = %v, %v", i, n, id, err)
			}
		})
	}
	began := time.Now()
	close(start)
	wg.Wait()
	st := tr.Stats()
	t.Logf("%d calls over %d tokens in %v: API server saw %d reviews (at most %d at once); stats %+v",
		calls, distinct, time.Since(began).Round(time.Millisecond), api.Requests(), api.MaxConcurrent(), st)
	if got := api.Requests(); got != distinct {
		t.Fatalf("API server saw %d reviews, want %d (one a token)", got, distinct)
	}
	if st.Reviews != distinct || st.Reviews+st.Hits+st.Shared != calls {
		t.Fatalf("Stats() = %+v, want %d reviews and every other call a hit or shared", st, distinct)
	}
	if got := api.MaxConcurrent(); got > DefaultTokenReviewConfig().MaxInFlight {
		t.Fatalf("API server saw %d reviews at once, want at most MaxInFlight", got)
	}
}

// FuzzTokenExpiry: unverifiedExpiry never panics; it refuses exactly what
// is not three non-empty base64url parts, never quoting the input; and it
// reads back an exp it is given.
func FuzzTokenExpiry(f *testing.F) {
	enc := base64.RawURLEncoding.EncodeToString
	hdr := enc([]byte(`{"alg":"RS256","typ":"JWT"}`))
	for _, payload := range []string{
		`{"exp":1800000000}`, `{"exp":1.8e9}`, `{"exp":"soon"}`, `{"exp":null}`, `{"exp":-1}`,
		`{"exp":1e300}`, `{"exp":9223372036854775807}`, `{}`, `[]`, `not json`, `{"exp":1800000000,"aud":5}`,
	} {
		f.Add(hdr+"."+enc([]byte(payload))+"."+enc([]byte("sig")), int64(1_800_000_000))
	}
	for _, s := range []string{"", ".", "..", "a.b.c", "a.b.c.d", "a..c", "====.==.==", "eyJ.eyJ.x", enc([]byte(`{"alg":"none"}`)) + ".e30.x"} {
		f.Add(s, int64(0))
	}
	f.Fuzz(func(t *testing.T, token string, exp int64) {
		got, err := unverifiedExpiry(token)
		parts := strings.Split(token, ".")
		wellFormed := len(parts) == 3
		for _, p := range parts {
			if _, derr := base64.RawURLEncoding.DecodeString(p); p == "" || derr != nil || strings.ContainsAny(p, "\r\n") {
				wellFormed = false
			}
		}
		switch {
		case err != nil && (ReasonOf(err) != BadToken || !got.IsZero()):
			t.Fatalf("unverifiedExpiry(%q) = %v, %v: want only a BadToken error", token, got, err)
		case err != nil && wellFormed:
			t.Fatalf("unverifiedExpiry(%q): %v, but it is three base64url parts", token, err)
		case err == nil && !wellFormed:
			t.Fatalf("unverifiedExpiry(%q) = %v, want a BadToken error", token, got)
		case err != nil && len(token) >= 8 && strings.Contains(err.Error(), token):
			t.Fatalf("unverifiedExpiry: error %q quotes the token", err)
		}

		// A readable exp is read back (exactly, where a float64 holds it).
		if exp > -1<<53 && exp < 1<<53 {
			tok := hdr + "." + enc(fmt.Appendf(nil, `{"exp":%d}`, exp)) + "." + enc([]byte("sig"))
			if got, err := unverifiedExpiry(tok); err != nil || !got.Equal(time.Unix(exp, 0)) {
				t.Fatalf("unverifiedExpiry(exp %d) = %v, %v, want %v", exp, got, err, time.Unix(exp, 0))
			}
		}
	})
}
