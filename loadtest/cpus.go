package loadtest

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/pflag"
)

// CPUSet is a set of CPU numbers, written as taskset and the kernel's
// Cpus_allowed_list write it: "0", "0-1,3". The empty set means "not
// pinned". Its elements are sorted and distinct.
type CPUSet []int

// maxCPU bounds the CPU numbers ParseCPUSet accepts (the kernel's
// NR_CPUS is at most 8,192).
const maxCPU = 8191

// ParseCPUSet parses a CPU list: comma-separated CPU numbers and ranges
// "a-b" (a ≤ b). "" is the empty set.
func ParseCPUSet(s string) (CPUSet, error) {
	var out CPUSet
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := parseCPU(lo)
		if err != nil {
			return nil, fmt.Errorf("loadtest: CPU list %q: %w", s, err)
		}
		b := a
		if isRange {
			if b, err = parseCPU(hi); err != nil {
				return nil, fmt.Errorf("loadtest: CPU list %q: %w", s, err)
			}
			if b < a {
				return nil, fmt.Errorf("loadtest: CPU list %q: range %q runs backwards", s, part)
			}
		}
		for c := a; c <= b; c++ {
			out = append(out, c)
		}
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

func parseCPU(s string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil || n < 0 || n > maxCPU {
		return 0, fmt.Errorf("%q is not a CPU number (0 to %d)", s, maxCPU)
	}
	return n, nil
}

// String writes s as a CPU list, ranges folded: "0-2,5".
func (s CPUSet) String() string {
	var b strings.Builder
	for i := 0; i < len(s); {
		j := i
		for j+1 < len(s) && s[j+1] == s[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(s[i]))
		if j > i {
			b.WriteByte('-')
			b.WriteString(strconv.Itoa(s[j]))
		}
		i = j + 1
	}
	return b.String()
}

// Equal reports whether s and t hold the same CPUs.
func (s CPUSet) Equal(t CPUSet) bool { return slices.Equal(s, t) }

// Overlaps reports whether s and t share a CPU.
func (s CPUSet) Overlaps(t CPUSet) bool {
	return slices.ContainsFunc(s, func(c int) bool { return slices.Contains(t, c) })
}

// within returns an error naming the CPUs of s that allowed lacks.
func (s CPUSet) within(allowed CPUSet) error {
	var bad CPUSet
	for _, c := range s {
		if !slices.Contains(allowed, c) {
			bad = append(bad, c)
		}
	}
	if len(bad) > 0 {
		if len(bad) == 1 {
			return fmt.Errorf("CPU %s is not one this process may use (%s)", bad, allowed)
		}
		return fmt.Errorf("CPUs %s are not ones this process may use (%s)", bad, allowed)
	}
	return nil
}

// CPUSetFlag is a pflag.Value for a CPU list (--relay-cpus 0).
type CPUSetFlag struct{ CPUs *CPUSet }

var _ pflag.Value = CPUSetFlag{}

func (f CPUSetFlag) String() string {
	if f.CPUs == nil {
		return ""
	}
	return f.CPUs.String()
}

// Set implements pflag.Value.
func (f CPUSetFlag) Set(s string) error {
	c, err := ParseCPUSet(s)
	if err == nil {
		*f.CPUs = c
	}
	return err
}

// Type implements pflag.Value.
func (CPUSetFlag) Type() string { return "cpus" }

// errNoAffinity is what the CPU functions return where the kernel offers
// no affinity (anything but Linux).
var errNoAffinity = errors.New("loadtest: CPU pinning needs Linux (sched_setaffinity)")

// CheckCPUs checks that s holds only CPUs this process may use; name
// says where s came from (a flag, a field) and starts the error. An
// empty s passes.
func CheckCPUs(name string, s CPUSet) error {
	if len(s) == 0 {
		return nil
	}
	allowed, err := AllowedCPUs()
	if err == nil {
		err = s.within(allowed)
	}
	if err != nil {
		return fmt.Errorf("%s %s: %w", name, s, err)
	}
	return nil
}
