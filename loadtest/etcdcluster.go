package loadtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// EtcdMemberConfig is one member of a multi-member etcd cluster, each run
// in a process of its own (RunEtcdMemberChild), as in production.
type EtcdMemberConfig struct {
	// Name is the member's name in InitialCluster. Required.
	Name string
	// Dir holds its data; a member restarted on the same Dir rejoins the
	// cluster with what it had. Required.
	Dir string
	// Client and Peer are its loopback host:port for clients and for the
	// other members. Required.
	Client, Peer string
	// InitialCluster names every member: "name=http://host:port,…" (peer
	// URLs). Required; ignored by etcd when Dir already holds data.
	InitialCluster string
}

// Args returns the child's command-line flags (etcd-member-child).
func (c EtcdMemberConfig) Args() []string {
	return []string{"--name", c.Name, "--dir", c.Dir, "--client", c.Client, "--peer", c.Peer, "--initial-cluster", c.InitialCluster}
}

// RunEtcdMemberChild is the main of an etcd member process: etcd's own
// server (embed) as one member of cfg.InitialCluster. It prints "xds
// <client addr>" (the protocol StartChild waits for) once the member
// serves, which needs a quorum: start the members together. It runs until
// ctx ends or in reaches EOF.
func RunEtcdMemberChild(ctx context.Context, cfg EtcdMemberConfig, in io.Reader, out io.Writer) error {
	if cfg.Name == "" || cfg.Dir == "" || cfg.Client == "" || cfg.Peer == "" || cfg.InitialCluster == "" {
		return errors.New("loadtest: an etcd member needs a name, a directory, client and peer addresses and the initial cluster")
	}
	ec := embed.NewConfig()
	ec.Name = cfg.Name
	ec.Dir = cfg.Dir
	ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	client := url.URL{Scheme: "http", Host: cfg.Client}
	peer := url.URL{Scheme: "http", Host: cfg.Peer}
	ec.ListenClientUrls, ec.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
	ec.ListenPeerUrls, ec.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
	ec.InitialCluster = cfg.InitialCluster
	ec.InitialClusterToken = "meshrelay-chaos"
	if _, err := os.Stat(filepath.Join(cfg.Dir, "member")); err == nil {
		ec.ClusterState = embed.ClusterStateFlagExisting
	}
	ec.AutoCompactionMode = embed.CompactorModePeriodic
	ec.AutoCompactionRetention = "5m"
	e, err := embed.StartEtcd(ec)
	if err != nil {
		return fmt.Errorf("loadtest: start etcd member %s: %w", cfg.Name, err)
	}
	defer e.Close()
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		return fmt.Errorf("loadtest: etcd member %s: %w", cfg.Name, err)
	case <-ctx.Done():
		return nil
	}
	if err := serveChild(ctx, cfg.Client, in, out, e.Err()); err != nil {
		return fmt.Errorf("loadtest: etcd member %s: %w", cfg.Name, err)
	}
	return nil
}

// StartEtcdMemberFunc starts one etcd member process; log receives its
// stderr.
type StartEtcdMemberFunc func(ctx context.Context, cfg EtcdMemberConfig, log io.Writer) (*Child, error)

// ExecEtcdMember returns a StartEtcdMemberFunc that runs path with args
// followed by the member's flags; cmd/loadtest passes its own executable
// and "etcd-member-child".
func ExecEtcdMember(path string, args ...string) StartEtcdMemberFunc {
	return func(ctx context.Context, cfg EtcdMemberConfig, log io.Writer) (*Child, error) {
		return StartChild(ctx, ChildConfig{
			Path:         path,
			Args:         append(append([]string(nil), args...), cfg.Args()...),
			Stderr:       log,
			ReadyTimeout: time.Minute,
		})
	}
}

// EtcdCluster is a multi-member etcd cluster of child processes. Its
// methods are safe for concurrent use; Stop it when done.
type EtcdCluster struct {
	start   StartEtcdMemberFunc
	members []EtcdMemberConfig
	logs    []io.Writer

	mu       sync.Mutex
	children []*Child // nil while a member is down
}

