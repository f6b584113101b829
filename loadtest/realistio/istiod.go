package realistio

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"

	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// SystemNamespace is istiod's namespace, and its root namespace.
const SystemNamespace = "istio-system"

// ClusterID is the cluster istiod serves; a sidecar's
// ISTIO_META_CLUSTER_ID must be it (the CA picks the TokenReview cluster
// by it).
const ClusterID = "Kubernetes"

// Istiod is a real istiod (pilot-discovery) on loopback, reading a
// KubeAPI, with a plugged-in root CA of the test's (so that the relay's
// serving certificate can come from the same root).
type Istiod struct {
	// PlainAddr is its plaintext xDS port (15010), TLSAddr its TLS one
	// (15012, which is also its CA), HTTPAddr its debug and readiness
	// port (8080), MonitoringAddr its metrics (15014).
	PlainAddr, TLSAddr, HTTPAddr, MonitoringAddr string
	// Root is the mesh's root CA: istiod signs workload certificates with
	// it, and its serving certificate names istiod.istio-system.svc.
	Root *authtest.CA

	proc *process
}

// IstiodOption changes how StartIstiod runs istiod.
type IstiodOption func(*istiodOptions)

type istiodOptions struct{ host string }

// ListenOn makes istiod's xDS ports listen on host rather than 127.0.0.1
// (an address of a bridge the test made, which sidecars in network
// namespaces reach).
func ListenOn(host string) IstiodOption { return func(o *istiodOptions) { o.host = host } }

// StartIstiod applies Istio's CRDs to k (server-side), creates the
// system namespace, and starts istiod (bin) with its files in dir and its
// output to log, configured for an upstream Envoy rather than Istio's
// proxy build (XDS-NOTES.md): no metadata exchange, no ALPN filter, no
// stats filter. It waits until istiod is ready. Stop ends it.
func StartIstiod(ctx context.Context, bin string, k *KubeAPI, dir string, log io.Writer, opts ...IstiodOption) (_ *Istiod, err error) {
	o := istiodOptions{host: "127.0.0.1"}
	for _, opt := range opts {
		opt(&o)
	}
	if err := applyCRDs(ctx, k); err != nil {
		return nil, err
	}
	_, err = k.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: SystemNamespace}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("create namespace %s: %w", SystemNamespace, err)
	}
	d := &Istiod{}
	defer func() {
		if err != nil {
			d.Stop()
		}
	}()
	if d.Root, err = authtest.MakeCA("meshrelay test mesh root"); err != nil {
		return nil, err
	}
	cacerts := filepath.Join(dir, "cacerts")
	if err := os.MkdirAll(cacerts, 0o700); err != nil {
		return nil, err
	}
	for name, b := range map[string][]byte{
		"ca-cert.pem": d.Root.RootPEM(), "ca-key.pem": d.Root.KeyPEM(),
		"root-cert.pem": d.Root.RootPEM(), "cert-chain.pem": d.Root.RootPEM(),
	} {
		if err := os.WriteFile(filepath.Join(cacerts, name), b, 0o600); err != nil {
			return nil, err
		}
	}
	mesh := filepath.Join(dir, "mesh.yaml")
	if err := os.WriteFile(mesh, []byte("rootNamespace: "+SystemNamespace+"\ntrustDomain: cluster.local\ndefaultProviders:\n  metrics: []\n"), 0o644); err != nil {
		return nil, err
	}
	ports := make([]int, 5)
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return nil, err
		}
	}
	addr := func(p int) string { return "127.0.0.1:" + strconv.Itoa(p) }
	xdsAddr := func(p int) string { return net.JoinHostPort(o.host, strconv.Itoa(p)) }
	d.HTTPAddr, d.PlainAddr, d.TLSAddr, d.MonitoringAddr = addr(ports[0]), xdsAddr(ports[1]), xdsAddr(ports[2]), addr(ports[3])
	cmd := exec.Command(bin, "discovery",
		"--kubeconfig", k.Kubeconfig, "--registries", "Kubernetes", "--clusterID", ClusterID,
		"--meshConfig", mesh, "--networksConfig", filepath.Join(dir, "meshNetworks"), "--domain", "cluster.local",
		"--httpAddr", d.HTTPAddr, "--httpsAddr", addr(ports[4]), "--grpcAddr", d.PlainAddr,
		"--secureGRPCAddr", d.TLSAddr, "--monitoringAddr", d.MonitoringAddr,
		"--log_output_level", "default:warn")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(),
		"POD_NAMESPACE="+SystemNamespace, "POD_NAME=istiod-0", "REVISION=default",
		"ROOT_CA_DIR="+cacerts, "PILOT_CERT_PROVIDER=istiod", "JWT_POLICY=third-party-jwt", "CLUSTER_ID="+ClusterID,
		// An upstream Envoy is not Istio's proxy build: these would be
		// NACKed.
		"PILOT_ENABLE_METADATA_EXCHANGE=false", "PILOT_ENABLE_ALPN_FILTER=false",
		// No webhooks to patch here.
		"INJECTION_WEBHOOK_CONFIG_NAME=", "VALIDATION_WEBHOOK_CONFIG_NAME=",
	)
	if d.proc, err = startProcess("istiod", cmd, log); err != nil {
		return nil, err
	}
	if err := d.waitReady(ctx); err != nil {
		return nil, err
	}
	return d, nil
}

// waitReady waits until istiod's /ready answers 200, for two minutes at
// most (a cold istiod syncs its informers first).
func (d *Istiod) waitReady(ctx context.Context) error {
	return d.proc.waitHTTP(ctx, &http.Client{Timeout: 5 * time.Second}, "http://"+d.HTTPAddr+"/ready", 2*time.Minute)
}

// Stop ends istiod and waits for it.
func (d *Istiod) Stop() { d.proc.stop(15 * time.Second) }

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// applyCRDs applies Istio's CRDs (the module's
// manifests/charts/base/files/crd-all.gen.yaml) by server-side apply, as
// Istio's installer does (client-side apply would not fit their size in
// an annotation), and waits until every one is Established.
func applyCRDs(ctx context.Context, k *KubeAPI) error {
	src, err := moduleDir(ctx, IstioModule, IstioVersion)
	if err != nil {
		return err
	}
	f, err := os.Open(filepath.Join(src, "manifests", "charts", "base", "files", "crd-all.gen.yaml"))
	if err != nil {
		return err
	}
	defer f.Close()
	dc, err := dynamic.NewForConfig(k.Config)
	if err != nil {
		return err
	}
	crds := dc.Resource(crdGVR)
	dec := utilyaml.NewYAMLOrJSONDecoder(f, 64<<10)
	var names []string
	for {
		var u unstructured.Unstructured
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return fmt.Errorf("crd-all.gen.yaml: %w", err)
		}
		if u.GetKind() != "CustomResourceDefinition" {
			continue
		}
		if _, err := crds.Apply(ctx, u.GetName(), &u, metav1.ApplyOptions{FieldManager: "meshrelay-test", Force: true}); err != nil {
			return fmt.Errorf("apply CRD %s: %w", u.GetName(), err)
		}
		names = append(names, u.GetName())
	}
	if len(names) == 0 {
		return errors.New("crd-all.gen.yaml: no CustomResourceDefinition")
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, name := range names {
		for {
			u, err := crds.Get(ctx, name, metav1.GetOptions{})
			if err == nil && established(u) {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("CRD %s not established: %v", name, err)
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	return nil
}

func established(u *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}
