package report

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"time"
)

// The figures below are the parts the benchmarks' reports (loadtest's
// FanoutReport, CtripReport, ScaleReport …) have in common, declared once
// here so that each JSON name means one thing in every report. They are
// plain values: safe for concurrent reads, not for a write racing them.

// Machine describes where a report was measured.
type Machine struct {
	CPUs       int    `json:"cpus"`
	GOMAXPROCS int    `json:"gomaxprocs"`
	GoVersion  string `json:"go_version"`
	OS         string `json:"os"`
	LoadAvg    string `json:"loadavg_at_start"`
}

// ThisMachine describes the machine a report is measured on, now.
func ThisMachine() Machine {
	return Machine{CPUs: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0), GoVersion: runtime.Version(),
		OS: runtime.GOOS + "/" + runtime.GOARCH, LoadAvg: loadAvg()}
}

// String describes m in a line: "8 CPUs, GOMAXPROCS 8, go1.24.1,
// linux/amd64, load average at start 0.52 0.61 0.70".
func (m Machine) String() string {
	return fmt.Sprintf("%d CPUs, GOMAXPROCS %d, %s, %s, load average at start %s", m.CPUs, m.GOMAXPROCS, m.GoVersion, m.OS, m.LoadAvg)
}

// Short is String without GOMAXPROCS: the machine as the reports that
// hold it as a string (warmstart, chaos) name it.
func (m Machine) Short() string {
	return fmt.Sprintf("%d CPUs, %s, %s, load average at start %s", m.CPUs, m.GoVersion, m.OS, m.LoadAvg)
}

// loadAvg is the kernel's 1, 5 and 15 minute load averages ("" off Linux).
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

// LatencyMs is a latency distribution in milliseconds.
type LatencyMs struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50_ms"`
	P95 float64 `json:"p95_ms"`
	P99 float64 `json:"p99_ms"`
	Max float64 `json:"max_ms"`
}

// Ms returns l in milliseconds.
func (l Latency) Ms() LatencyMs {
	f := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	return LatencyMs{N: l.N, P50: f(l.P50), P95: f(l.P95), P99: f(l.P99), Max: f(l.Max)}
}

// Process is a process's CPU time and memory over a run: CPU over the
// initial sync and over the changes (or churn) after it, RSS at the end
// and at its peak.
type Process struct {
	CPUSyncS    float64 `json:"cpu_sync_s"`
	CPUChangesS float64 `json:"cpu_changes_s"`
	RSSEnd      uint64  `json:"rss_end_bytes"`
	RSSPeak     uint64  `json:"rss_peak_bytes"`
	// Pid is a child's process id; CPUs the CPUs it may run on, as the
	// kernel reported them of every one of its threads once it started.
	Pid        int    `json:"pid,omitempty"`
	CPUs       string `json:"cpus,omitempty"`
	CPUProfile string `json:"cpuprofile,omitempty"`
	// Err says why the figures could not be read ("": they were).
	Err string `json:"error,omitempty"`
}

// Pinning says where a benchmark's processes ran. Each run's
// Process.CPUs says what the kernel reported of each child.
type Pinning struct {
	// FleetProcess: the simulated Envoys ran in a child process of their
	// own; false: in the loadtest process.
	FleetProcess bool `json:"fleet_process"`
	// RelayCPUs and FleetCPUs are the CPU lists asked for ("": not
	// pinned); LoadtestCPUs are the CPUs the loadtest process itself may
	// use (it is never pinned).
	RelayCPUs    string `json:"relay_cpus,omitempty"`
	FleetCPUs    string `json:"fleet_cpus,omitempty"`
	LoadtestCPUs string `json:"loadtest_cpus,omitempty"`
}

func (p Pinning) String() string {
	cpus := func(s string) string {
		if s == "" {
			return "not pinned"
		}
		return "CPUs " + s
	}
	where := "in the loadtest process"
	if p.FleetProcess {
		where = "in a child process, " + cpus(p.FleetCPUs)
	}
	return fmt.Sprintf("relay child %s; fleet %s; loadtest process (upstream, tracker) not pinned (CPUs %s)",
		cpus(p.RelayCPUs), where, p.LoadtestCPUs)
}

// Health is what went wrong for the simulated Envoys of a run. A report
// embeds it, so its fields keep their JSON names at the report's level.
type Health struct {
	// Reconnects counts Envoy streams reopened (the relay or upstream
	// closed them, e.g. on a keepalive timeout when CPU is short).
	Reconnects uint64 `json:"envoy_reconnects"`
	// ReconnectReasons says why the last stream of each Envoy that
	// reopened one ended, most common first, each "N× reason".
	ReconnectReasons []string `json:"reconnect_reasons,omitempty"`
	// Violations counts the protocol violations the Envoys recorded; a
	// few of them are spelt out in ViolationSamples.
	Violations       int      `json:"violations"`
	ViolationSamples []string `json:"violation_samples,omitempty"`
}

// UpstreamStreams are the streams the upstream held once every Envoy
// had synced and at the end of the run. A report embeds it, so its
// fields keep their JSON names at the report's level.
type UpstreamStreams struct {
	AfterSync int64 `json:"upstream_streams"`
	AtEnd     int64 `json:"upstream_streams_end"`
}

// Are reports whether the upstream held n streams both times (n keys,
// one stream each, is what a tier should hold).
func (s UpstreamStreams) Are(n int) bool {
	return s.AfterSync == int64(n) && s.AtEnd == int64(n)
}

// Verdict is one target checked against one run.
type Verdict struct {
	Protocol  string `json:"protocol"`
	Transport string `json:"transport,omitempty"`
	Target    string `json:"target"`
	Measured  string `json:"measured"`
	Pass      bool   `json:"pass"`
}

// Judge prints a target's outcome: "PASS" or "FAIL".
func Judge(pass bool) string {
	if pass {
		return "PASS"
	}
	return "FAIL"
}
