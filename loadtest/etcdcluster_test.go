package loadtest

import "testing"

// TestParseEtcdStatus reads the gateway's answer as etcd 3.7 gives it.
func TestParseEtcdStatus(t *testing.T) {
	raw := `{"header":{"cluster_id":"15118495548433857066","member_id":"13668033151171901709","revision":"812","raft_term":"3"},` +
		`"version":"3.7.3","dbSize":"20480","leader":"13668033151171901709","raftIndex":"4","raftTerm":"3"}`
	got, err := parseEtcdStatus([]byte(raw))
	want := EtcdStatus{ID: 13668033151171901709, Leader: 13668033151171901709, Term: 3, Revision: 812}
	if err != nil || got != want {
		t.Errorf("parseEtcdStatus = %+v, %v; want %+v", got, err, want)
	}
	if _, err := parseEtcdStatus([]byte(`{"header":{}}`)); err == nil {
		t.Error("parseEtcdStatus of no member id succeeded")
	}
}
