package relay

import "time"

// firstAnswers follows the first answers of a feed's session, by the clock
// alone: when the relay's sync slot goes back, and when the source's
// silence confirms the views. The session tells it each answer (answered)
// and each firing of its timer (fired), and acts on what they return.
//
// The slot goes back at the first of: every type answered; a pause of
// confirmAfter in the answers once some came (the first answers come as a
// burst); confirmAfter of silence from a source that may rightly say
// nothing (feed.mayBeSilent); syncSlotHold. Silence confirms the views
// confirmAfter after the session opened, for a source that may stay silent
// when nothing changed (a SotW upstream, an owner relay); a Delta upstream
// is made to answer every type.
type firstAnswers struct {
	opened    time.Time
	quietFrom time.Time // the last answer, or the opening: a pause runs from it
	// quietSpent: the pause ended with nothing answered from a source
	// that owes an answer; the next answer starts another.
	quietSpent      bool
	got             bool // an answer came
	released        bool // the slot went back
	confirmed       bool // every type answered, or silence confirmed
	silenceConfirms bool
	timer           *time.Timer
}

func newFirstAnswers(now time.Time, silenceConfirms bool) *firstAnswers {
	f := &firstAnswers{opened: now, quietFrom: now, silenceConfirms: silenceConfirms}
	at, _ := f.next()
	f.timer = time.NewTimer(at.Sub(now))
	return f
}

// C is ready when a deadline may have passed: call fired.
func (f *firstAnswers) C() <-chan time.Time { return f.timer.C }

// stop stops the timer.
func (f *firstAnswers) stop() { f.timer.Stop() }

// answered enters an answer that came at now; all tells whether every type
// the session asked is answered now. It returns whether the slot goes back
// now, and whether the views are confirmed now.
func (f *firstAnswers) answered(now time.Time, all bool) (release, confirm bool) {
	f.got = true
	f.quietFrom, f.quietSpent = now, false
	if all && !f.confirmed {
		f.confirmed, confirm = true, true
		release = f.release()
	}
	f.arm(now)
	return release, confirm
}

// fired enters the timer's firing at now; mayBeSilent tells whether the
// source may rightly not answer at all (feed.mayBeSilent). It returns
// whether the slot goes back now, and whether its silence confirms the
// views now.
func (f *firstAnswers) fired(now time.Time, mayBeSilent bool) (release, silenceConfirmed bool) {
	if !f.released {
		switch {
		case !now.Before(f.opened.Add(syncSlotHold)):
			release = f.release() // a source slow to answer does not hold up the others' keys
		case !f.quietSpent && !now.Before(f.quietFrom.Add(confirmAfter)):
			if f.got || mayBeSilent {
				release = f.release() // the burst is over, or none is owed
			} else {
				f.quietSpent = true
			}
		}
	}
	if f.silenceConfirms && !f.confirmed && !now.Before(f.opened.Add(confirmAfter)) {
		f.confirmed, silenceConfirmed = true, true
	}
	f.arm(now)
	return release, silenceConfirmed
}

func (f *firstAnswers) release() bool {
	if f.released {
		return false
	}
	f.released = true
	return true
}

// next returns the earliest deadline still to come, if any.
func (f *firstAnswers) next() (at time.Time, ok bool) {
	earliest := func(t time.Time) {
		if !ok || t.Before(at) {
			at, ok = t, true
		}
	}
	if !f.released {
		earliest(f.opened.Add(syncSlotHold))
		if !f.quietSpent {
			earliest(f.quietFrom.Add(confirmAfter))
		}
	}
	if f.silenceConfirms && !f.confirmed {
		earliest(f.opened.Add(confirmAfter))
	}
	return at, ok
}

// arm sets the timer to the next deadline, or stops it if none is left.
func (f *firstAnswers) arm(now time.Time) {
	f.timer.Stop()
	if at, ok := f.next(); ok {
		f.timer.Reset(at.Sub(now))
	}
}
