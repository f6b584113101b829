package loadtest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// clockTicks is the kernel's USER_HZ, the unit of utime and stime in
// /proc/<pid>/stat: 100 on every Linux architecture Go supports (reading
// sysconf(_SC_CLK_TCK) would need cgo).
const clockTicks = 100

// ProcStat is what the kernel reports of a process at one moment.
type ProcStat struct {
	// CPU is the user plus system time the process has used since it
	// started, at 10 ms resolution.
	CPU time.Duration
	// RSS is its resident set size now (VmRSS), in bytes.
	RSS uint64
	// PeakRSS is the largest RSS it has had (VmHWM), in bytes.
	PeakRSS uint64
}

// ReadProcStat reads /proc/<pid>/stat and /proc/<pid>/status. It works on
// Linux only; elsewhere it returns an error. Safe for concurrent use.
func ReadProcStat(pid int) (ProcStat, error) {
	dir := "/proc/" + strconv.Itoa(pid)
	stat, err := os.ReadFile(dir + "/stat")
	if err != nil {
		return ProcStat{}, fmt.Errorf("loadtest: read process stats: %w", err)
	}
	status, err := os.ReadFile(dir + "/status")
	if err != nil {
		return ProcStat{}, fmt.Errorf("loadtest: read process stats: %w", err)
	}
	var ps ProcStat
	if ps.CPU, err = parseProcStat(stat); err != nil {
		return ProcStat{}, fmt.Errorf("loadtest: %s/stat: %w", dir, err)
	}
	if ps.RSS, ps.PeakRSS, err = parseProcStatus(status); err != nil {
		return ProcStat{}, fmt.Errorf("loadtest: %s/status: %w", dir, err)
	}
	return ps, nil
}

// parseProcStat returns utime+stime of a /proc/<pid>/stat line. The second
// field, the command name in parentheses, may itself hold spaces and
// parentheses, so fields are counted from the last ')'.
func parseProcStat(b []byte) (time.Duration, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("no command name")
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); utime and stime are fields 14 and 15.
	if len(f) < 13 {
		return 0, fmt.Errorf("%d fields after the command name, want at least 13", len(f))
	}
	var ticks uint64
	for _, s := range f[11:13] {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("utime/stime: %w", err)
		}
		ticks += n
	}
	return time.Duration(ticks) * (time.Second / clockTicks), nil
}

// parseProcStatus returns VmRSS and VmHWM, in bytes, of a
// /proc/<pid>/status file.
func parseProcStatus(b []byte) (rss, hwm uint64, err error) {
	var seenRSS, seenHWM bool
	for line := range strings.Lines(string(b)) {
		key, val, ok := strings.Cut(line, ":")
		if !ok || (key != "VmRSS" && key != "VmHWM") {
			continue
		}
		f := strings.Fields(val)
		if len(f) != 2 || f[1] != "kB" {
			return 0, 0, fmt.Errorf("%s: want \"<n> kB\", got %q", key, strings.TrimSpace(val))
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("%s: %w", key, err)
		}
		if key == "VmRSS" {
			rss, seenRSS = n<<10, true
		} else {
			hwm, seenHWM = n<<10, true
		}
	}
	if !seenRSS || !seenHWM {
		return 0, 0, errors.New("no VmRSS or VmHWM (a kernel thread, or a zombie)")
	}
	return rss, hwm, nil
}

// ChildConfig describes a child process for StartChild.
type ChildConfig struct {
	// Path is the executable. Required.
	Path string
	// Args are its arguments (without the program name).
	Args []string
	// Env is added to the parent's environment.
	Env []string
	// Stderr receives the child's stderr. Nil: discarded.
	Stderr io.Writer
	// ReadyTimeout bounds the wait for the child to print its address and
	// accept a connection there. Default 30s.
	ReadyTimeout time.Duration
	// Addr, if set, is where the child listens: it is not expected to
	// print its address (a program of its own, like meshrelay serve), and
	// StartChild waits until it accepts connections there.
	Addr string
	// OnLine, if set, is called with every other line the child prints on
	// stdout, in order, from one goroutine. It must not block for long.
	OnLine func(line string)
	// Dir is the child's working directory. Default: the parent's.
	Dir string
	// User, if set, runs the child as another user (the parent must be
	// root; Linux only).
	User *ChildUser
	// CPUs, if set, pins the child to these CPUs from its first
	// instruction: it and every thread it makes may run only there
	// (sched_setaffinity, Linux only).
	CPUs CPUSet
	// ExtraFiles are given to the child as file descriptors 3, 4, …;
	// StartChild closes the parent's copies once the child has started
	// (or failed to), so that the child's exit closes the other end.
	ExtraFiles []*os.File
	// NoListen says the child listens nowhere: its ready line is
	// "xds -", and StartChild does not dial it.
	NoListen bool
}

