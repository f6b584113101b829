package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"sigs.k8s.io/yaml"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// The files whose PromQL is checked against a live relay.
const (
	dashboardFile = "../../deploy/grafana/meshrelay.json"
	rulesFile     = "../../deploy/prometheus/meshrelay.rules.yml"
)

// TestDashboardMetricsExist runs a relay as the serve command wires it (a
// tier of one, with the embedded etcd, an upstream and one Envoy) and
// checks that every metric the Grafana dashboard and the alerting rules
// query is on its /metrics: a renamed metric fails here, not on a blank
// panel or an alert that can never fire.
func TestDashboardMetricsExist(t *testing.T) {
	queried := map[string][]string{} // metric → where it is queried
	for _, q := range dashboardQueries(t) {
		names, err := metricNames(q.expr)
		if err != nil {
			t.Fatalf("%s: %q: %v", q.where, q.expr, err)
		}
		for _, n := range names {
			queried[n] = append(queried[n], q.where)
		}
	}
	for _, q := range ruleQueries(t) {
		names, err := metricNames(q.expr)
		if err != nil {
			t.Fatalf("%s: %q: %v", q.where, q.expr, err)
		}
		for _, n := range names {
			queried[n] = append(queried[n], q.where)
		}
	}
	if len(queried) < 10 {
		t.Fatalf("only %d metrics found in the dashboard and rules: %v", len(queried), queried)
	}

	// Series Prometheus makes for each scrape, not the relay.
	for _, name := range []string{"up"} {
		if _, ok := queried[name]; !ok {
			t.Errorf("%s is listed as made by Prometheus but queried nowhere: drop it from the list", name)
		}
		delete(queried, name)
	}

	up, err := upstream.New(upstream.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := up.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer up.Stop(context.Background())
	xds, admin, gossip := freeAddr(t), freeAddr(t), freeAddr(t)
	args := []string{"--id", "dash", "--upstream", up.Addr(), "--xds-listen", xds, "--admin-listen", admin,
		"--gossip-listen", gossip, "--drain-period", "10ms", "--log-level", "error",
		"--etcd", "embedded", "--etcd-data-dir", filepath.Join(t.TempDir(), "etcd")}
	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, 1)
	go func() { errs <- serve(ctx, args) }()
	defer func() {
		cancel()
		if err := <-errs; err != nil {
			t.Errorf("serve: %v", err)
		}
	}()

	conn, err := grpc.NewClient(xds, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cfg := envoy.DefaultConfig()
	cfg.Node, cfg.Conn, cfg.Protocol = upstream.DefaultConfig().Scenario.Node(0, 0, 0), conn, envoy.Delta
	e, err := envoy.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer e.Stop(context.Background())

	// Metrics of labelled families appear with their first child: wait
	// until the relay has served the Envoy, or give up and name what is
	// missing.
	var missing []string
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		have := families(scrape(admin))
		missing = missing[:0]
		for name := range queried {
			if !exports(have, name) {
				missing = append(missing, name)
			}
		}
		if len(missing) == 0 || time.Now().After(deadline) {
			break
		}
	}
	slices.Sort(missing)
	for _, name := range missing {
		t.Errorf("%s is queried by %s, but a live relay's /metrics has no such metric", name, strings.Join(queried[name], ", "))
	}
}

type query struct{ where, expr string }

// dashboardQueries are the dashboard's panel targets and its variables'
// label_values queries.
func dashboardQueries(t *testing.T) []query {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	var qs []query
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			qs = append(qs, query{fmt.Sprintf("panel %q", p.Title), tg.Expr})
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		q, _ := v.Query.(map[string]any)["query"].(string)
		// label_values(<selector>, <label>): the selector is PromQL.
		inner, ok := strings.CutPrefix(q, "label_values(")
		i := strings.LastIndex(inner, ",")
		if !ok || i < 0 {
			t.Fatalf("variable %s: query %q: want label_values(<selector>, <label>)", v.Name, q)
		}
		qs = append(qs, query{"variable $" + v.Name, inner[:i]})
	}
	if len(qs) == 0 {
		t.Fatalf("%s: no queries", dashboardFile)
	}
	return qs
}

