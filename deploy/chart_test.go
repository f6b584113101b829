package deploy

// The Helm chart is checked here with Helm's own Go packages (pinned in
// go.mod), so `go test ./...` lints and renders it with no helm binary:
// helm lint and helm template for the default values and each ci/*.yaml,
// every rendered object decoded strictly with the Kubernetes API's (and
// the Prometheus Operator's) Go types, the default render against a
// golden file, and the plain manifests generated from the chart.

import (
	"bytes"
	"encoding/base64"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"sigs.k8s.io/yaml"
)

var update = flag.Bool("update", false, "rewrite the files generated from the chart (testdata/chart-default.yaml, kubernetes/*.yaml, prometheus/meshrelay.rules.yml)")

const (
	chartDir    = "helm/meshrelay"
	releaseName = "meshrelay"
	namespace   = "istio-system"
	regenerate  = "go test ./deploy -run TestChart -update"
)

// kubeVersion is the cluster the chart is rendered for: the oldest it
// supports (preStop's sleep action).
var kubeVersion = chartutil.KubeVersion{Version: "v1.30.0", Major: "1", Minor: "30"}

// kinds maps each kind the chart may render to its apiVersion and a new
// object of its Go type.
var kinds = map[string]struct {
	apiVersion string
	new        func() any
}{
	"Deployment":              {"apps/v1", func() any { return &appsv1.Deployment{} }},
	"StatefulSet":             {"apps/v1", func() any { return &appsv1.StatefulSet{} }},
	"Service":                 {"v1", func() any { return &corev1.Service{} }},
	"ConfigMap":               {"v1", func() any { return &corev1.ConfigMap{} }},
	"ServiceAccount":          {"v1", func() any { return &corev1.ServiceAccount{} }},
	"Secret":                  {"v1", func() any { return &corev1.Secret{} }},
	"ClusterRole":             {"rbac.authorization.k8s.io/v1", func() any { return &rbacv1.ClusterRole{} }},
	"ClusterRoleBinding":      {"rbac.authorization.k8s.io/v1", func() any { return &rbacv1.ClusterRoleBinding{} }},
	"PodDisruptionBudget":     {"policy/v1", func() any { return &policyv1.PodDisruptionBudget{} }},
	"HorizontalPodAutoscaler": {"autoscaling/v2", func() any { return &autoscalingv2.HorizontalPodAutoscaler{} }},
	"NetworkPolicy":           {"networking.k8s.io/v1", func() any { return &networkingv1.NetworkPolicy{} }},
	"ServiceMonitor":          {"monitoring.coreos.com/v1", func() any { return &monitoringv1.ServiceMonitor{} }},
	"PrometheusRule":          {"monitoring.coreos.com/v1", func() any { return &monitoringv1.PrometheusRule{} }},
	"Certificate":             {"cert-manager.io/v1", func() any { return &certificate{} }},
}

// rendered is one object of a render.
type rendered struct {
	source string // the template it came from
	kind   string
	name   string
	doc    string // its YAML as rendered
	hook   bool
	obj    any // decoded into its Go type
}

// valueSet is a named set of values: the defaults, or a ci/*.yaml file.
type valueSet struct {
	name   string
	values map[string]any
}