// ChildUser is the user and group a child runs as.
type ChildUser struct{ UID, GID uint32 }

// serveChild is the end of a child process's main: it reports addr on out
// (the line StartChild waits for), then returns when in reaches EOF (the
// parent stopped it or went away), ctx ends, or failed (if not nil) reports
// an error, which it returns.
func serveChild(ctx context.Context, addr string, in io.Reader, out io.Writer, failed <-chan error) error {
	if _, err := fmt.Fprintf(out, "%s%s\n", readyPrefix, addr); err != nil {
		return err
	}
	eof := make(chan struct{})
	go func() {
		defer close(eof)
		_, _ = io.Copy(io.Discard, in)
	}()
	select {
	case <-ctx.Done():
	case <-eof:
	case err := <-failed:
		return err
	}
	return nil
}

// readCommands reads a child's commands from in, one a line, trimmed,
// and hands each to cmds until in ends (then it closes eof) or ctx does.
// The goroutine it starts may stay blocked reading in after ctx ends, so
// call it only in a child process's main.
func readCommands(ctx context.Context, in io.Reader) (cmds <-chan string, eof <-chan struct{}) {
	c := make(chan string)
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(in)
		for sc.Scan() {
			select {
			case c <- strings.TrimSpace(sc.Text()):
			case <-ctx.Done():
				return
			}
		}
	}()
	return c, done
}

// ProfileCPU starts this process's CPU profile into a new file at path;
// stop ends the profile and closes the file. One profile runs at a time
// in a process (runtime/pprof).
func ProfileCPU(path string) (stop func() error, err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}, nil
}

// readyPrefix starts the line a child prints on stdout once it listens:
// "xds <host:port>" ("xds -" for a child that listens nowhere).
const readyPrefix = "xds "

// maxChildLine bounds a line a child prints on stdout; a longer one ends
// the reading (and the child, blocked on a full pipe, is stopped by Stop).
const maxChildLine = 16 << 20

// Child is a server running in a process of its own, started by StartChild.
// Its methods are safe for concurrent use. Whoever starts it must call Stop.
//
// A child never outlives its parent: Stop ends it (SIGTERM, then SIGKILL
// after a grace period); so does the end of the context it was started
// with; if the parent dies, the kernel kills it (Pdeathsig, on Linux) and
// its stdin reaches EOF, which RunRelayChild takes as an order to exit.
type Child struct {
	cmd    *exec.Cmd
	addr   string
	stdin  *os.File // our end of the child's stdin; closing it is EOF there
	exited chan struct{}
	outEnd chan struct{} // the stdout reader is done

	mu      sync.Mutex
	waitErr error
	stopped bool
}

