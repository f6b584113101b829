package failpoints

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// CPU starvation for the chaos suite: a relay's process moves into a
// cgroup of its own whose CPU quota is a few percent of one CPU, and back
// when the fault ends. cgroup v1's cpu controller (cpu.cfs_quota_us) or
// cgroup v2's (cpu.max, where the root delegates it) is used, whichever is
// mounted and writable; where neither is, the caller falls back to
// SIGSTOP/SIGCONT bursts. Cgroups are not namespaced by the run's network
// namespace: every group this package makes is named
// meshrelay-chaos-<driver pid>-<n>, removed when the fault ends (also when
// it fails), and groups a dead driver left are removed at the next run's
// start (SweepCPUGroups).

// cpuGroupPrefix starts the name of every cgroup the chaos suite makes.
const cpuGroupPrefix = "meshrelay-chaos-"

// cpuPeriod is the CFS period of a starved relay's group.
const cpuPeriod = 100 * time.Millisecond

var cpuGroupSeq atomic.Int64

// cgroupMount is a cgroup hierarchy that has the cpu controller.
type cgroupMount struct {
	dir string // where it is mounted
	v2  bool
}

// cpuMount finds the hierarchy with the cpu controller: cgroup v1's
// "cpu" mount, else a cgroup v2 mount whose root delegates cpu to its
// children.
func cpuMount() (cgroupMount, error) {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return cgroupMount{}, err
	}
	return findCPUMount(string(b), func(dir string) bool {
		sub, err := os.ReadFile(filepath.Join(dir, "cgroup.subtree_control"))
		return err == nil && hasField(string(sub), "cpu")
	})
}

// findCPUMount reads a /proc/self/mounts text; delegatesCPU says whether a
// cgroup v2 root gives its children the cpu controller.
func findCPUMount(mounts string, delegatesCPU func(dir string) bool) (cgroupMount, error) {
	var v2 []string
	for line := range strings.Lines(mounts) {
		f := strings.Fields(line)
		if len(f) < 4 {
			continue
		}
		switch f[2] {
		case "cgroup":
			if hasField(strings.ReplaceAll(f[3], ",", " "), "cpu") {
				return cgroupMount{dir: f[1]}, nil
			}
		case "cgroup2":
			v2 = append(v2, f[1])
		}
	}
	for _, dir := range v2 {
		if delegatesCPU(dir) {
			return cgroupMount{dir: dir, v2: true}, nil
		}
	}
	return cgroupMount{}, errors.New("no cgroup hierarchy with the cpu controller (cgroup v1 cpu, or cgroup v2 delegating cpu)")
}

func hasField(s, word string) bool {
	for _, f := range strings.Fields(s) {
		if f == word {
			return true
		}
	}
	return false
}

// procCgroup returns pid's group in the hierarchy m (a path from its
// root), from /proc/<pid>/cgroup.
func procCgroup(pid int, m cgroupMount) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", err
	}
	return parseProcCgroup(string(b), m.v2)
}

// parseProcCgroup reads a /proc/<pid>/cgroup text: the v2 line ("0::path")
// or the v1 line whose controllers include cpu.
func parseProcCgroup(text string, v2 bool) (string, error) {
	for line := range strings.Lines(text) {
		parts := strings.SplitN(strings.TrimSpace(line), ":", 3)
		if len(parts) != 3 {
			continue
		}
		if v2 && parts[0] == "0" && parts[1] == "" {
			return parts[2], nil
		}
		if !v2 && hasField(strings.ReplaceAll(parts[1], ",", " "), "cpu") {
			return parts[2], nil
		}
	}
	return "", errors.New("no cpu cgroup line")
}

// CPUCap holds a process to a share of one CPU. Release undoes it.
type CPUCap struct {
	dir  string // the group made for it
	back string // the cgroup.procs of the group it came from
	pid  int
	how  string
	done bool
}

// How says how the process is held (the cgroup version, its quota and
// the group).
func (c *CPUCap) How() string { return c.how }

