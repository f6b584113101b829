package snapshot

import (
	"context"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Meter watches what a tier's stores write to etcd, as etcd reports it to
// a watcher, and measures what is stored: the warm-start benchmark's view,
// independent of the writers' own counts. Close it when done.
type Meter struct {
	cli    *clientv3.Client
	prefix string
	cancel context.CancelFunc
	done   chan struct{}

	mu    sync.Mutex
	puts  int64
	bytes int64
	last  time.Time
}

// NewMeter watches everything under prefix+cluster+"/" on endpoints.
func NewMeter(ctx context.Context, endpoints []string, prefix, cluster string) (*Meter, error) {
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop(), MaxCallRecvMsgSize: 512 << 20})
	if err != nil {
		return nil, fmt.Errorf("snapshot: meter: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	m := &Meter{cli: cli, prefix: prefix + cluster + "/", cancel: cancel, done: make(chan struct{})}
	wc := cli.Watch(clientv3.WithRequireLeader(ctx), m.prefix, clientv3.WithPrefix())
	go func() {
		defer close(m.done)
		for resp := range wc {
			m.mu.Lock()
			for _, ev := range resp.Events {
				if ev.Type == clientv3.EventTypePut {
					m.puts++
					m.bytes += int64(len(ev.Kv.Key) + len(ev.Kv.Value))
				}
			}
			m.last = time.Now()
			m.mu.Unlock()
		}
	}()
	return m, nil
}

// Written returns the puts seen so far and their bytes (keys and values).
func (m *Meter) Written() (puts, bytes int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.puts, m.bytes
}

// WaitBeyond waits until more than bytes were written, or ctx ends.
func (m *Meter) WaitBeyond(ctx context.Context, bytes int64) error {
	for {
		if _, b := m.Written(); b > bytes {
			return nil
		}
		t := time.NewTimer(10 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Quiet waits until nothing was written for d, or ctx ends.
func (m *Meter) Quiet(ctx context.Context, d time.Duration) error {
	for {
		m.mu.Lock()
		since := time.Since(m.last)
		m.mu.Unlock()
		if since >= d {
			return nil
		}
		t := time.NewTimer(d - since)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Stored returns the number of keys under the prefix and the bytes of their
// keys and values, and the size of etcd's database file.
func (m *Meter) Stored(ctx context.Context) (keys, bytes, dbSize int64, err error) {
	end := clientv3.GetPrefixRangeEnd(m.prefix)
	from := m.prefix
	for {
		resp, err := m.cli.Get(ctx, from, clientv3.WithRange(end), clientv3.WithLimit(listPage))
		if err != nil {
			return 0, 0, 0, fmt.Errorf("snapshot: meter: %w", err)
		}
		for _, kv := range resp.Kvs {
			keys++
			bytes += int64(len(kv.Key) + len(kv.Value))
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	for _, ep := range m.cli.Endpoints() {
		st, err := m.cli.Status(ctx, ep)
		if err == nil {
			dbSize = max(dbSize, st.DbSize)
		}
	}
	return keys, bytes, dbSize, nil
}

// Close stops watching.
func (m *Meter) Close() error {
	m.cancel()
	err := m.cli.Close()
	<-m.done
	return err
}