// ruleQueries are the alerting rules' expressions.
func ruleQueries(t *testing.T) []query {
	t.Helper()
	b, err := os.ReadFile(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Groups []struct {
			Rules []struct {
				Alert string `json:"alert"`
				Expr  string `json:"expr"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(b, &f); err != nil {
		t.Fatalf("%s: %v", rulesFile, err)
	}
	var qs []query
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			qs = append(qs, query{"alert " + r.Alert, r.Expr})
		}
	}
	if len(qs) == 0 {
		t.Fatalf("%s: no rules", rulesFile)
	}
	return qs
}

// families reads the metric families of a Prometheus text exposition, by
// name, with their type.
func families(text string) map[string]string {
	out := map[string]string{}
	for line := range strings.Lines(text) {
		if f := strings.Fields(line); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			out[f[2]] = f[3]
		}
	}
	return out
}

// exports reports whether a relay exporting families has the series
// name: a family's own, or a histogram's _bucket, _sum and _count, a
// summary's _sum and _count.
func exports(families map[string]string, name string) bool {
	if _, ok := families[name]; ok {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok {
			switch families[base] {
			case "histogram":
				return true
			case "summary":
				return suffix != "_bucket"
			}
		}
	}
	return false
}

// PromQL words that are not metric names: aggregations (which may be
// followed by by/without before their parenthesis), set operators and
// modifiers, and the literals.
var promqlKeywords = map[string]bool{
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
	"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true, "limitk": true, "limit_ratio": true,
	"and": true, "or": true, "unless": true, "bool": true, "offset": true, "atan2": true,
	"inf": true, "nan": true,
}

// Modifiers followed by a parenthesised list of label names.
var promqlLabelLists = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

// metricNames returns the metric names a PromQL expression selects, in
// order of appearance, each once. It is a tokenizer, not a parser (the
// Prometheus module is not a dependency): it skips strings, label
// matchers, ranges and subqueries, numbers and durations, Grafana
// variables ($x, ${x}), and the label lists of by, without, on, ignoring
// and group_left/right; a word followed by "(" is a function, and
// keywords are not names. What remains are the selectors' metric names.
func metricNames(expr string) ([]string, error) {
	var names []string
	isIdentStart := func(c byte) bool { return c == '_' || c == ':' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' }
	isIdent := func(c byte) bool { return isIdentStart(c) || '0' <= c && c <= '9' }
	// skipString returns the index after the string literal opening at i.
	skipString := func(i int) (int, error) {
		q := expr[i]
		for j := i + 1; j < len(expr); j++ {
			switch {
			case expr[j] == '\\' && q != '`':
				j++
			case expr[j] == q:
				return j + 1, nil
			}
		}
		return 0, fmt.Errorf("unterminated string at %d", i)
	}
	// skipGroup returns the index after the bracket closing the one at i.
	skipGroup := func(i int) (int, error) {
		open := expr[i]
		close := map[byte]byte{'{': '}', '[': ']', '(': ')'}[open]
		depth := 0
		for j := i; j < len(expr); j++ {
			switch c := expr[j]; c {
			case '"', '\'', '`':
				k, err := skipString(j)
				if err != nil {
					return 0, err
				}
				j = k - 1
			case open:
				depth++
			case close:
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, fmt.Errorf("unbalanced %q at %d", open, i)
	}
	nextNonSpace := func(i int) int {
		for i < len(expr) && strings.IndexByte(" \t\r\n", expr[i]) >= 0 {
			i++
		}
		return i
	}
	parens := 0
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '(' || c == ')':
			if parens += map[byte]int{'(': 1, ')': -1}[c]; parens < 0 {
				return nil, fmt.Errorf("unbalanced ')' at %d", i)
			}
			i++
		case c == '"' || c == '\'' || c == '`':
			j, err := skipString(i)
			if err != nil {
				return nil, err
			}
			i = j
		case c == '{' || c == '[':
			j, err := skipGroup(i)
			if err != nil {
				return nil, err
			}
			i = j
		case c == '#':
			for i < len(expr) && expr[i] != '\n' {
				i++
			}
		case c == '$':
			i++
			if i < len(expr) && expr[i] == '{' {
				j, err := skipGroup(i)
				if err != nil {
					return nil, err
				}
				i = j
			}
			for i < len(expr) && isIdent(expr[i]) {
				i++
			}
		case '0' <= c && c <= '9' || c == '.':
			// A number or a duration: 0.99, 1e3, 0x1f, 5m, 1h30m.
			for i < len(expr) && (isIdent(expr[i]) || expr[i] == '.') {
				i++
			}
		case isIdentStart(c):
			j := i
			for j < len(expr) && isIdent(expr[j]) {
				j++
			}
			word := expr[i:j]
			k := nextNonSpace(j)
			switch {
			case promqlLabelLists[strings.ToLower(word)] && k < len(expr) && expr[k] == '(':
				end, err := skipGroup(k)
				if err != nil {
					return nil, err
				}
				j = end
			case k < len(expr) && expr[k] == '(':
				// A function or an aggregation: its arguments follow.
			case promqlKeywords[strings.ToLower(word)]:
			default:
				if !slices.Contains(names, word) {
					names = append(names, word)
				}
			}
			i = j
		default:
			i++
		}
	}
	if parens != 0 {
		return nil, fmt.Errorf("%d '(' not closed", parens)
	}
	return names, nil
}