func valueSets(t *testing.T) []valueSet {
	t.Helper()
	sets := []valueSet{{"default", map[string]any{}}}
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no ci/*.yaml value sets: %v", err)
	}
	for _, f := range files {
		vals, err := chartutil.ReadValuesFile(f)
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		sets = append(sets, valueSet{strings.TrimSuffix(filepath.Base(f), ".yaml"), vals})
	}
	return sets
}

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatalf("load %s: %v", chartDir, err)
	}
	return c
}

// render is helm template: the chart with vals, in namespace istio-system,
// as an install, for a cluster with the Prometheus Operator's CRDs when
// operator is set. Objects come in Helm's install order, hooks first.
func render(t *testing.T, c *chart.Chart, vals map[string]any, operator bool) []rendered {
	t.Helper()
	return renderRelease(t, c, vals, operatorAPIs(operator), chartutil.ReleaseOptions{Name: releaseName, Namespace: namespace, IsInstall: true, Revision: 1})
}

// operatorAPIs are the Prometheus Operator's API versions if operator.
func operatorAPIs(operator bool) []string {
	if !operator {
		return nil
	}
	return []string{"monitoring.coreos.com/v1", "monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PrometheusRule"}
}

// renderRelease is render for the release opts describes (an upgrade:
// IsUpgrade), on a cluster that also serves the API versions apis.
func renderRelease(t *testing.T, c *chart.Chart, vals map[string]any, apis []string, opts chartutil.ReleaseOptions) []rendered {
	t.Helper()
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = kubeVersion
	caps.APIVersions = append(slices.Clone(caps.APIVersions), apis...)
	rv, err := chartutil.ToRenderValues(c, vals, opts, caps)
	if err != nil {
		t.Fatalf("values: %v", err)
	}
	files, err := engine.Render(c, rv)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	for name := range files {
		if strings.HasSuffix(name, "NOTES.txt") {
			if strings.TrimSpace(files[name]) == "" {
				t.Errorf("%s renders empty", name)
			}
			delete(files, name)
		}
	}
	hooks, manifests, err := releaseutil.SortManifests(files, caps.APIVersions, releaseutil.InstallOrder)
	if err != nil {
		t.Fatalf("sort: %v", err)
	}
	var out []rendered
	for _, h := range hooks {
		out = append(out, rendered{source: h.Path, kind: h.Kind, name: h.Name, doc: h.Manifest, hook: true})
	}
	for _, m := range manifests {
		out = append(out, rendered{source: m.Name, kind: m.Head.Kind, name: m.Head.Metadata.Name, doc: m.Content})
	}
	for i := range out {
		r := &out[i]
		k, ok := kinds[r.kind]
		if !ok {
			t.Fatalf("%s: kind %q: add it to kinds in this test", r.source, r.kind)
		}
		var head struct {
			APIVersion string `json:"apiVersion"`
		}
		if err := yaml.Unmarshal([]byte(r.doc), &head); err != nil || head.APIVersion != k.apiVersion {
			t.Errorf("%s %s: apiVersion %q, want %q (%v)", r.kind, r.name, head.APIVersion, k.apiVersion, err)
		}
		r.obj = k.new()
		if err := yaml.UnmarshalStrict([]byte(r.doc), r.obj); err != nil {
			t.Errorf("%s %s (%s) does not decode strictly: %v", r.kind, r.name, r.source, err)
		}
	}
	return out
}

// TestChartLint is helm lint for each value set: no warning or error.
func TestChartLint(t *testing.T) {
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) {
			l := lint.AllWithKubeVersion(chartDir, vs.values, namespace, &kubeVersion)
			for _, m := range l.Messages {
				if m.Severity >= support.WarningSev {
					t.Errorf("helm lint: %v", m)
				}
			}
		})
	}
}

// TestChartRenders is helm template for each value set, with and without
// the Prometheus Operator: every object decodes strictly, and the
// Deployment hangs together.
func TestChartRenders(t *testing.T) {
	c := loadChart(t)
	flags := relayFlags(t)
	for _, vs := range valueSets(t) {
		for _, operator := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/operator=%t", vs.name, operator), func(t *testing.T) {
				objs := render(t, c, vs.values, operator)
				checkTier(t, objs, flags)
				has := func(kind string) bool {
					return slices.ContainsFunc(objs, func(r rendered) bool { return r.kind == kind })
				}
				if has("ServiceMonitor") != operator || has("PrometheusRule") != operator {
					t.Errorf("ServiceMonitor %t, PrometheusRule %t: want them exactly when the Operator's CRDs are there (%t)", has("ServiceMonitor"), has("PrometheusRule"), operator)
				}
			})
		}
	}
}

// relayFlags are the flags `meshrelay serve` defines, read from its source
// (package main cannot be imported).
func relayFlags(t *testing.T) map[string]bool {
	t.Helper()
	files, err := filepath.Glob("../cmd/meshrelay/*.go")
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`fs\.(?:String|Bool|Int|Float64|Duration)(?:Var)?\((?:&[\w.]+, )?"([a-z0-9-]+)"`)
	flags := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range re.FindAllSubmatch(b, -1) {
			flags[string(m[1])] = true
		}
	}
	for _, f := range []string{"upstream", "xds-tls-cert", "drain-period", "etcd-endpoints", "peer-identity"} {
		if !flags[f] {
			t.Fatalf("reading the flags of cmd/meshrelay found no --%s: fix relayFlags", f)
		}
	}
	return flags
}

// checkTier checks what must hold for any values: flags the relay has,
// files mounted, ports opened, the drain inside the grace period, Services
// and the PDB selecting the relays, generated keys well formed.
func checkTier(t *testing.T, objs []rendered, relayFlags map[string]bool) {
	t.Helper()
	var dep *appsv1.Deployment
	accounts := map[string]bool{}
	for _, r := range objs {
		switch o := r.obj.(type) {
		case *appsv1.Deployment:
			if dep != nil {
				t.Fatalf("two Deployments")
			}
			dep = o
		case *corev1.ServiceAccount:
			accounts[o.Name] = true
		case *corev1.Secret:
			if r.hook {
				checkGeneratedKey(t, o)
			}
		}
	}
	if dep == nil {
		t.Fatal("no Deployment")
	}
	pod := dep.Spec.Template.Spec
	if !accounts[pod.ServiceAccountName] {
		t.Errorf("ServiceAccount %q is not in the chart", pod.ServiceAccountName)
	}
	c := pod.Containers[0]
	if c.Args[0] != "serve" {
		t.Errorf("args %q: want serve first", c.Args)
	}
	flags := map[string]string{}
	for _, a := range c.Args[1:] {
		k, v, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !relayFlags[k] {
			t.Errorf("%s: meshrelay serve has no such flag", a)
		}
		if _, dup := flags[k]; dup {
			t.Errorf("--%s given twice", k)
		}
		flags[k] = v
	}
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		mounts[m.MountPath] = m.Name
	}
	volumes := map[string]bool{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = true
	}
	for _, m := range c.VolumeMounts {
		if !volumes[m.Name] {
			t.Errorf("mount %s: no volume %s", m.MountPath, m.Name)
		}
	}
	for k, v := range flags {
		if strings.HasSuffix(k, "-file") || strings.HasSuffix(k, "-cert") || strings.HasSuffix(k, "-key") || strings.HasSuffix(k, "-ca") || strings.HasSuffix(k, "-config") {
			if dir := filepath.Dir(v); mounts[dir] == "" {
				t.Errorf("--%s=%s: no volume mounted at %s", k, v, dir)
			}
		}
	}
	ports := map[int32]bool{}
	for _, p := range c.Ports {
		ports[p.ContainerPort] = true
	}
	for _, k := range []string{"xds-listen", "xds-tls-listen", "peer-listen", "admin-listen", "gossip-listen"} {
		if v, ok := flags[k]; ok {
			var port int32
			if _, err := fmt.Sscanf(strings.TrimPrefix(v, ":"), "%d", &port); err != nil || !ports[port] {
				t.Errorf("--%s=%s: not a container port", k, v)
			}
		}
	}
	// Gossip advertises the pod's IP (POD_IP, from the downward API) on
	// the gossip port.
	if v, ok := flags["gossip-listen"]; ok {
		if want := "$(POD_IP)" + v[strings.LastIndex(v, ":"):]; flags["gossip-advertise"] != want {
			t.Errorf("--gossip-advertise=%q, want %q", flags["gossip-advertise"], want)
		}
		if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool {
			return e.Name == "POD_IP" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.podIP"
		}) {
			t.Errorf("no POD_IP from status.podIP for --gossip-advertise")
		}
	}
	if sc := c.SecurityContext; sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("the relay's securityContext %+v: want seccompProfile RuntimeDefault", sc)
	}
	for _, r := range objs {
		if ss, ok := r.obj.(*appsv1.StatefulSet); ok {
			checkTrialEtcd(t, ss)
		}
	}
	wantScheme := corev1.URISchemeHTTP
	if flags["admin-tls-cert"] != "" {
		wantScheme = corev1.URISchemeHTTPS
	}
	for name, p := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Scheme != wantScheme || p.HTTPGet.Port.IntVal != 15014 {
			t.Errorf("%s probe %+v: want %s on the admin port", name, p, wantScheme)
		}
	}
	if c.ReadinessProbe.HTTPGet.Path != "/readyz" || c.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("probes on %s and %s, want /readyz and /healthz", c.ReadinessProbe.HTTPGet.Path, c.LivenessProbe.HTTPGet.Path)
	}
	// SIGTERM comes after preStop; the relay then drains over
	// --drain-period and allows itself 15 s more to stop.
	var drain, preStop int64
	if _, err := fmt.Sscanf(flags["drain-period"], "%ds", &drain); err != nil {
		t.Errorf("--drain-period=%s: %v", flags["drain-period"], err)
	}
	if c.Lifecycle != nil && c.Lifecycle.PreStop != nil && c.Lifecycle.PreStop.Sleep != nil {
		preStop = c.Lifecycle.PreStop.Sleep.Seconds
	}
	if g := pod.TerminationGracePeriodSeconds; g == nil || *g <= preStop+drain+15 {
		t.Errorf("terminationGracePeriodSeconds %v: want more than preStop %d + drain %d + 15", g, preStop, drain)
	}
	if _, ok := c.Resources.Limits[corev1.ResourceMemory]; ok && flags["memory-limit-ratio"] == "0" {
		t.Errorf("a memory limit without GOMEMLIMIT from it (--memory-limit-ratio=0)")
	}
	sel := dep.Spec.Selector.MatchLabels
	for k, v := range sel {
		if dep.Spec.Template.Labels[k] != v {
			t.Errorf("the pods lack selector label %s=%s", k, v)
		}
	}
	var gossipSvc, xdsSvc bool
	servicePorts := map[string]int32{}
	var monitors []*monitoringv1.ServiceMonitor
	for _, r := range objs {
		switch o := r.obj.(type) {
		case *corev1.Service:
			if o.Name == dep.Name+"-etcd" {
				continue
			}
			if !equalLabels(o.Spec.Selector, sel) {
				t.Errorf("Service %s selects %v, the relays are %v", o.Name, o.Spec.Selector, sel)
			}
			// Istio picks a port's protocol by its name's prefix: a TLS
			// port named grpc- or http- is taken for plaintext.
			for _, p := range o.Spec.Ports {
				var want string
				switch {
				case p.Port == 15012:
					want = "tls-"
				case p.Port == 15014 && flags["admin-tls-cert"] != "":
					want = "https-"
				case p.Port == 15014:
					want = "http-"
				case p.Port == 15010:
					want = "grpc-"
				default:
					continue
				}
				if !strings.HasPrefix(p.Name, want) {
					t.Errorf("Service %s port %d is named %q: want %s… for Istio's protocol selection", o.Name, p.Port, p.Name, want)
				}
				servicePorts[p.Name] = p.Port
			}
			if o.Spec.ClusterIP == corev1.ClusterIPNone {
				gossipSvc = o.Spec.PublishNotReadyAddresses && strings.HasPrefix(flags["join"], o.Name+"."+o.Namespace+".svc")
			} else {
				for _, p := range o.Spec.Ports {
					xdsSvc = xdsSvc || (p.Port == 15012 || p.Port == 15010) && ports[p.TargetPort.IntVal]
				}
			}
		case *monitoringv1.ServiceMonitor:
			monitors = append(monitors, o)
		case *monitoringv1.PrometheusRule:
			// The ServiceMonitor's scrapes get the Service's name as their
			// job: MeshrelayDown must watch that job.
			var down string
			for _, g := range o.Spec.Groups {
				for _, rule := range g.Rules {
					if rule.Alert == "MeshrelayDown" {
						down = rule.Expr.String()
					}
				}
			}
			if want := fmt.Sprintf(`up{job="%s"} == 0`, dep.Name); down != want {
				t.Errorf("MeshrelayDown is %q, want %q", down, want)
			}
		case *policyv1.PodDisruptionBudget:
			if !equalLabels(o.Spec.Selector.MatchLabels, sel) {
				t.Errorf("PodDisruptionBudget selects %v, the relays are %v", o.Spec.Selector.MatchLabels, sel)
			}
		case *autoscalingv2.HorizontalPodAutoscaler:
			// With no live Deployment to keep the count of, the autoscaler's
			// minimum: replicas left out would default to 1.
			if o.Spec.ScaleTargetRef.Name != dep.Name || dep.Spec.Replicas == nil || o.Spec.MinReplicas == nil || *dep.Spec.Replicas != *o.Spec.MinReplicas {
				t.Errorf("the autoscaler scales %s, and the Deployment sets replicas %v: want %s, minReplicas %v", o.Spec.ScaleTargetRef.Name, ptrString(dep.Spec.Replicas), dep.Name, ptrString(o.Spec.MinReplicas))
			}
		}
	}
	if !gossipSvc {
		t.Errorf("no headless Service publishing not-ready relays under --join=%s", flags["join"])
	}
	for _, m := range monitors {
		for _, e := range m.Spec.Endpoints {
			if servicePorts[e.Port] != 15014 {
				t.Errorf("ServiceMonitor %s scrapes port %q: the Service's admin port is not named so (%v)", m.Name, e.Port, servicePorts)
			}
		}
	}
	if !xdsSvc {
		t.Errorf("no Service sends an xDS port to the relays")
	}
}

func equalLabels(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// checkGeneratedKey: a key the chart generates is what the relay reads,
// base64 of 32 bytes.
func checkGeneratedKey(t *testing.T, s *corev1.Secret) {
	t.Helper()
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(string(s.Data["key"])))
	if err != nil || len(raw) != 32 {
		t.Errorf("Secret %s: key %q is not base64 of 32 bytes (%d bytes, %v)", s.Name, s.Data["key"], len(raw), err)
	}
	// Before upgrades too: an upgrade that adds etcd, or clears an
	// existingSecret, is the first to need the Secret. The template keeps
	// the key it finds (lookup), so the hook writes the same key again.
	if s.Annotations["helm.sh/hook"] != "pre-install,pre-upgrade" {
		t.Errorf("Secret %s: hook %q, want pre-install,pre-upgrade: an upgrade that first needs it would mount a Secret never made", s.Name, s.Annotations["helm.sh/hook"])
	}
}

// TestChartUpgradeMountsSecrets: rendered as an upgrade, every Secret the
// Deployment mounts is in the render (a generated key, a cert-manager
// Certificate's Secret) or one the values name or the docs say to create;
// in particular an upgrade that adds etcd, or clears an existingSecret,
// renders the key it now mounts.
func TestChartUpgradeMountsSecrets(t *testing.T) {
	c := loadChart(t)
	sets := valueSets(t)
	sets = append(sets,
		valueSet{"upgrade adds etcd", map[string]any{"etcd": map[string]any{"endpoints": []any{"https://etcd:2379"}}}},
		valueSet{"upgrade adds the trial etcd", map[string]any{"etcd": map[string]any{"inCluster": map[string]any{"enabled": true}}}},
		valueSet{"upgrade clears existingSecret", map[string]any{
			"tier": map[string]any{"gossipKey": map[string]any{"existingSecret": ""}},
			"etcd": map[string]any{"endpoints": []any{"https://etcd:2379"}, "sealKey": map[string]any{"existingSecret": ""}},
		}},
	)
	for _, vs := range sets {
		t.Run(vs.name, func(t *testing.T) {
			objs := renderRelease(t, c, vs.values, operatorAPIs(true), chartutil.ReleaseOptions{Name: releaseName, Namespace: namespace, IsUpgrade: true, Revision: 2})
			made := map[string]bool{}
			var dep *appsv1.Deployment
			for _, r := range objs {
				switch o := r.obj.(type) {
				case *corev1.Secret:
					// A hook is rendered for every release but run only for
					// the events it names: this one must run before the
					// upgrade's Deployment.
					hooks := strings.Split(o.Annotations["helm.sh/hook"], ",")
					made[o.Name] = !r.hook || slices.Contains(hooks, "pre-upgrade")
				case *certificate:
					made[o.Spec.SecretName] = true
				case *appsv1.Deployment:
					dep = o
				}
			}
			if dep == nil {
				t.Fatal("no Deployment")
			}
			// Secrets the values name, and the certificates deploy/README.md
			// says to create by hand without cert-manager.
			named := map[string]bool{}
			for _, path := range [][]string{
				{"tier", "gossipKey", "existingSecret"}, {"etcd", "sealKey", "existingSecret"},
				{"xds", "tls", "secretName"}, {"tier", "peerSecretName"},
				{"etcd", "tls", "secretName"}, {"etcd", "auth", "passwordSecret"},
			} {
				if v, _ := lookupValue(vs.values, path...).(string); v != "" {
					named[v] = true
				}
			}
			if lookupValue(vs.values, "certManager", "enabled") != true {
				named[dep.Name+"-xds-tls"], named[dep.Name+"-peer-tls"] = true, true
			}
			for _, v := range dep.Spec.Template.Spec.Volumes {
				if v.Secret == nil {
					continue
				}
				if !made[v.Secret.SecretName] && !named[v.Secret.SecretName] {
					t.Errorf("volume %s mounts Secret %s: an upgrade neither renders it nor do the values name it", v.Name, v.Secret.SecretName)
				}
			}
		})
	}
}

// lookupValue is the value at path in vals, or nil.
func lookupValue(vals map[string]any, path ...string) any {
	var v any = vals
	for _, k := range path {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

// TestChartRevisions: a revision's tier shares no object and no pod with
// the default tier's, and gossips under another cluster name.
func TestChartRevisions(t *testing.T) {
	c := loadChart(t)
	def := render(t, c, map[string]any{}, true)
	canary := render(t, c, map[string]any{"revision": "canary"}, true)
	names := map[string]bool{}
	for _, r := range def {
		names[r.kind+"/"+r.name] = true
	}
	for _, r := range canary {
		if names[r.kind+"/"+r.name] {
			t.Errorf("%s %s is in both tiers", r.kind, r.name)
		}
	}
	dep := func(objs []rendered) *appsv1.Deployment {
		for _, r := range objs {
			if d, ok := r.obj.(*appsv1.Deployment); ok {
				return d
			}
		}
		t.Fatal("no Deployment")
		return nil
	}
	a, b := dep(def), dep(canary)
	if equalLabels(a.Spec.Selector.MatchLabels, b.Spec.Template.Labels) || equalLabels(b.Spec.Selector.MatchLabels, a.Spec.Template.Labels) {
		t.Errorf("selectors %v and %v overlap", a.Spec.Selector.MatchLabels, b.Spec.Selector.MatchLabels)
	}
	for k, v := range a.Spec.Selector.MatchLabels {
		if b.Spec.Template.Labels[k] == v {
			t.Errorf("the canary's pods carry the default tier's selector label %s=%s", k, v)
		}
	}
	if b.Spec.Template.Labels["istio.io/rev"] != "canary" || a.Spec.Template.Labels["istio.io/rev"] != "default" {
		t.Errorf("istio.io/rev labels %q and %q, want default and canary", a.Spec.Template.Labels["istio.io/rev"], b.Spec.Template.Labels["istio.io/rev"])
	}
	cluster := func(d *appsv1.Deployment) string {
		for _, a := range d.Spec.Template.Spec.Containers[0].Args {
			if v, ok := strings.CutPrefix(a, "--cluster="); ok {
				return v
			}
		}
		return ""
	}
	if cluster(a) == cluster(b) {
		t.Errorf("both tiers gossip as --cluster=%s: they would merge", cluster(a))
	}
}

// TestChartGenerated: the golden default render, and the files generated
// from the chart, are what the chart renders now.
func TestChartGenerated(t *testing.T) {
	c := loadChart(t)

	// The default values, on a cluster with the Prometheus Operator.
	def := render(t, c, map[string]any{}, true)
	golden(t, "testdata/chart-default.yaml", helmTemplate(def))

	// The alerting rules as a Prometheus rule file.
	for _, r := range def {
		if rule, ok := r.obj.(*monitoringv1.PrometheusRule); ok {
			b, err := yaml.Marshal(rule.Spec)
			if err != nil {
				t.Fatal(err)
			}
			golden(t, "prometheus/meshrelay.rules.yml", append([]byte(rulesHeader), b...))
		}
	}

	// The plain manifests: the chart with ci/plain.yaml, no Operator.
	plainVals, err := chartutil.ReadValuesFile(filepath.Join(chartDir, "ci", "plain.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var tier, certs []rendered
	for _, r := range render(t, c, plainVals, false) {
		if r.hook {
			t.Errorf("the plain manifest would hold hook %s %s: name an existing Secret in ci/plain.yaml", r.kind, r.name)
		}
		tier = append(tier, r)
	}
	plainVals["certManager"] = map[string]any{"enabled": true}
	for _, r := range render(t, c, plainVals, false) {
		if r.kind == "Certificate" {
			certs = append(certs, r)
		}
	}
	if len(certs) != 2 {
		t.Fatalf("%d Certificates with certManager.enabled, want 2", len(certs))
	}
	golden(t, "kubernetes/meshrelay.yaml", plain(tierHeader, tier))
	golden(t, "kubernetes/certificates.yaml", plain(certsHeader, certs))
}

// helmTemplate prints objects as helm template does; generated keys are
// replaced by a placeholder (they are random).
func helmTemplate(objs []rendered) []byte {
	var b bytes.Buffer
	for _, r := range objs {
		doc := r.doc
		if r.kind == "Secret" && r.hook {
			doc = regexp.MustCompile(`(?m)^(  key: ).*$`).ReplaceAllString(doc, "${1}<generated: 32 random bytes, base64>")
		}
		fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", r.source, strings.TrimSpace(doc))
	}
	return b.Bytes()
}

// plain joins objects into a manifest for kubectl apply.
func plain(header string, objs []rendered) []byte {
	docs := make([]string, len(objs))
	for i, r := range objs {
		docs[i] = strings.TrimSpace(r.doc)
	}
	return []byte(header + "\n" + strings.Join(docs, "\n---\n") + "\n")
}

// golden compares got with the file at path, or writes it with -update.
func golden(t *testing.T, path string, got []byte) {
	t.Helper()
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v: generate it with %s", err, regenerate)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("deploy/%s differs from what the chart renders (first difference at line %d): if the chart is right, run %s and commit the result", path, firstDiff(got, want), regenerate)
	}
}

func firstDiff(a, b []byte) int {
	la, lb := strings.Split(string(a), "\n"), strings.Split(string(b), "\n")
	for i := range min(len(la), len(lb)) {
		if la[i] != lb[i] {
			return i + 1
		}
	}
	return min(len(la), len(lb)) + 1
}

const generatedBy = "# Generated from the Helm chart deploy/helm/meshrelay by\n#   " + regenerate + "\n# Do not edit: change the chart (or its ci/plain.yaml) and regenerate.\n"

const tierHeader = generatedBy + `#
# A tier of meshrelay relays as a drop-in for istiod's port 15012: sidecars
# dial it with TLS and their service-account JWT, as they dial istiod; each
# stream's identity must match its node (istiod's own rule), and each key's
# stream to istiod presents one of its sidecars' own tokens (forward mode),
# so istiod needs no change. Point istio-agent's discoveryAddress at
# meshrelay.istio-system.svc:15012 (deploy/ISTIO.md).
# The relays find each other through the meshrelay-gossip headless Service,
# talk on an mTLS peer port (15011) with the tier's SPIFFE ID, and share key
# ownership: istiod sees one stream per key across replicas.
#
# Before applying, create:
# - the gossip key (encrypts gossip):
#     kubectl -n istio-system create secret generic meshrelay-gossip \
#       --from-literal=key=$(openssl rand -base64 32)
# - the seal key (encrypts Secret resources in etcd):
#     kubectl -n istio-system create secret generic meshrelay-seal \
#       --from-literal=key="$(head -c32 /dev/urandom | base64)"
# - the Secrets meshrelay-xds-tls (serving certificate for
#   meshrelay.istio-system.svc, signed by the mesh CA) and meshrelay-peer-tls
#   (the tier's certificate, URI SAN
#   spiffe://cluster.local/ns/istio-system/sa/meshrelay): certificates.yaml
#   makes both with cert-manager, or see deploy/README.md;
# - an etcd cluster at meshrelay-etcd.istio-system.svc:2379 (or remove the
#   --etcd-…, --snapshot-… flags and the seal-key volume to start cold).
# The mesh root comes from the istio-ca-root-cert ConfigMap istiod writes
# in every namespace. The Helm chart makes the keys itself.
`

const certsHeader = generatedBy + `#
# The relays' certificates, by cert-manager (https://cert-manager.io), from
# an Issuer of the mesh CA: sidecars check the relay's serving certificate
# against the mesh root (or XDS_ROOT_CA), so it must chain to it. With
# istio-csr or a plugged-in CA (cacerts) managed by cert-manager, name that
# issuer (the chart's certManager.issuerRef); otherwise create the two
# Secrets by hand (deploy/README.md). cert-manager renews them before they
# expire; the relays pick the new files up at the next handshake, without
# dropping a stream.
`

const rulesHeader = generatedBy + `#
# meshrelay's alerts as a Prometheus rule file (rule_files:), the spec of
# the chart's PrometheusRule; deploy/ISTIO.md, "What to alert on", explains
# them.
`

// TestChartRefuses: values.schema.json and the templates' checks turn
// away values that would install a tier that cannot work.
func TestChartRefuses(t *testing.T) {
	c := loadChart(t)
	tests := []struct {
		name    string
		values  map[string]any
		wantErr string
	}{
		{"misspelt value", map[string]any{"replicaCout": 3}, "replicaCout"},
		{"unknown upstream mode", map[string]any{"upstream": map[string]any{"auth": "sudo"}}, "auth"},
		{"revision not a DNS label", map[string]any{"revision": "Canary_1"}, "revision"},
		{"forward without a TLS port", map[string]any{"xds": map[string]any{"tls": map[string]any{"enabled": false}, "plaintext": map[string]any{"enabled": true}}, "admin": map[string]any{"tls": false}}, "needs xds.tls.enabled"},
		{"forward with mtls only", map[string]any{"xds": map[string]any{"tls": map[string]any{"auth": "mtls"}}}, "use relay-identity"},
		{"admin TLS without a certificate", map[string]any{"upstream": map[string]any{"auth": "plaintext"}, "xds": map[string]any{"tls": map[string]any{"enabled": false}, "plaintext": map[string]any{"enabled": true}}}, "admin.tls"},
		{"no xDS port", map[string]any{"upstream": map[string]any{"auth": "plaintext"}, "admin": map[string]any{"tls": false}, "xds": map[string]any{"tls": map[string]any{"enabled": false}}}, "no xDS port"},
		{"negative upstream stream rate", map[string]any{"upstreamStreamRate": -1}, "upstreamStreamRate"},
		{"divergence interval not a duration", map[string]any{"divergenceInterval": "ten minutes"}, "divergenceInterval"},
		{"fields without fields", map[string]any{"keyProfile": "fields"}, "needs keyFields or keyConfig"},
		{"fields two ways", map[string]any{"keyProfile": "fields", "keyFields": []any{"cluster"}, "keyConfig": map[string]any{"rules": []any{map[string]any{"name": "all", "match": map[string]any{"id": ".*"}, "key": []any{"cluster"}}}}}, "give one"},
		{"key fields for istio", map[string]any{"keyFields": []any{"cluster"}}, "for keyProfile fields"},
		{"key config for per-node", map[string]any{"keyProfile": "per-node", "keyConfig": map[string]any{"rules": []any{}}}, "for keyProfile fields"},
		{"key metadata for fields", map[string]any{"keyProfile": "fields", "keyFields": []any{"cluster"}, "keyMetadata": []any{"FOO"}}, "keyMetadata is for keyProfile istio"},
		{"key metadata for per-node", map[string]any{"keyProfile": "per-node", "keyMetadata": []any{"FOO"}}, "keyMetadata is for keyProfile istio"},
		{"unknown key profile", map[string]any{"keyProfile": "pernode"}, "keyProfile"},
		{"admin TLS with xds auth none", map[string]any{"upstream": map[string]any{"auth": "relay-identity"}, "xds": map[string]any{"tls": map[string]any{"auth": "none"}}}, "xds.tls.auth none"},
		{"etcd prefix without a trailing slash", map[string]any{"etcd": map[string]any{"prefix": "/meshrelay"}}, "prefix"},
		{"etcd prefix without a leading slash", map[string]any{"etcd": map[string]any{"prefix": "meshrelay/"}}, "prefix"},
		{"trial etcd storage not in Mi or Gi", map[string]any{"etcd": map[string]any{"inCluster": map[string]any{"enabled": true, "storage": "4G"}}}, "storage"},
		{"etcd user without a password", map[string]any{"etcd": map[string]any{"endpoints": []any{"https://etcd:2379"}, "auth": map[string]any{"user": "meshrelay"}}}, "passwordSecret"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			caps := chartutil.DefaultCapabilities.Copy()
			caps.KubeVersion = kubeVersion
			rv, err := chartutil.ToRenderValues(c, tt.values, chartutil.ReleaseOptions{Name: releaseName, Namespace: namespace, IsInstall: true}, caps)
			if err == nil {
				_, err = engine.Render(c, rv)
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("rendering with %v: error %v, want one containing %q", tt.values, err, tt.wantErr)
			}
		})
	}
}

// renderNotes is NOTES.txt as an install with vals prints it.
func renderNotes(t *testing.T, c *chart.Chart, vals map[string]any) string {
	t.Helper()
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = kubeVersion
	rv, err := chartutil.ToRenderValues(c, vals, chartutil.ReleaseOptions{Name: releaseName, Namespace: namespace, IsInstall: true, Revision: 1}, caps)
	if err != nil {
		t.Fatalf("values: %v", err)
	}
	files, err := engine.Render(c, rv)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	for name, f := range files {
		if strings.HasSuffix(name, "NOTES.txt") {
			return f
		}
	}
	t.Fatal("no NOTES.txt")
	return ""
}

// TestChartNotes: the annotation NOTES.txt prints does not pin CA_ADDR
// (the injection sets it: istiod[-rev].<ns>.svc or global.caAddress), and
// the istiod it names is the tier's upstream, not a hard-coded one.
func TestChartNotes(t *testing.T) {
	c := loadChart(t)
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) {
			notes := renderNotes(t, c, vs.values)
			if regexp.MustCompile(`(?m)^\s+CA_ADDR:`).MatchString(notes) {
				t.Errorf("NOTES.txt pins CA_ADDR:\n%s", notes)
			}
			upstream, _ := lookupValue(vs.values, "upstream", "address").(string)
			if upstream == "" {
				upstream = "istiod.istio-system.svc:15012"
			}
			host, _, _ := strings.Cut(upstream, ":")
			if !strings.Contains(notes, host+":15012") {
				t.Errorf("NOTES.txt does not name the upstream's CA %s:15012:\n%s", host, notes)
			}
			// istioctl authenticates to the relay as default/default, which
			// sees namespace default only: NOTES.txt must not offer it as
			// the way to watch the tier.
			if strings.Contains(notes, "istioctl proxy-status") && !strings.Contains(notes, "namespace default only") {
				t.Errorf("NOTES.txt offers istioctl proxy-status without saying it sees namespace default only:\n%s", notes)
			}
			if !strings.Contains(notes, "relayctl") || !strings.Contains(notes, "proxy-status") {
				t.Errorf("NOTES.txt does not point to relayctl proxy-status:\n%s", notes)
			}
			if host != "istiod.istio-system.svc" && strings.Contains(notes, "istiod.istio-system.svc") {
				t.Errorf("NOTES.txt names istiod.istio-system.svc, the upstream is %s:\n%s", upstream, notes)
			}
		})
	}
}

// relayArgs are the Deployment's flags to meshrelay serve, by name.
func relayArgs(t *testing.T, objs []rendered) map[string]string {
	t.Helper()
	for _, r := range objs {
		if d, ok := r.obj.(*appsv1.Deployment); ok {
			flags := map[string]string{}
			for _, a := range d.Spec.Template.Spec.Containers[0].Args[1:] {
				k, v, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
				flags[k] = v
			}
			return flags
		}
	}
	t.Fatal("no Deployment")
	return nil
}

// TestChartUpstreamStreamRate: each relay paces its streams to istiod at
// upstreamStreamRate, 50/s unless set; 0 lifts the bound.
func TestChartUpstreamStreamRate(t *testing.T) {
	c := loadChart(t)
	for _, tt := range []struct {
		values map[string]any
		want   string
	}{
		{map[string]any{}, "50"},
		{map[string]any{"upstreamStreamRate": 12.5}, "12.5"},
		{map[string]any{"upstreamStreamRate": 0}, "0"},
	} {
		if got := relayArgs(t, render(t, c, tt.values, false))["upstream-stream-rate"]; got != tt.want {
			t.Errorf("with %v: --upstream-stream-rate=%q, want %q", tt.values, got, tt.want)
		}
	}
}

// TestChartDivergenceInterval: each relay checks its keys every
// divergenceInterval, 10m unless set; "0s" turns the checks off.
func TestChartDivergenceInterval(t *testing.T) {
	c := loadChart(t)
	for _, tt := range []struct {
		values map[string]any
		want   string
	}{
		{map[string]any{}, "10m"},
		{map[string]any{"divergenceInterval": "1h30m"}, "1h30m"},
		{map[string]any{"divergenceInterval": "0s"}, "0s"},
	} {
		got := relayArgs(t, render(t, c, tt.values, false))["divergence-interval"]
		if got != tt.want {
			t.Errorf("with %v: --divergence-interval=%q, want %q", tt.values, got, tt.want)
		}
		if _, err := time.ParseDuration(got); err != nil {
			t.Errorf("with %v: --divergence-interval=%q: %v", tt.values, got, err)
		}
	}
}

// TestChartKeyProfiles: keyProfile fields renders both ways, by keyFields
// and by keyConfig (a ConfigMap, mounted where --key-config points), and
// keyMetadata with istio; the flags pass the flag check and what the
// relay would parse, parses.
func TestChartKeyProfiles(t *testing.T) {
	c := loadChart(t)
	flags := relayFlags(t)
	rules := map[string]any{"rules": []any{
		map[string]any{"name": "gateways", "match": map[string]any{"id": "router~.*"}, "key": []any{"namespace", "metadata.LABELS.app", "metadata.ISTIO_VERSION", "locality"}},
		map[string]any{"name": "sidecars", "match": map[string]any{"id": "sidecar~.*"}, "key": []any{"namespace", "metadata.WORKLOAD_NAME", "metadata.LABELS[app.kubernetes.io/name]"}},
	}}
	tests := []struct {
		name   string
		values map[string]any
		want   map[string]string // flags; "" for absent
	}{
		{"fields by keyFields", map[string]any{"keyProfile": "fields", "keyFields": []any{"cluster", `id~^(.*)-[0-9]+\.bench$`}},
			map[string]string{"key-profile": "fields", "key-fields": `cluster,id~^(.*)-[0-9]+\.bench$`, "key-config": "", "key-metadata": ""}},
		{"fields by keyConfig", map[string]any{"keyProfile": "fields", "keyConfig": rules},
			map[string]string{"key-profile": "fields", "key-fields": "", "key-config": "/etc/meshrelay/key-config/key-config.yaml", "key-metadata": ""}},
		{"istio with keyMetadata", map[string]any{"keyMetadata": []any{"POD_IP_DEPENDENT", "TEAM"}},
			map[string]string{"key-profile": "istio", "key-metadata": "POD_IP_DEPENDENT,TEAM", "key-fields": "", "key-config": ""}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			objs := render(t, c, tt.values, false)
			checkTier(t, objs, flags)
			args := relayArgs(t, objs)
			for k, want := range tt.want {
				if got, ok := args[k]; got != want || ok != (want != "") {
					t.Errorf("--%s=%q (given %t), want %q", k, got, ok, want)
				}
			}
			if args["key-profile"] == "istio" {
				if _, err := aggkey.ParseProfile("istio", strings.Split(args["key-metadata"], ",")); err != nil {
					t.Errorf("--key-metadata=%s: the relay refuses it: %v", args["key-metadata"], err)
				}
			}
			if f := args["key-fields"]; f != "" {
				if _, err := aggkey.ParseKeyFields(f); err != nil {
					t.Errorf("--key-fields=%s: the relay refuses it: %v", f, err)
				}
			}
			var cm *corev1.ConfigMap
			var dep *appsv1.Deployment
			for _, r := range objs {
				switch o := r.obj.(type) {
				case *corev1.ConfigMap:
					cm = o
				case *appsv1.Deployment:
					dep = o
				}
			}
			path := args["key-config"]
			if path == "" {
				if cm != nil {
					t.Errorf("ConfigMap %s without --key-config", cm.Name)
				}
				return
			}
			if cm == nil {
				t.Fatal("--key-config without a ConfigMap")
			}
			var vol string
			for _, m := range dep.Spec.Template.Spec.Containers[0].VolumeMounts {
				if m.MountPath == filepath.Dir(path) {
					vol = m.Name
				}
			}
			var from string
			for _, v := range dep.Spec.Template.Spec.Volumes {
				if v.Name == vol && v.ConfigMap != nil {
					from = v.ConfigMap.Name
				}
			}
			if from != cm.Name {
				t.Errorf("--key-config=%s is on volume %q of ConfigMap %q, want ConfigMap %s", path, vol, from, cm.Name)
			}
			data, ok := cm.Data[filepath.Base(path)]
			if !ok {
				t.Fatalf("ConfigMap %s has no %s: %v", cm.Name, filepath.Base(path), cm.Data)
			}
			if _, err := aggkey.ParseKeyConfig([]byte(data)); err != nil {
				t.Errorf("the relay refuses the rendered key config: %v\n%s", err, data)
			}
			if dep.Spec.Template.Annotations["checksum/key-config"] == "" {
				t.Errorf("no checksum/key-config annotation: a change of the rules would not roll the relays")
			}
		})
	}
}

func ptrString[T any](p *T) string {
	if p == nil {
		return "unset"
	}
	return fmt.Sprint(*p)
}

// clusterObjects is a helm.sh ClientProvider whose lookup finds objs, as
// the live cluster of an upgrade would.
type clusterObjects []*unstructured.Unstructured

func (c clusterObjects) GetClientFor(apiVersion, kind string) (dynamic.NamespaceableResourceInterface, bool, error) {
	gv, err := schema.ParseGroupVersion(apiVersion)
	if err != nil {
		return nil, false, err
	}
	objs := make([]runtime.Object, len(c))
	for i, o := range c {
		objs[i] = o
	}
	gvr := gv.WithResource(strings.ToLower(kind) + "s")
	client := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{gvr: kind + "List"}, objs...)
	return client.Resource(gvr), true, nil
}

// TestChartAutoscalingKeepsReplicas: turning autoscaling on does not drop
// the Deployment to one relay: replicas is what runs (within the
// autoscaler's bounds), or minReplicas when nothing runs.
func TestChartAutoscalingKeepsReplicas(t *testing.T) {
	c := loadChart(t)
	live := func(replicas int64) clusterObjects {
		return clusterObjects{{Object: map[string]any{
			"apiVersion": "apps/v1", "kind": "Deployment",
			"metadata": map[string]any{"name": "meshrelay", "namespace": namespace},
			"spec":     map[string]any{"replicas": replicas},
		}}}
	}
	autoscaling := map[string]any{"autoscaling": map[string]any{"enabled": true, "minReplicas": 3, "maxReplicas": 10}}
	tests := []struct {
		name    string
		cluster clusterObjects
		want    int32
	}{
		{"install", nil, 3},
		{"upgrade from 6 relays", live(6), 6},
		{"upgrade from 1 relay", live(1), 3},
		{"upgrade from 20 relays", live(20), 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			caps := chartutil.DefaultCapabilities.Copy()
			caps.KubeVersion = kubeVersion
			rv, err := chartutil.ToRenderValues(c, autoscaling, chartutil.ReleaseOptions{Name: releaseName, Namespace: namespace, IsUpgrade: tt.cluster != nil, IsInstall: tt.cluster == nil, Revision: 2}, caps)
			if err != nil {
				t.Fatal(err)
			}
			files, err := engine.RenderWithClientProvider(c, rv, tt.cluster)
			if err != nil {
				t.Fatal(err)
			}
			var dep appsv1.Deployment
			if err := yaml.Unmarshal([]byte(files["meshrelay/templates/deployment.yaml"]), &dep); err != nil {
				t.Fatal(err)
			}
			if got := ptrString(dep.Spec.Replicas); got != fmt.Sprint(tt.want) {
				t.Errorf("replicas %s, want %d", got, tt.want)
			}
		})
	}
}

// TestChartUpgradeKeepsKeys: the hook that writes a generated key before
// an upgrade writes the key the cluster holds (lookup), not a new one: a
// new gossip key would split the ring, a new seal key would leave the
// persisted Secrets unreadable.
func TestChartUpgradeKeepsKeys(t *testing.T) {
	c := loadChart(t)
	held := map[string]string{
		"meshrelay-gossip": base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{1}, 32)),
		"meshrelay-seal":   base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{2}, 32)),
	}
	var cluster clusterObjects
	for name, key := range held {
		cluster = append(cluster, &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "v1", "kind": "Secret",
			"metadata": map[string]any{"name": name, "namespace": namespace},
			"data":     map[string]any{"key": key},
		}})
	}
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = kubeVersion
	vals := map[string]any{"etcd": map[string]any{"endpoints": []any{"https://etcd:2379"}}}
	rv, err := chartutil.ToRenderValues(c, vals, chartutil.ReleaseOptions{Name: releaseName, Namespace: namespace, IsUpgrade: true, Revision: 2}, caps)
	if err != nil {
		t.Fatal(err)
	}
	files, err := engine.RenderWithClientProvider(c, rv, cluster)
	if err != nil {
		t.Fatal(err)
	}
	found := 0
	for _, doc := range releaseutil.SplitManifests(files["meshrelay/templates/secrets.yaml"]) {
		var s corev1.Secret
		if err := yaml.Unmarshal([]byte(doc), &s); err != nil {
			t.Fatal(err)
		}
		if s.Name == "" {
			continue
		}
		found++
		if got := base64.StdEncoding.EncodeToString(s.Data["key"]); got != held[s.Name] {
			t.Errorf("Secret %s: key %s on upgrade, the cluster holds %s", s.Name, got, held[s.Name])
		}
	}
	if found != len(held) {
		t.Errorf("%d generated Secrets rendered, want %d", found, len(held))
	}
}

// TestChartTrialEtcdPolicy: with networkPolicy on, the trial etcd (no TLS,
// no authentication) admits only this tier's relays, on its client port.
func TestChartTrialEtcdPolicy(t *testing.T) {
	c := loadChart(t)
	for _, np := range []bool{false, true} {
		objs := render(t, c, map[string]any{"etcd": map[string]any{"inCluster": map[string]any{"enabled": true}}, "networkPolicy": map[string]any{"enabled": np}}, false)
		var etcdPod, relays map[string]string
		var policy *networkingv1.NetworkPolicy
		for _, r := range objs {
			switch o := r.obj.(type) {
			case *appsv1.StatefulSet:
				etcdPod = o.Spec.Template.Labels
			case *appsv1.Deployment:
				relays = o.Spec.Template.Labels
			case *networkingv1.NetworkPolicy:
				if o.Name == "meshrelay-etcd" {
					policy = o
				}
			}
		}
		if (policy != nil) != np {
			t.Fatalf("networkPolicy.enabled %t: trial etcd NetworkPolicy rendered %t", np, policy != nil)
		}
		if policy == nil {
			continue
		}
		sel, err := metav1.LabelSelectorAsSelector(&policy.Spec.PodSelector)
		if err != nil || !sel.Matches(labels.Set(etcdPod)) || sel.Matches(labels.Set(relays)) {
			t.Errorf("the policy selects %v: want the etcd pod %v only", policy.Spec.PodSelector, etcdPod)
		}
		if !slices.Equal(policy.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}) || len(policy.Spec.Ingress) != 1 {
			t.Fatalf("policy %+v: want one ingress rule", policy.Spec)
		}
		in := policy.Spec.Ingress[0]
		if len(in.Ports) != 1 || in.Ports[0].Port.IntVal != 2379 || len(in.From) != 1 || in.From[0].PodSelector == nil || in.From[0].NamespaceSelector != nil || in.From[0].IPBlock != nil {
			t.Fatalf("ingress %+v: want 2379 from a pod selector of this namespace only", in)
		}
		from, err := metav1.LabelSelectorAsSelector(in.From[0].PodSelector)
		if err != nil || !from.Matches(labels.Set(relays)) || from.Matches(labels.Set(etcdPod)) {
			t.Errorf("ingress from %v: want the relays %v only", in.From[0].PodSelector, relays)
		}
	}
}

// TestChartAdminMTLS: with xds.tls.auth mtls no token is verified, so the
// admin listener must check mesh certificates against the mesh root
// (--admin-client-ca) for its admins to prove anything.
func TestChartAdminMTLS(t *testing.T) {
	c := loadChart(t)
	vals := map[string]any{"upstream": map[string]any{"auth": "relay-identity"}, "xds": map[string]any{"tls": map[string]any{"auth": "mtls"}}}
	objs := render(t, c, vals, false)
	checkTier(t, objs, relayFlags(t))
	args := relayArgs(t, objs)
	if args["admin-identities"] == "" || args["admin-client-ca"] != args["xds-client-ca"] {
		t.Errorf("--admin-identities=%q --admin-client-ca=%q: want admins and the mesh root %q", args["admin-identities"], args["admin-client-ca"], args["xds-client-ca"])
	}
	if a := relayArgs(t, render(t, c, map[string]any{}, false)); a["admin-client-ca"] != "" {
		t.Errorf("--admin-client-ca=%s with xds.tls.auth any: want it only for mtls", a["admin-client-ca"])
	}
}

// TestChartCustomMetric: the autoscaler scales on Envoys per relay only
// where a custom metrics adapter serves custom.metrics.k8s.io; elsewhere
// on CPU alone (an HPA naming a metric no one serves does not scale).
func TestChartCustomMetric(t *testing.T) {
	c := loadChart(t)
	vals := map[string]any{"autoscaling": map[string]any{"enabled": true, "targetEnvoysPerRelay": 2000}}
	for _, adapter := range []bool{false, true} {
		var apis []string
		if adapter {
			apis = []string{"custom.metrics.k8s.io/v1beta1"}
		}
		var kinds []autoscalingv2.MetricSourceType
		for _, r := range renderRelease(t, c, vals, apis, chartutil.ReleaseOptions{Name: releaseName, Namespace: namespace, IsInstall: true, Revision: 1}) {
			if h, ok := r.obj.(*autoscalingv2.HorizontalPodAutoscaler); ok {
				for _, m := range h.Spec.Metrics {
					kinds = append(kinds, m.Type)
				}
			}
		}
		want := []autoscalingv2.MetricSourceType{autoscalingv2.ResourceMetricSourceType}
		if adapter {
			want = append(want, autoscalingv2.PodsMetricSourceType)
		}
		if !slices.Equal(kinds, want) {
			t.Errorf("custom.metrics.k8s.io served %t: metrics %v, want %v", adapter, kinds, want)
		}
	}
}

// TestChartRBAC: the relays may create TokenReviews and nothing more, and
// the cluster-scoped objects of two releases in two namespaces do not
// collide.
func TestChartRBAC(t *testing.T) {
	c := loadChart(t)
	clusterScoped := func(ns string) map[string]bool {
		objs := renderRelease(t, c, map[string]any{}, nil, chartutil.ReleaseOptions{Name: releaseName, Namespace: ns, IsInstall: true, Revision: 1})
		names := map[string]bool{}
		roles := map[string]*rbacv1.ClusterRole{}
		for _, r := range objs {
			if o, ok := r.obj.(*rbacv1.ClusterRole); ok {
				roles[o.Name] = o
			}
		}
		bound := false
		for _, r := range objs {
			switch o := r.obj.(type) {
			case *rbacv1.ClusterRole:
				names["ClusterRole/"+o.Name] = true
			case *rbacv1.ClusterRoleBinding:
				names["ClusterRoleBinding/"+o.Name] = true
				role := roles[o.RoleRef.Name]
				if role == nil {
					t.Errorf("ClusterRoleBinding %s binds %s %s, not the chart's own", o.Name, o.RoleRef.Kind, o.RoleRef.Name)
					continue
				}
				want := []rbacv1.PolicyRule{{APIGroups: []string{"authentication.k8s.io"}, Resources: []string{"tokenreviews"}, Verbs: []string{"create"}}}
				if fmt.Sprint(role.Rules) != fmt.Sprint(want) {
					t.Errorf("ClusterRole %s grants %v, want only %v", role.Name, role.Rules, want)
				}
				for _, s := range o.Subjects {
					bound = bound || s.Kind == "ServiceAccount" && s.Name == "meshrelay" && s.Namespace == ns
				}
			}
		}
		if !bound {
			t.Errorf("namespace %s: the relays' ServiceAccount is not bound for TokenReview", ns)
		}
		return names
	}
	a, b := clusterScoped("istio-system"), clusterScoped("mesh-b")
	for n := range a {
		if b[n] {
			t.Errorf("%s is made by releases in both namespaces", n)
		}
	}
}

// checkTrialEtcd: the trial etcd's backend quota fits its volume with room
// for the write-ahead log, and it runs under the runtime's seccomp profile.
func checkTrialEtcd(t *testing.T, ss *appsv1.StatefulSet) {
	t.Helper()
	c := ss.Spec.Template.Spec.Containers[0]
	var quota int64 = -1
	for _, a := range c.Command {
		if v, ok := strings.CutPrefix(a, "--quota-backend-bytes="); ok {
			if _, err := fmt.Sscanf(v, "%d", &quota); err != nil {
				t.Errorf("%s: %v", a, err)
			}
		}
	}
	if len(ss.Spec.VolumeClaimTemplates) != 1 {
		t.Fatalf("StatefulSet %s: %d volume claims, want 1", ss.Name, len(ss.Spec.VolumeClaimTemplates))
	}
	size := ss.Spec.VolumeClaimTemplates[0].Spec.Resources.Requests[corev1.ResourceStorage]
	if quota <= 0 || quota > size.Value()*3/4 {
		t.Errorf("StatefulSet %s: --quota-backend-bytes %d with a %s volume: want at most three quarters of it", ss.Name, quota, size.String())
	}
	if sc := c.SecurityContext; sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("StatefulSet %s: securityContext %+v: want seccompProfile RuntimeDefault", ss.Name, sc)
	}
}
