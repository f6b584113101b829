package failpoints

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestFindCPUMount(t *testing.T) {
	hybrid := "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid 0 0\n" +
		"cgroup /sys/fs/cgroup/cpuacct cgroup rw,cpuacct 0 0\n" +
		"cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0\n"
	pure := "proc /proc proc rw 0 0\ncgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n"
	for _, tc := range []struct {
		name, mounts string
		delegates    bool
		want         cgroupMount
		wantErr      bool
	}{
		{"v1 cpu wins", hybrid, true, cgroupMount{dir: "/sys/fs/cgroup/cpu,cpuacct"}, false},
		{"v2 delegating cpu", pure, true, cgroupMount{dir: "/sys/fs/cgroup", v2: true}, false},
		{"v2 not delegating cpu", pure, false, cgroupMount{}, true},
		{"cpuacct is not cpu", "cgroup /sys/fs/cgroup/cpuacct cgroup rw,cpuacct 0 0\n", false, cgroupMount{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := findCPUMount(tc.mounts, func(string) bool { return tc.delegates })
			if got != tc.want || (err != nil) != tc.wantErr {
				t.Errorf("findCPUMount = %+v, %v; want %+v, error %v", got, err, tc.want, tc.wantErr)
			}
		})
	}
}

func TestParseProcCgroup(t *testing.T) {
	text := "9:name=systemd:/\n4:memory:/process_api/x\n2:cpu,cpuacct:/kubepods/pod1\n0::/user.slice\n"
	if got, err := parseProcCgroup(text, false); got != "/kubepods/pod1" || err != nil {
		t.Errorf("parseProcCgroup(v1) = %q, %v; want /kubepods/pod1", got, err)
	}
	if got, err := parseProcCgroup(text, true); got != "/user.slice" || err != nil {
		t.Errorf("parseProcCgroup(v2) = %q, %v; want /user.slice", got, err)
	}
	if _, err := parseProcCgroup("4:memory:/\n", false); err == nil {
		t.Error("parseProcCgroup of no cpu line succeeded")
	}
}

// TestCapCPU moves a real process into a starved group and back, and
// leaves no group behind. It needs root and a writable cpu controller.
func TestCapCPU(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	probe, err := CapCPU(0, 0.05)
	if err != nil {
		t.Skipf("no writable cgroup cpu controller: %v", err)
	}
	if err := probe.Release(); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()
	m, err := cpuMount()
	if err != nil {
		t.Fatal(err)
	}
	before, err := procCgroup(cmd.Process.Pid, m)
	if err != nil {
		t.Fatal(err)
	}
	c, err := CapCPU(cmd.Process.Pid, 0.03)
	if err != nil {
		t.Fatal(err)
	}
	in, err := procCgroup(cmd.Process.Pid, m)
	if err != nil || "/"+filepath.Base(c.dir) != in {
		t.Errorf("capped process is in %q (%v), want %q", in, err, "/"+filepath.Base(c.dir))
	}
	if !strings.Contains(c.how, "3000") {
		t.Errorf("how = %q, want a quota of 3000 µs", c.how)
	}
	if err := c.Release(); err != nil {
		t.Fatal(err)
	}
	if err := c.Release(); err != nil {
		t.Errorf("second release: %v", err)
	}
	after, err := procCgroup(cmd.Process.Pid, m)
	if err != nil || after != before {
		t.Errorf("released process is in %q (%v), want %q", after, err, before)
	}
	if _, err := os.Stat(c.dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("group %s still there after release: %v", c.dir, err)
	}
}
