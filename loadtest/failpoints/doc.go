// Package failpoints makes the faults of the chaos suite, from outside the
// processes it hurts (no seam in the relay): a network namespace of the
// run's own (ReexecInNetns), links between relays cut and slowed in it
// with iptables and tc (Net), and a process's CPU starved through a
// cgroup of its own (CapCPU). What to break, when, and what must still
// hold are the chaos suite's (package loadtest, loadtest/validation).
package failpoints
