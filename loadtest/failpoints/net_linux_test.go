package failpoints

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"testing"
	"time"
)

// TestChaosSlowLink: a slow link slows what goes to its relay's address,
// and nothing else; fast undoes it. (A tc filter that matched every
// packet once made the whole namespace the slow link.) It needs root, a
// network namespace, iptables and tc; it re-executes itself in a
// namespace of its own.
func TestChaosSlowLink(t *testing.T) {
	if !InNetns() {
		if err := CanCreateNetns(); err != nil {
			t.Skipf("%v", err)
		}
		if _, err := exec.LookPath("tc"); err != nil {
			t.Skipf("no tc: %v", err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := ReexecInNetns(ctx, os.Args[0], []string{"-test.run=^TestChaosSlowLink$", "-test.v"}); err != nil {
			t.Fatalf("the test in its network namespace failed (its output is above): %v", err)
		}
		return
	}
	n, err := NewNet([]uint32{relayUIDBase, relayUIDBase + 1})
	if err != nil {
		t.Fatal(err)
	}
	const small = 64 << 10
	how, err := n.Slow(1, relayIP(1), 200*time.Millisecond, 256, 0.01)
	if err != nil {
		t.Fatal(errors.Join(err, n.Fast()))
	}
	t.Logf("slow link: %s", how)
	// 64 KiB at 256 kbit/s take 2 s; with netem's 200 ms each way, more
	// than 400 ms.
	slowAt := 1500 * time.Millisecond
	if n.netem {
		slowAt = 400 * time.Millisecond
	}
	if d := transfer(t, relayIP(1), small); d < slowAt {
		t.Errorf("64 KiB to the slow relay's address took %v, want %v or more", d, slowAt)
	}
	if d := transfer(t, relayIP(2), 16<<20); d > time.Second {
		t.Errorf("16 MiB to another address took %v during the slow link, want well under a second", d)
	}
	if err := n.Fast(); err != nil {
		t.Fatal(err)
	}
	if d := transfer(t, relayIP(1), small); d > 300*time.Millisecond {
		t.Errorf("64 KiB to the relay's address took %v once the link healed", d)
	}
}

// relayUIDBase is the first relay's user, and relayIP a relay's address,
// as the chaos suite's.
const relayUIDBase = 61000

func relayIP(i int) string { return fmt.Sprintf("127.0.0.%d", 10+i) }

// transfer sends n bytes to a listener at host over loopback and returns
// how long until the listener read them all.
func transfer(t *testing.T, host string, n int) time.Duration {
	t.Helper()
	lis, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	done := make(chan error, 1)
	go func() {
		c, err := lis.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		_, err = io.CopyN(io.Discard, c, int64(n))
		done <- err
	}()
	start := time.Now()
	c, err := net.DialTimeout("tcp", lis.Addr().String(), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Minute))
	if _, err := c.Write(make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatalf("%d bytes to %s not read in a minute", n, host)
	}
	return time.Since(start)
}