// CapCPU moves pid into a new cgroup whose quota is share of one CPU
// (pid 0: makes the group and moves nothing, to find out whether it can).
// On error nothing is left behind.
func CapCPU(pid int, share float64) (*CPUCap, error) {
	m, err := cpuMount()
	if err != nil {
		return nil, err
	}
	from := "/"
	if pid > 0 {
		if from, err = procCgroup(pid, m); err != nil {
			return nil, fmt.Errorf("relay's cgroup: %w", err)
		}
	}
	name := fmt.Sprintf("%s%d-%d", cpuGroupPrefix, os.Getpid(), cpuGroupSeq.Add(1))
	c := &CPUCap{dir: filepath.Join(m.dir, name), back: filepath.Join(m.dir, from, "cgroup.procs"), pid: pid}
	if err := os.Mkdir(c.dir, 0o755); err != nil {
		return nil, err
	}
	period := cpuPeriod.Microseconds()
	quota := max(int64(share*float64(period)), 1000) // the kernel's least quota is 1 ms
	var files [][2]string
	if m.v2 {
		files = [][2]string{{"cpu.max", fmt.Sprintf("%d %d", quota, period)}}
		c.how = fmt.Sprintf("cgroup v2 cpu.max %d %d", quota, period)
	} else {
		files = [][2]string{{"cpu.cfs_period_us", strconv.FormatInt(period, 10)}, {"cpu.cfs_quota_us", strconv.FormatInt(quota, 10)}}
		c.how = fmt.Sprintf("cgroup v1 cpu.cfs_quota_us %d of cpu.cfs_period_us %d", quota, period)
	}
	if pid > 0 {
		files = append(files, [2]string{"cgroup.procs", strconv.Itoa(pid)})
	}
	for _, f := range files {
		if err := os.WriteFile(filepath.Join(c.dir, f[0]), []byte(f[1]), 0); err != nil {
			return nil, errors.Join(fmt.Errorf("%s: %w", f[0], err), c.Release())
		}
	}
	c.how += " in " + c.dir
	return c, nil
}

// Throttled says how often the group's quota held its process back, from
// its cpu.stat.
func (c *CPUCap) Throttled() string {
	b, err := os.ReadFile(filepath.Join(c.dir, "cpu.stat"))
	if err != nil {
		return err.Error()
	}
	st := map[string]int64{}
	for line := range strings.Lines(string(b)) {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), " "); ok {
			st[k], _ = strconv.ParseInt(v, 10, 64)
		}
	}
	held := time.Duration(st["throttled_time"]) // v1, ns
	if us, ok := st["throttled_usec"]; ok {     // v2
		held = time.Duration(us) * time.Microsecond
	}
	return fmt.Sprintf("throttled in %d of %d periods of %v, held back %v in all",
		st["nr_throttled"], st["nr_periods"], cpuPeriod, held.Round(time.Millisecond))
}

// Release moves the process back to its group (if it still runs) and
// removes the group made for it. It is idempotent.
func (c *CPUCap) Release() error {
	if c.done {
		return nil
	}
	c.done = true
	var errs []error
	if c.pid > 0 {
		if err := os.WriteFile(c.back, []byte(strconv.Itoa(c.pid)), 0); err != nil && processAlive(c.pid) {
			errs = append(errs, fmt.Errorf("move %d back: %w", c.pid, err))
		}
	}
	// A process that just exited may still count as a member for a moment.
	var err error
	for range 50 {
		if err = os.Remove(c.dir); err == nil || errors.Is(err, os.ErrNotExist) {
			return errors.Join(errs...)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return errors.Join(append(errs, fmt.Errorf("remove %s: %w", c.dir, err))...)
}

func processAlive(pid int) bool {
	_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
	return err == nil
}

// StarveHow says how a relay will be starved here: it makes and removes
// a group to find out.
func StarveHow() string {
	c, err := CapCPU(0, 0.05)
	if err != nil {
		return fmt.Sprintf("SIGSTOP/SIGCONT bursts (no writable cgroup cpu controller: %v)", err)
	}
	how := strings.SplitN(c.how, " cpu", 2)[0] // "cgroup v1" or "cgroup v2"
	if err := c.Release(); err != nil {
		return fmt.Sprintf("SIGSTOP/SIGCONT bursts (a cgroup could not be undone: %v)", err)
	}
	return how + " CPU quota"
}

// SweepCPUGroups removes the groups that chaos drivers no longer running
// left behind (a driver killed with SIGKILL cannot clean up); their
// relays died with them, so the groups are empty.
func SweepCPUGroups() {
	m, err := cpuMount()
	if err != nil {
		return
	}
	entries, err := os.ReadDir(m.dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), cpuGroupPrefix)
		if !ok || !e.IsDir() {
			continue
		}
		pidStr, _, _ := strings.Cut(rest, "-")
		if pid, err := strconv.Atoi(pidStr); err == nil && !processAlive(pid) {
			_ = os.Remove(filepath.Join(m.dir, e.Name()))
		}
	}
}
