package istiodebug

import (
	"encoding/json"
	"testing"
	"time"

	statusv3 "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	"go.uber.org/goleak"

	"github.com/meshrelay/meshrelay/ledger"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestSyncz lists the connected Envoys of the keys the caller sees, with
// the node metadata istioctl reads, as istiod's syncz does.
func TestSyncz(t *testing.T) {
	cfg := ledger.DefaultTrackerConfig()
	cfg.Relay = "relay-a"
	tr, err := ledger.NewTracker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tr.Connect("sidecar~10.0.0.1~a.ns1~ns1.svc.cluster.local", "ns1/a", now).SetMeta(ledger.NodeMeta{Namespace: "ns1", Version: "1.28.0"})
	tr.Connect("sidecar~10.0.0.2~b.ns2~ns2.svc.cluster.local", "ns2/b", now).SetMeta(ledger.NodeMeta{Namespace: "ns2"})
	rep := ledger.Merge(tr.Summary(ledger.Scope{}, now, ledger.Full))

	got, err := Syncz(rep, func(key string) bool { return key == "ns1/a" })
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 {
		t.Fatalf("Syncz = %d Envoys, want the one of ns1/a", len(got))
	}
	var cc statusv3.ClientConfig
	if err := got[0].UnmarshalTo(&cc); err != nil {
		t.Fatal(err)
	}
	meta := cc.GetNode().GetMetadata().GetFields()
	if cc.GetNode().GetId() != "sidecar~10.0.0.1~a.ns1~ns1.svc.cluster.local" || meta["NAMESPACE"].GetStringValue() != "ns1" ||
		meta["ISTIO_VERSION"].GetStringValue() != "1.28.0" || meta["CLUSTER_ID"] != nil {
		t.Fatalf("Syncz = node %q, metadata %v; want a.ns1's with NAMESPACE and ISTIO_VERSION only", cc.GetNode().GetId(), meta)
	}
	if all, _ := Syncz(rep, func(string) bool { return true }); len(all) != 2 {
		t.Fatalf("Syncz for an admin = %d Envoys, want 2", len(all))
	}
}

// TestControlPlane: istioctl reads a debug answer's control plane
// identifier as istiod's JSON.
func TestControlPlane(t *testing.T) {
	var id struct {
		Component, ID string
		Info          struct{ Version string }
	}
	if err := json.Unmarshal([]byte(ControlPlane("relay-a").GetIdentifier()), &id); err != nil {
		t.Fatal(err)
	}
	if id.Component != "meshrelay" || id.ID != "relay-a" || id.Info.Version == "" {
		t.Fatalf("ControlPlane = %+v, want meshrelay relay-a with a version", id)
	}
	if !IsDebugType(TypeSyncz) || !IsDebugType(TypeConfigDump) || IsDebugType("type.googleapis.com/envoy.config.cluster.v3.Cluster") {
		t.Fatal("IsDebugType does not tell istiod's debug types from the others")
	}
}
