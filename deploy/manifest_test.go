// Package deploy holds the tier's packaging; its test decodes the plain
// Kubernetes manifests strictly with the Kubernetes API's own Go types, so
// a misspelt field fails CI rather than an apply.
package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.uber.org/goleak"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// certificate is the part of cert-manager's Certificate the manifests use
// (cert-manager's Go module is not a dependency).
type certificate struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Spec struct {
		SecretName  string   `json:"secretName"`
		DNSNames    []string `json:"dnsNames"`
		URIs        []string `json:"uris"`
		Duration    string   `json:"duration"`
		RenewBefore string   `json:"renewBefore"`
		PrivateKey  struct {
			Algorithm      string `json:"algorithm"`
			Size           int    `json:"size"`
			RotationPolicy string `json:"rotationPolicy"`
		} `json:"privateKey"`
		Usages    []string `json:"usages"`
		IssuerRef struct {
			Name string `json:"name"`
			Kind string `json:"kind"`
		} `json:"issuerRef"`
	} `json:"spec"`
}

func decodeStrict(doc []byte, into any) error {
	js, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return err
	}
	d := json.NewDecoder(bytes.NewReader(js))
	d.DisallowUnknownFields()
	return d.Decode(into)
}

// objects decodes every document of the manifests, by kind.
func objects(t *testing.T) map[string][]any {
	t.Helper()
	files, err := filepath.Glob("kubernetes/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	out := map[string][]any{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range strings.Split(string(b), "\n---\n") {
			var head struct{ Kind string }
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				t.Fatalf("%s doc %d: %v", f, i, err)
			}
			var obj any
			switch head.Kind {
			case "Deployment":
				obj = &appsv1.Deployment{}
			case "Service":
				obj = &corev1.Service{}
			case "ServiceAccount":
				obj = &corev1.ServiceAccount{}
			case "ClusterRole":
				obj = &rbacv1.ClusterRole{}
			case "ClusterRoleBinding":
				obj = &rbacv1.ClusterRoleBinding{}
			case "PodDisruptionBudget":
				obj = &policyv1.PodDisruptionBudget{}
			case "Certificate":
				obj = &certificate{}
			default:
				t.Fatalf("%s doc %d: kind %q: add it to this test", f, i, head.Kind)
			}
			if err := decodeStrict([]byte(doc), obj); err != nil {
				t.Fatalf("%s doc %d (%s): %v", f, i, head.Kind, err)
			}
			out[head.Kind] = append(out[head.Kind], obj)
		}
	}
	return out
}

// The manifests decode strictly, and hang together: every Secret and
// ConfigMap the Deployment mounts and every file its flags name is
// provided, the ports its flags open are the container's and the
// Services', and its ServiceAccount is the one bound for TokenReview.
func TestManifests(t *testing.T) {
	objs := objects(t)
	if len(objs["Deployment"]) != 1 {
		t.Fatalf("%d Deployments, want 1", len(objs["Deployment"]))
	}
	dep := objs["Deployment"][0].(*appsv1.Deployment)
	pod := dep.Spec.Template.Spec
	c := pod.Containers[0]
	flags := map[string]string{}
	for _, a := range c.Args[1:] {
		k, v, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		flags[k] = v
	}
	mounts := map[string]string{} // mount path → volume
	for _, m := range c.VolumeMounts {
		mounts[m.MountPath] = m.Name
	}
	volumes := map[string]bool{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = true
	}
	for k, v := range flags {
		if !strings.HasSuffix(k, "-file") && !strings.HasSuffix(k, "-cert") && !strings.HasSuffix(k, "-key") && !strings.HasSuffix(k, "-ca") {
			continue // not a file
		}
		dir := filepath.Dir(v)
		if mounts[dir] == "" || !volumes[mounts[dir]] {
			t.Errorf("--%s=%s: no volume mounted at %s", k, v, dir)
		}
	}
	ports := map[int32]bool{}
	for _, p := range c.Ports {
		ports[p.ContainerPort] = true
	}
	for _, k := range []string{"xds-tls-listen", "peer-listen", "admin-listen", "gossip-listen"} {
		var port int32
		if _, err := fmt.Sscanf(strings.TrimPrefix(flags[k], ":"), "%d", &port); err != nil || !ports[port] {
			t.Errorf("--%s=%s: not a container port", k, flags[k])
		}
	}
	if flags["xds-listen"] != "" {
		t.Errorf("--xds-listen=%s: the manifest opens no plaintext port", flags["xds-listen"])
	}
	// The admin API hands out every namespace's config: on TLS, with its
	// callers proven, and its probes speaking TLS.
	if flags["admin-tls-cert"] == "" || flags["admin-identities"]+flags["admin-token-file"]+flags["admin-client-ca"] == "" {
		t.Errorf("the admin listener is not guarded: want --admin-tls-cert and one of --admin-identities, --admin-token-file, --admin-client-ca")
	}
	for name, p := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Scheme != corev1.URISchemeHTTPS {
			t.Errorf("%s probe %+v: want an HTTPS GET (the admin listener serves TLS)", name, p)
		}
	}
	accounts := map[string]bool{}
	for _, o := range objs["ServiceAccount"] {
		sa := o.(*corev1.ServiceAccount)
		accounts["spiffe://cluster.local/ns/"+sa.Namespace+"/sa/"+sa.Name] = true
	}
	for id := range strings.SplitSeq(flags["admin-identities"], ",") {
		if id != "" && !accounts[id] {
			t.Errorf("--admin-identities names %s, a ServiceAccount the manifests do not make", id)
		}
	}
	var svcPorts []int32
	for _, o := range objs["Service"] {
		for _, p := range o.(*corev1.Service).Spec.Ports {
			svcPorts = append(svcPorts, p.TargetPort.IntVal)
		}
	}
	if !slices.Contains(svcPorts, 15012) {
		t.Errorf("no Service sends 15012 to the relays: %v", svcPorts)
	}
	// TokenReview: a ClusterRole of the manifest that grants create on
	// tokenreviews, bound to the relays' ServiceAccount.
	reviews := map[string]bool{}
	for _, o := range objs["ClusterRole"] {
		r := o.(*rbacv1.ClusterRole)
		for _, rule := range r.Rules {
			reviews[r.Name] = reviews[r.Name] || slices.Contains(rule.APIGroups, "authentication.k8s.io") && slices.Contains(rule.Resources, "tokenreviews") && slices.Contains(rule.Verbs, "create")
		}
	}
	bound := false
	for _, o := range objs["ClusterRoleBinding"] {
		b := o.(*rbacv1.ClusterRoleBinding)
		for _, s := range b.Subjects {
			bound = bound || (b.RoleRef.Kind == "ClusterRole" && reviews[b.RoleRef.Name] && s.Kind == "ServiceAccount" && s.Name == pod.ServiceAccountName && s.Namespace == dep.Namespace)
		}
	}
	if !bound {
		t.Errorf("ServiceAccount %q is not bound to a ClusterRole that creates tokenreviews (TokenReview)", pod.ServiceAccountName)
	}
	secrets := map[string]bool{}
	for _, o := range objs["Certificate"] {
		secrets[o.(*certificate).Spec.SecretName] = true
	}
	for _, v := range pod.Volumes {
		if v.Secret != nil && strings.HasSuffix(v.Secret.SecretName, "-tls") && !secrets[v.Secret.SecretName] {
			t.Errorf("volume %s mounts Secret %s, which no Certificate makes", v.Name, v.Secret.SecretName)
		}
	}
}
