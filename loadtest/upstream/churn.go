package upstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"time"
)

// ChurnConfig configures Churn. Churn is always bounded: Count or Duration
// (or both) must be set.
type ChurnConfig struct {
	// Rate is the number of mutations per second. Must be > 0.
	Rate float64
	// Duration bounds the churn in time. Zero means no time bound (Count
	// must then be > 0).
	Duration time.Duration
	// Count bounds the number of mutations. Zero means no count bound
	// (Duration must then be > 0).
	Count int
	// AddRemoveFraction is the fraction, in [0, 1], of mutations that add or
	// remove a service (alternately); the rest move an endpoint. Zero means
	// only endpoint moves.
	AddRemoveFraction float64
	// Seed seeds the choice of mutations and their targets; the same seed on
	// the same scenario gives the same sequence.
	Seed int64
}

func (c ChurnConfig) validate() error {
	switch {
	case math.IsNaN(c.Rate) || math.IsInf(c.Rate, 0) || c.Rate <= 0:
		return fmt.Errorf("upstream: field ChurnConfig.Rate must be > 0, got %v", c.Rate)
	case c.Count < 0:
		return fmt.Errorf("upstream: field ChurnConfig.Count must be >= 0, got %d", c.Count)
	case c.Duration < 0:
		return fmt.Errorf("upstream: field ChurnConfig.Duration must be >= 0, got %v", c.Duration)
	case c.Count == 0 && c.Duration == 0:
		return errors.New("upstream: field ChurnConfig.Count or ChurnConfig.Duration must be set: churn is never unbounded")
	case math.IsNaN(c.AddRemoveFraction) || c.AddRemoveFraction < 0 || c.AddRemoveFraction > 1:
		return fmt.Errorf("upstream: field ChurnConfig.AddRemoveFraction must be in [0, 1], got %v", c.AddRemoveFraction)
	}
	return nil
}

// Churn mutates the configuration at cfg.Rate mutations per second until
// cfg.Count mutations are done, cfg.Duration has passed or ctx is done,
// whichever comes first. It blocks and calls onChange (if not nil), on the
// calling goroutine, for every Change published, in order. It returns nil
// when Count or Duration ends it, ctx.Err() when ctx does. Several Churns may
// run at once; each mutation is atomic.
func (u *Upstream) Churn(ctx context.Context, cfg ChurnConfig, onChange func(Change)) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	ch := u.NewChurner(cfg.Seed, cfg.AddRemoveFraction)
	var deadline <-chan time.Time
	if cfg.Duration > 0 {
		timer := time.NewTimer(cfg.Duration)
		defer timer.Stop()
		deadline = timer.C
	}
	tick := time.Duration(float64(time.Second) / cfg.Rate)
	tick = max(tick, time.Millisecond)
	ticker := time.NewTicker(tick)
	defer ticker.Stop()

	start := time.Now()
	done := 0
	for {
		// Catch up with the schedule; the first mutation is immediate.
		due := int(math.Min(time.Since(start).Seconds()*cfg.Rate, math.MaxInt32)) + 1
		if cfg.Count > 0 {
			due = min(due, cfg.Count)
		}
		for ; done < due; done++ {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-deadline:
				return nil
			default:
			}
			changes, err := ch.Step()
			if err != nil {
				return err
			}
			if onChange != nil {
				for _, c := range changes {
					onChange(c)
				}
			}
		}
		if cfg.Count > 0 && done >= cfg.Count {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline:
			return nil
		case <-ticker.C:
		}
	}
}

type churnState struct {
	addNext bool // the next add/remove mutation adds
}

// Churner applies the mutations of a churn one at a time, when its caller
// says: the same seed on the same scenario gives the same sequence of
// mutations, generations and content, so two Upstreams stepped alike (a
// process and its mirror, or a process restarted and stepped again to where
// it was) serve the same. Not safe for concurrent use; the Upstream it
// mutates is.
type Churner struct {
	u         *Upstream
	rng       *rand.Rand
	addRemove float64
	st        churnState
	steps     int
}