// StartChild starts cfg.Path and returns once the child has printed
// "xds <addr>" on stdout and accepts connections at addr, or fails after
// cfg.ReadyTimeout. The child gets its own process group, so a Ctrl-C on the
// terminal reaches only the parent, which stops things in order. If ctx ends,
// the child is sent SIGTERM, then killed 5 s later.
func StartChild(ctx context.Context, cfg ChildConfig) (*Child, error) {
	if cfg.Path == "" {
		return nil, errors.New("loadtest: field ChildConfig.Path is empty")
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = 30 * time.Second
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("loadtest: child stdin: %w", err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, fmt.Errorf("loadtest: child stdout: %w", err)
	}
	cmd := exec.CommandContext(ctx, cfg.Path, cfg.Args...)
	cmd.Env = append(os.Environ(), cfg.Env...)
	cmd.Stdin, cmd.Stdout = inR, outW
	cmd.Stderr = cfg.Stderr
	cmd.SysProcAttr = childSysProcAttr(cfg.User)
	cmd.Dir = cfg.Dir
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 5 * time.Second
	cmd.ExtraFiles = cfg.ExtraFiles
	err = startPinned(cfg.CPUs, cmd.Start)
	inR.Close() // the child holds its own copies
	outW.Close()
	for _, f := range cfg.ExtraFiles {
		f.Close()
	}
	if err != nil {
		inW.Close()
		outR.Close()
		return nil, fmt.Errorf("loadtest: start %s: %w", cfg.Path, err)
	}
	c := &Child{cmd: cmd, stdin: inW, exited: make(chan struct{}), outEnd: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		c.mu.Lock()
		c.waitErr = err
		c.mu.Unlock()
		close(c.exited)
	}()
	ready := make(chan string, 1)
	go func() {
		// Reads until the child closes stdout (it exits), so the child never
		// blocks on a full pipe.
		defer close(c.outEnd)
		defer outR.Close()
		sc := bufio.NewScanner(outR)
		sc.Buffer(make([]byte, 0, 64<<10), maxChildLine)
		for sc.Scan() {
			if addr, ok := strings.CutPrefix(sc.Text(), readyPrefix); ok && cfg.Addr == "" {
				select {
				case ready <- strings.TrimSpace(addr):
				default:
				}
			} else if cfg.OnLine != nil {
				cfg.OnLine(sc.Text())
			}
		}
	}()

	timer := time.NewTimer(cfg.ReadyTimeout)
	defer timer.Stop()
	fail := func(err error) (*Child, error) {
		stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = c.Stop(stopCtx)
		return nil, err
	}
	if cfg.Addr != "" {
		ready <- cfg.Addr
	}
	select {
	case c.addr = <-ready:
		if cfg.NoListen {
			return c, nil
		}
	case <-c.exited:
		return fail(fmt.Errorf("loadtest: child %s exited before it was ready: %v", cfg.Path, c.exitErr()))
	case <-timer.C:
		return fail(fmt.Errorf("loadtest: child %s not ready after %v", cfg.Path, cfg.ReadyTimeout))
	case <-ctx.Done():
		return fail(ctx.Err())
	}
	// It listens before it prints; make sure it accepts. (A child with a
	// known Addr may still be starting: try until the deadline.)
	deadline := time.Now().Add(cfg.ReadyTimeout)
	for {
		d := net.Dialer{Deadline: deadline}
		conn, err := d.DialContext(ctx, "tcp", c.addr)
		if err == nil {
			conn.Close()
			return c, nil
		}
		select {
		case <-c.exited:
			return fail(fmt.Errorf("loadtest: child %s exited before it was ready: %v", cfg.Path, c.exitErr()))
		default:
		}
		if cfg.Addr == "" || time.Now().After(deadline) || ctx.Err() != nil {
			return fail(fmt.Errorf("loadtest: child %s does not accept at %s: %w", cfg.Path, c.addr, err))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Signal sends sig to the child's process group (SIGSTOP freezes it,
// SIGCONT thaws it). It does nothing once the child has exited.
func (c *Child) Signal(sig syscall.Signal) error {
	select {
	case <-c.exited:
		return nil
	default:
	}
	return signalGroup(c.Pid(), sig)
}

// Kill ends the child at once (SIGKILL to its process group, as a crash or
// an OOM kill would) and returns once it has exited and its output is
// read. It is idempotent; Stop after Kill returns at once.
func (c *Child) Kill() {
	c.mu.Lock()
	if !c.stopped {
		c.stopped = true
		c.stdin.Close()
	}
	c.mu.Unlock()
	_ = c.Signal(syscall.SIGKILL)
	<-c.exited
	<-c.outEnd
}

// Exited is closed once the child has exited.
func (c *Child) Exited() <-chan struct{} { return c.exited }

// Addr is the address the child printed.
func (c *Child) Addr() string { return c.addr }

// Pid is the child's process id.
func (c *Child) Pid() int { return c.cmd.Process.Pid }

// Stat reads the child's CPU time and memory (Linux only).
func (c *Child) Stat() (ProcStat, error) { return ReadProcStat(c.Pid()) }

// Send writes line to the child's stdin (RunRelayChild reads commands
// there).
func (c *Child) Send(line string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return errors.New("loadtest: child stopped")
	}
	_, err := io.WriteString(c.stdin, line+"\n")
	return err
}

func (c *Child) exitErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.waitErr
}

// Stop asks the child to exit (SIGTERM), kills it if it has not exited when
// ctx ends, and returns once it has exited and its output is read. It
// returns nil if the child exited by itself with status 0 or by the
// signal, and is idempotent.
func (c *Child) Stop(ctx context.Context) error {
	c.mu.Lock()
	if !c.stopped {
		c.stopped = true
		c.stdin.Close()
	}
	c.mu.Unlock()
	select {
	case <-c.exited:
	default:
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.exited:
		case <-ctx.Done():
			_ = c.cmd.Process.Kill()
			<-c.exited // Wait returns: the process is gone (WaitDelay bounds the pipes)
		}
	}
	<-c.outEnd
	err := c.exitErr()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGTERM {
			return nil
		}
	}
	if err != nil {
		return fmt.Errorf("loadtest: child %d: %w", c.Pid(), err)
	}
	return nil
}