func TestMetricNames(t *testing.T) {
	tests := []struct {
		expr string
		want []string
	}{
		{`up`, []string{"up"}},
		{`meshrelay_keys{namespace="$namespace", job=~"$job"}`, []string{"meshrelay_keys"}},
		{`sum by (pod) (meshrelay_xds_clients{namespace="a"})`, []string{"meshrelay_xds_clients"}},
		{`sum(rate(x_total[5m])) without (instance, le)`, []string{"x_total"}},
		{`histogram_quantile(0.99, sum by (le) (rate(h_seconds_bucket{a="b"}[$__rate_interval])))`, []string{"h_seconds_bucket"}},
		{`a / on(pod) group_left(node) b > bool 1e3`, []string{"a", "b"}},
		{`sum(a) > sum by (namespace, job) (b{source="upstream"}) or vector(0)`, []string{"a", "b"}},
		{`max_over_time(a[1h:5m] offset 1h30m) and ignoring (x) c`, []string{"a", "c"}},
		{`count(x{l="sum(y) by (z)"}) unless z`, []string{"x", "z"}},
		{`clamp_min(sum(a), 1) * ${factor} + $other - 0x1f`, []string{"a"}},
		{`topk(5, a:recorded:rate5m) # comment names_this`, []string{"a:recorded:rate5m"}},
		{`a{l='it\'s'} + a`, []string{"a"}},
		{`SUM BY (le) (a) AND b`, []string{"a", "b"}},
		{`+Inf < NaN`, nil},
	}
	for _, tt := range tests {
		t.Run(tt.expr, func(t *testing.T) {
			got, err := metricNames(tt.expr)
			if err != nil || !slices.Equal(got, tt.want) {
				t.Errorf("metricNames(%q) = %q, %v, want %q", tt.expr, got, err, tt.want)
			}
		})
	}
	for _, bad := range []string{`a{l="x}`, `sum(a`, `a[5m`} {
		if _, err := metricNames(bad); err == nil {
			t.Errorf("metricNames(%q) = nil error, want one", bad)
		}
	}
}
