package deploy

// The chart installed on a real kube-apiserver (issue 29): each value set
// rendered as chart_test.go renders it, every object server-side applied
// with strict field validation, so a field the API does not know, a field
// given twice, or a value the API server's own validation refuses fails
// here rather than at a user's helm install.

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"github.com/meshrelay/meshrelay/loadtest/realistio"
)

// fieldManager is the manager the chart's objects are applied as: Helm's
// own name for server-side apply.
const fieldManager = "helm"

// uninstallable are the kinds the chart renders whose CRDs this API server
// lacks and no module go.mod requires ships as YAML (the Prometheus
// Operator's API module has Go types only; cert-manager is no
// dependency): cert-manager's Certificate (certManager.enabled) is left
// out here, and ServiceMonitor and PrometheusRule are not rendered (the
// render is for a cluster without the Operator's CRDs). chart_test.go
// decodes all three strictly with their Go types.
var uninstallable = map[string]bool{"Certificate": true, "ServiceMonitor": true, "PrometheusRule": true}

// TestChartInstalls installs the chart, for the default values and each
// ci/*.yaml, on a real kube-apiserver: every rendered object (hooks
// included) is server-side applied into istio-system with
// fieldValidation=Strict and read back, owned by the applier. Each value
// set installs into an emptied namespace.
func TestChartInstalls(t *testing.T) {
	bin := kubeAPIServer(t)
	c := loadChart(t)
	sets := valueSets(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := t.TempDir()
	k, err := realistio.StartKubeAPI(ctx, bin, dir, kubeLog(t, dir))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Stop)
	dyn, err := dynamic.NewForConfig(k.Config)
	if err != nil {
		t.Fatal(err)
	}
	groups, err := restmapper.GetAPIGroupResources(k.Client.Discovery())
	if err != nil {
		t.Fatalf("discovery: %v", err)
	}
	mapper := restmapper.NewDiscoveryRESTMapper(groups)
	if _, err := k.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace %s: %v", namespace, err)
	}
	// resource is the client of r's kind, in the release's namespace if
	// the kind is namespaced.
	resource := func(t *testing.T, r rendered) dynamic.ResourceInterface {
		t.Helper()
		gv, err := schema.ParseGroupVersion(kinds[r.kind].apiVersion)
		if err != nil {
			t.Fatal(err)
		}
		m, err := mapper.RESTMapping(gv.WithKind(r.kind).GroupKind(), gv.Version)
		if err != nil {
			t.Fatalf("%s %s: the API server does not serve %s: %v", r.kind, r.name, gv.WithKind(r.kind), err)
		}
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			return dyn.Resource(m.Resource).Namespace(namespace)
		}
		return dyn.Resource(m.Resource)
	}

	for _, vs := range sets {
		t.Run(vs.name, func(t *testing.T) {
			var installed []rendered
			t.Cleanup(func() { uninstall(t, ctx, installed, resource) })
			for _, r := range render(t, c, vs.values, false) {
				if uninstallable[r.kind] {
					continue
				}
				// The YAML as rendered, not a re-encoding: the API server
				// sees any field the template repeats.
				_, err := resource(t, r).Patch(ctx, r.name, types.ApplyPatchType, []byte(r.doc),
					metav1.PatchOptions{FieldManager: fieldManager, FieldValidation: metav1.FieldValidationStrict})
				if err != nil {
					t.Errorf("apply %s %s (%s): %v", r.kind, r.name, r.source, err)
					continue
				}
				installed = append(installed, r)
			}
			if len(installed) == 0 {
				t.Fatal("nothing installed")
			}
			t.Logf("%d objects applied", len(installed))
			for _, r := range installed {
				got, err := resource(t, r).Get(ctx, r.name, metav1.GetOptions{})
				if err != nil {
					t.Errorf("get %s %s after apply: %v", r.kind, r.name, err)
					continue
				}
				applied := false
				for _, f := range got.GetManagedFields() {
					applied = applied || f.Manager == fieldManager && f.Operation == metav1.ManagedFieldsOperationApply
				}
				if got.GetUID() == "" || !applied {
					t.Errorf("%s %s: uid %q, managed fields %v: want it applied by %s", r.kind, r.name, got.GetUID(), got.GetManagedFields(), fieldManager)
				}
			}
		})
	}
}

// uninstall deletes objs and waits, for 30 s at most, until each is gone,
// so the next value set installs into an empty namespace. No
// controller-manager runs: nothing but the deletes removes them.
func uninstall(t *testing.T, ctx context.Context, objs []rendered, resource func(*testing.T, rendered) dynamic.ResourceInterface) {
	t.Helper()
	background := metav1.DeletePropagationBackground
	for _, r := range objs {
		if err := resource(t, r).Delete(ctx, r.name, metav1.DeleteOptions{PropagationPolicy: &background}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete %s %s: %v", r.kind, r.name, err)
		}
	}
	for _, r := range objs {
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			_, err := resource(t, r).Get(ctx, r.name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return true, nil
			}
			return false, err
		})
		if err != nil {
			t.Errorf("%s %s is not gone after delete: %v", r.kind, r.name, err)
		}
	}
}

// kubeAPIServer returns the built kube-apiserver, or skips the test with
// one line naming the command that builds it; with CI=true a missing
// binary fails the test instead (as realistio's own tests do).
func kubeAPIServer(t *testing.T) string {
	t.Helper()
	b, err := realistio.Find()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("kube-apiserver required (CI=true): %v", err)
		}
		t.Skipf("no kube-apiserver: %v", err)
	}
	return b.KubeAPIServer
}

// kubeLog opens a file in dir for kube-apiserver's output; its last lines
// are printed when the test fails.
func kubeLog(t *testing.T, dir string) *os.File {
	t.Helper()
	f, err := os.Create(filepath.Join(dir, "kube-apiserver.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(f.Name())
			if len(b) > 4000 {
				b = b[len(b)-4000:]
			}
			t.Logf("kube-apiserver's last output:\n%s", bytes.TrimSpace(b))
		}
		f.Close()
	})
	return f
}