// StartEtcdCluster starts one member per host (loopback IPs; client port
// 2379, peer port 2380), their data under dir, their stderr to logs[i],
// and returns once every member serves.
func StartEtcdCluster(ctx context.Context, start StartEtcdMemberFunc, hosts []string, dir string, logs []io.Writer) (*EtcdCluster, error) {
	c := &EtcdCluster{start: start, logs: logs, children: make([]*Child, len(hosts))}
	var initial []string
	for i, h := range hosts {
		m := EtcdMemberConfig{
			Name: fmt.Sprintf("etcd-%d", i), Dir: filepath.Join(dir, fmt.Sprintf("etcd-%d", i)),
			Client: h + ":2379", Peer: h + ":2380",
		}
		c.members = append(c.members, m)
		initial = append(initial, m.Name+"=http://"+m.Peer)
	}
	for i := range c.members {
		c.members[i].InitialCluster = strings.Join(initial, ",")
	}
	// A member is ready only once a quorum is: start them side by side.
	errs := make([]error, len(hosts))
	var wg sync.WaitGroup
	for i := range c.members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = c.Start(ctx, i)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

// Endpoints returns every member's client URL.
func (c *EtcdCluster) Endpoints() []string {
	var out []string
	for _, m := range c.members {
		out = append(out, "http://"+m.Client)
	}
	return out
}

// Start starts member i (again, on its data: it rejoins).
func (c *EtcdCluster) Start(ctx context.Context, i int) error {
	child, err := c.start(ctx, c.members[i], c.logs[i])
	if err != nil {
		return fmt.Errorf("etcd member %d: %w", i, err)
	}
	c.mu.Lock()
	c.children[i] = child
	c.mu.Unlock()
	return nil
}

// Kill kills member i (SIGKILL).
func (c *EtcdCluster) Kill(i int) {
	c.mu.Lock()
	child := c.children[i]
	c.children[i] = nil
	c.mu.Unlock()
	if child != nil {
		child.Kill()
	}
}

// Stop kills every member.
func (c *EtcdCluster) Stop() {
	for i := range c.members {
		c.Kill(i)
	}
}

// EtcdStatus is what etcd's maintenance Status says of one member.
type EtcdStatus struct {
	// ID is the member's id; Leader the id of the member it follows (its
	// own if it leads); Term the raft term; Revision the store's.
	ID, Leader, Term uint64
	Revision         int64
}

// Status asks member i etcd's maintenance Status, through the gRPC
// gateway every member serves on its client URL (so no etcd client is
// needed here), within 2 s.
func (c *EtcdCluster) Status(ctx context.Context, i int) (EtcdStatus, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+c.members[i].Client+"/v3/maintenance/status", bytes.NewReader([]byte("{}")))
	if err != nil {
		return EtcdStatus{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return EtcdStatus{}, fmt.Errorf("etcd member %d status: %w", i, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return EtcdStatus{}, fmt.Errorf("etcd member %d status: %w", i, err)
	}
	if resp.StatusCode != http.StatusOK {
		return EtcdStatus{}, fmt.Errorf("etcd member %d status: %s: %s", i, resp.Status, bytes.TrimSpace(b))
	}
	st, err := parseEtcdStatus(b)
	if err != nil {
		return EtcdStatus{}, fmt.Errorf("etcd member %d status: %w", i, err)
	}
	return st, nil
}

// parseEtcdStatus reads the gateway's JSON of a StatusResponse (64-bit
// integers as strings; the header's fields in snake case).
func parseEtcdStatus(b []byte) (EtcdStatus, error) {
	var r struct {
		Header struct {
			MemberID jsonUint `json:"member_id"`
			Revision jsonUint `json:"revision"`
			RaftTerm jsonUint `json:"raft_term"`
		} `json:"header"`
		Leader jsonUint `json:"leader"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return EtcdStatus{}, err
	}
	if r.Header.MemberID == 0 {
		return EtcdStatus{}, fmt.Errorf("no member id in %s", b)
	}
	return EtcdStatus{ID: uint64(r.Header.MemberID), Leader: uint64(r.Leader), Term: uint64(r.Header.RaftTerm), Revision: int64(r.Header.Revision)}, nil
}

// jsonUint is a uint64 in JSON as a string (protobuf's JSON) or a number.
type jsonUint uint64

func (u *jsonUint) UnmarshalJSON(b []byte) error {
	n, err := strconv.ParseUint(strings.Trim(string(b), `"`), 10, 64)
	*u = jsonUint(n)
	return err
}

// Leader returns the member that leads the cluster, and its status: the
// running member whose id the others (and it) name as leader. It fails
// while there is none (an election under way, a quorum lost).
func (c *EtcdCluster) Leader(ctx context.Context) (int, EtcdStatus, error) {
	var leader uint64
	byID := map[uint64]int{}
	sts := map[int]EtcdStatus{}
	for i := range c.members {
		c.mu.Lock()
		up := c.children[i] != nil
		c.mu.Unlock()
		if !up {
			continue
		}
		st, err := c.Status(ctx, i)
		if err != nil {
			continue
		}
		byID[st.ID], sts[i] = i, st
		if st.Leader != 0 {
			leader = st.Leader
		}
	}
	i, ok := byID[leader]
	if leader == 0 || !ok {
		return 0, EtcdStatus{}, errors.New("loadtest: no etcd leader among the running members")
	}
	return i, sts[i], nil
}