// NewChurner returns a Churner of u with ChurnConfig's Seed and
// AddRemoveFraction meanings.
func (u *Upstream) NewChurner(seed int64, addRemoveFraction float64) *Churner {
	return &Churner{
		u:         u,
		rng:       rand.New(rand.NewPCG(uint64(seed), 0x6d657368726c6179)),
		addRemove: addRemoveFraction,
		st:        churnState{addNext: true},
	}
}

// Step applies the next mutation and returns the Changes it published.
func (c *Churner) Step() ([]Change, error) {
	changes, err := c.u.churnStep(c.rng, c.addRemove, &c.st)
	if err != nil {
		return changes, fmt.Errorf("upstream: churn: %w", err)
	}
	c.steps++
	return changes, nil
}

// Steps is the number of mutations applied.
func (c *Churner) Steps() int { return c.steps }

// churnStep applies one mutation chosen with rng.
func (u *Upstream) churnStep(rng *rand.Rand, addRemove float64, st *churnState) ([]Change, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if rng.Float64() >= addRemove {
		if j, ok := u.pickLive(rng, len(u.workloads), func(j int) bool {
			return !u.services[u.workloads[j].svc].removed
		}); ok {
			c, err := u.moveEndpointLocked(j)
			return []Change{c}, err
		}
		// No endpoint left to move: add or remove instead.
	}
	adding := st.addNext
	st.addNext = !st.addNext
	if !adding {
		if i, ok := u.pickLive(rng, len(u.services), func(i int) bool { return !u.services[i].removed }); ok {
			return u.removeServiceLocked(i)
		}
	}
	return u.addServiceLocked()
}

// pickLive returns a random index in [0, n) for which live holds: a few
// random tries, then a scan from a random start. Bounded by n.
func (u *Upstream) pickLive(rng *rand.Rand, n int, live func(int) bool) (int, bool) {
	if n == 0 {
		return 0, false
	}
	for range 16 {
		if i := rng.IntN(n); live(i) {
			return i, true
		}
	}
	start := rng.IntN(n)
	for k := range n {
		if i := (start + k) % n; live(i) {
			return i, true
		}
	}
	return 0, false
}

// Run is the standalone runner behind `loadtest upstream`: it builds and
// starts an upstream for cfg, prints its address to out, then a line of
// stats every second, churns per churn (if churn.Rate > 0; the churn ends
// after its Count or Duration while serving goes on) and stops when ctx is
// done. It returns nil after a ctx-initiated stop.
func Run(ctx context.Context, cfg Config, churn ChurnConfig, out io.Writer) error {
	if churn.Rate > 0 {
		if err := churn.validate(); err != nil {
			return err
		}
	}
	u, err := New(cfg)
	if err != nil {
		return err
	}
	if err := u.Start(ctx); err != nil {
		return err
	}
	sc := u.sc
	fmt.Fprintf(out, "upstream: listening on %s (services=%d endpoints=%d namespaces=%d local=%.2f grpc=%d)\n",
		u.Addr(), sc.Services, sc.Endpoints, sc.Namespaces, sc.LocalFraction, len(sc.GRPCServices))

	var churnDone chan error
	if churn.Rate > 0 {
		churnDone = make(chan error, 1)
		go func() { churnDone <- u.Churn(ctx, churn, nil) }()
	}
	ticker := time.NewTicker(time.Second)
	defer ticker.Stop()
	start := time.Now()
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case err := <-churnDone:
			churnDone = nil
			if err != nil && ctx.Err() == nil {
				fmt.Fprintf(out, "upstream: churn failed: %v\n", err)
			} else {
				fmt.Fprintf(out, "upstream: churn finished\n")
			}
		case now := <-ticker.C:
			s := u.Stats()
			fmt.Fprintf(out, "upstream: t=%s streams=%d opened=%d requests=%d responses=%d sent_bytes=%d changes=%d\n",
				now.Sub(start).Round(time.Second), s.OpenStreams, s.StreamsOpened, s.Requests, s.Responses, s.BytesSent, s.Changes)
		}
	}
	if churnDone != nil {
		<-churnDone // Churn returns promptly once ctx is done
	}
	if err := u.Stop(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	fmt.Fprintf(out, "upstream: stopped\n")
	return nil
}
