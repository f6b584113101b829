package realistio

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
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
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/snapshot"
)

// ServiceAccountIssuer is the issuer of the API server's service-account
// tokens, as in a cluster whose domain is cluster.local.
const ServiceAccountIssuer = "https://kubernetes.default.svc.cluster.local"

// KubeAPI is a real kube-apiserver on loopback, with an etcd of its own
// (the project's embedded one) and no kubelet or controller-manager: no
// Pod runs, namespaces get no default ServiceAccount, Services get no
// EndpointSlices (XDS-NOTES.md, "Real Istio outside a cluster").
type KubeAPI struct {
	// URL is the API's https address; Kubeconfig a file that reaches it
	// as an admin (system:masters, by client certificate).
	URL, Kubeconfig string
	// CA signed the API's serving and client certificates.
	CA *authtest.CA
	// Client is an admin clientset.
	Client *kubernetes.Clientset
	// Config is the admin's rest config.
	Config *rest.Config

	proc *process
	etcd *snapshot.Embedded
}

// StartKubeAPI starts kube-apiserver (bin) with its state in dir, its
// output to log, and waits until it is ready (/readyz). Stop ends it.
func StartKubeAPI(ctx context.Context, bin, dir string, log io.Writer) (_ *KubeAPI, err error) {
	k := &KubeAPI{}
	defer func() {
		if err != nil {
			k.Stop()
		}
	}()
	if k.etcd, err = snapshot.StartEmbedded(ctx, snapshot.EmbeddedConfig{Dir: filepath.Join(dir, "etcd")}); err != nil {
		return nil, err
	}
	if k.CA, err = authtest.MakeCA("kube-apiserver test CA"); err != nil {
		return nil, err
	}
	serving, err := k.CA.Make(authtest.Leaf{
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPs:      []net.IP{net.IPv4(127, 0, 0, 1)},
	})
	if err != nil {
		return nil, err
	}
	admin, err := k.CA.Make(authtest.Leaf{CommonName: "meshrelay-test-admin", Organization: []string{"system:masters"}})
	if err != nil {
		return nil, err
	}
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	saDER, err := x509.MarshalECPrivateKey(saKey)
	if err != nil {
		return nil, err
	}
	files := map[string][]byte{
		"serving.pem":     serving.CertPEM,
		"serving-key.pem": serving.KeyPEM,
		"ca.pem":          k.CA.RootPEM(),
		"sa-key.pem":      pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: saDER}),
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			return nil, err
		}
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	k.URL = "https://127.0.0.1:" + strconv.Itoa(port)
	args := []string{
		"--etcd-servers=" + k.etcd.Endpoints()[0],
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port=" + strconv.Itoa(port),
		"--tls-cert-file=" + filepath.Join(dir, "serving.pem"), "--tls-private-key-file=" + filepath.Join(dir, "serving-key.pem"),
		"--client-ca-file=" + filepath.Join(dir, "ca.pem"),
		"--service-account-issuer=" + ServiceAccountIssuer,
		"--service-account-key-file=" + filepath.Join(dir, "sa-key.pem"),
		"--service-account-signing-key-file=" + filepath.Join(dir, "sa-key.pem"),
		"--authorization-mode=RBAC",
		"--service-cluster-ip-range=10.96.0.0/16",
		// On loopback the reconciler logs every 10 s that 127.0.0.1 "may
		// not be in the loopback range".
		"--endpoint-reconciler-type=none",
		"--enable-priority-and-fairness=false",
		"--cert-dir=" + filepath.Join(dir, "certs"),
	}
	if k.proc, err = startProcess("kube-apiserver", exec.Command(bin, args...), log); err != nil {
		return nil, err
	}

	k.Config = &rest.Config{Host: k.URL, QPS: -1, TLSClientConfig: rest.TLSClientConfig{
		CAData: k.CA.RootPEM(), CertData: admin.CertPEM, KeyData: admin.KeyPEM,
	}}
	if k.Client, err = kubernetes.NewForConfig(k.Config); err != nil {
		return nil, err
	}
	k.Kubeconfig = filepath.Join(dir, "kubeconfig")
	if err := writeKubeconfig(k.Kubeconfig, k.URL, k.CA.RootPEM(), admin.CertPEM, admin.KeyPEM); err != nil {
		return nil, err
	}
	if err := k.waitReady(ctx, admin.TLS); err != nil {
		return nil, err
	}
	return k, nil
}

// waitReady waits until /readyz answers ok, for a minute at most.
func (k *KubeAPI) waitReady(ctx context.Context, cert tls.Certificate) error {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(k.CA.RootPEM())
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{
		RootCAs: pool, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}}}
	return k.proc.waitHTTP(ctx, hc, k.URL+"/readyz", time.Minute)
}

// Stop ends the API server and its etcd, and waits for them.
func (k *KubeAPI) Stop() {
	k.proc.stop(10 * time.Second)
	if k.etcd != nil {
		k.etcd.Close()
	}
}

// writeKubeconfig writes a kubeconfig that reaches server as the holder of
// the client certificate.
func writeKubeconfig(path, server string, ca, cert, key []byte) error {
	cfg := clientcmdConfig(server, ca, cert, key)
	return clientcmd.WriteToFile(*cfg, path)
}

// freePort returns a loopback port free now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// clientcmdConfig is a kubeconfig of one cluster, user and context.
func clientcmdConfig(server string, ca, cert, key []byte) *clientcmdapi.Config {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{ClientCertificateData: cert, ClientKeyData: key}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "admin"}
	cfg.CurrentContext = "test"
	return cfg
}

// AddService creates namespace ns (if need be), a ClusterIP Service name
// of one TCP port selecting app=name, and the EndpointSlice a controller
// would write for pods at ips.
func (k *KubeAPI) AddService(ctx context.Context, ns, name string, port int32, ips ...string) error {
	_, err := k.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", ns, err)
	}
	portName := "http"
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app": name}},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": name},
			Ports:    []corev1.ServicePort{{Name: portName, Port: port, Protocol: corev1.ProtocolTCP}},
		},
	}
	if _, err := k.Client.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create service %s/%s: %w", ns, name, err)
	}
	proto := corev1.ProtocolTCP
	ready := true
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name + "-1", Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: name}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Port: &port, Protocol: &proto}},
	}
	for _, ip := range ips {
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{ip}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}})
	}
	if _, err := k.Client.DiscoveryV1().EndpointSlices(ns).Create(ctx, es, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create endpointslice %s/%s: %w", ns, name, err)
	}
	return nil
}

// AddServiceAccount creates namespace ns (if need be) and service account
// ns/name: without a controller-manager no namespace gets its default one.
func (k *KubeAPI) AddServiceAccount(ctx context.Context, ns, name string) error {
	_, err := k.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", ns, err)
	}
	_, err = k.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create service account %s/%s: %w", ns, name, err)
	}
	return nil
}
