package loadtest

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// AllowedCPUs returns the CPUs this process may run on (the calling
// thread's affinity, which every thread of a process not pinned per
// thread shares).
func AllowedCPUs() (CPUSet, error) {
	var m unix.CPUSet
	if err := unix.SchedGetaffinity(0, &m); err != nil {
		return nil, fmt.Errorf("loadtest: sched_getaffinity: %w", err)
	}
	return fromMask(&m), nil
}

func fromMask(m *unix.CPUSet) CPUSet {
	var out CPUSet
	for c := 0; c < len(m)*64 && len(out) < m.Count(); c++ {
		if m.IsSet(c) {
			out = append(out, c)
		}
	}
	return out
}

func toMask(s CPUSet) (*unix.CPUSet, error) {
	var m unix.CPUSet
	for _, c := range s {
		if c >= len(m)*64 {
			return nil, fmt.Errorf("loadtest: CPU %d beyond the %d a mask holds", c, len(m)*64)
		}
		m.Set(c)
	}
	return &m, nil
}

// startPinned runs start, which must start a process (fork and exec) on
// the calling goroutine, with the calling thread's affinity set to cpus,
// so that the process and every thread it ever makes inherit it from its
// first instruction (as taskset does; pinning a Go child after it started
// would miss the threads its runtime already made, and its GOMAXPROCS
// would count CPUs it may not use). The thread's affinity is restored
// before startPinned returns. An empty cpus runs start as it is.
func startPinned(cpus CPUSet, start func() error) error {
	if len(cpus) == 0 {
		return start()
	}
	want, err := toMask(cpus)
	if err != nil {
		return err
	}
	// The thread stays locked only while its mask differs, and is unlocked
	// (never ended) after: Pdeathsig of the child is tied to this thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var saved unix.CPUSet
	if err := unix.SchedGetaffinity(0, &saved); err != nil {
		return fmt.Errorf("loadtest: sched_getaffinity: %w", err)
	}
	if err := unix.SchedSetaffinity(0, want); err != nil {
		return fmt.Errorf("loadtest: pin to CPUs %s: %w", cpus, err)
	}
	startErr := start()
	if err := unix.SchedSetaffinity(0, &saved); err != nil {
		// Cannot happen with a mask the thread had; if it did, this
		// thread would run pinned, so say it loudly.
		panic(fmt.Sprintf("loadtest: restore this thread's CPUs after starting a pinned child: %v", err))
	}
	return startErr
}

// PinProcess sets the affinity of every thread of this process to cpus
// (new threads inherit it from the thread that makes them). Threads that
// appear while it works are pinned on a later pass; it gives up after a
// few passes if threads keep appearing.
func PinProcess(cpus CPUSet) error {
	if len(cpus) == 0 {
		return nil
	}
	want, err := toMask(cpus)
	if err != nil {
		return err
	}
	done := map[int]bool{}
	for range 10 {
		tids, err := threads(os.Getpid())
		if err != nil {
			return err
		}
		fresh := 0
		for _, tid := range tids {
			if done[tid] {
				continue
			}
			fresh++
			if err := unix.SchedSetaffinity(tid, want); err != nil && err != unix.ESRCH {
				return fmt.Errorf("loadtest: pin thread %d to CPUs %s: %w", tid, cpus, err)
			}
			done[tid] = true
		}
		if fresh == 0 {
			return nil
		}
	}
	return fmt.Errorf("loadtest: pin to CPUs %s: threads kept appearing", cpus)
}

// threads lists the thread ids of pid.
func threads(pid int) ([]int, error) {
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		return nil, fmt.Errorf("loadtest: threads of %d: %w", pid, err)
	}
	var out []int
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			out = append(out, tid)
		}
	}
	return out, nil
}

// ProcessCPUs returns the CPUs process pid may run on, as every one of its
// threads reports it in /proc/<pid>/task/<tid>/status (Cpus_allowed_list);
// it fails if its threads disagree (a process pinned after it started).
func ProcessCPUs(pid int) (CPUSet, error) {
	tids, err := threads(pid)
	if err != nil {
		return nil, err
	}
	var first CPUSet
	for _, tid := range tids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/status", pid, tid))
		if err != nil {
			if os.IsNotExist(err) {
				continue // the thread ended
			}
			return nil, fmt.Errorf("loadtest: CPUs of %d: %w", pid, err)
		}
		s, err := cpusAllowed(b)
		if err != nil {
			return nil, fmt.Errorf("loadtest: /proc/%d/task/%d/status: %w", pid, tid, err)
		}
		if first == nil {
			first = s
		} else if !s.Equal(first) {
			return nil, fmt.Errorf("loadtest: threads of %d run on different CPUs: %s and %s (thread %d)", pid, first, s, tid)
		}
	}
	if first == nil {
		return nil, fmt.Errorf("loadtest: CPUs of %d: no thread", pid)
	}
	return first, nil
}

// cpusAllowed reads Cpus_allowed_list from a /proc status file.
func cpusAllowed(status []byte) (CPUSet, error) {
	for line := range strings.Lines(string(status)) {
		if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok {
			return ParseCPUSet(v)
		}
	}
	return nil, fmt.Errorf("no Cpus_allowed_list")
}
