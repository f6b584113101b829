package relay

import (
	"testing"
	"testing/synctest"
	"time"
)

// TestFirstAnswers plays a session's first answers on a fake clock
// (testing/synctest) and checks when the sync slot goes back and when the
// views are confirmed, and how.
func TestFirstAnswers(t *testing.T) {
	const never = -1
	for _, tc := range []struct {
		name            string
		silenceConfirms bool            // a SotW upstream or an owner relay
		mayBeSilent     bool            // told the version of every type it was asked
		answers         []time.Duration // when answers come, after the opening
		allAt           int             // the answer after which every type is answered
		wantRelease     time.Duration
		wantConfirm     time.Duration // never: not confirmed
		wantBySilence   bool
	}{
		{
			name:    "a burst answers every type: the slot goes back and the views are confirmed at once",
			answers: []time.Duration{100 * time.Millisecond, 150 * time.Millisecond, 180 * time.Millisecond}, allAt: 2,
			wantRelease: 180 * time.Millisecond, wantConfirm: 180 * time.Millisecond,
		},
		{
			name:    "a burst that leaves a type unanswered: the slot goes back after a pause, nothing is confirmed",
			answers: []time.Duration{100 * time.Millisecond, 300 * time.Millisecond}, allAt: never,
			wantRelease: 300*time.Millisecond + confirmAfter, wantConfirm: never,
		},
		{
			name:    "a source that owes its answers and says nothing holds the slot until syncSlotHold",
			answers: nil, allAt: never,
			wantRelease: syncSlotHold, wantConfirm: never,
		},
		{
			name:    "an answer late past a pause: the slot waits for it, then for the pause after it",
			answers: []time.Duration{confirmAfter + time.Second}, allAt: never,
			wantRelease: 2*confirmAfter + time.Second, wantConfirm: never,
		},
		{
			name:            "a SotW upstream told every version may stay silent: its silence gives the slot back and confirms",
			silenceConfirms: true, mayBeSilent: true, answers: nil, allAt: never,
			wantRelease: confirmAfter, wantConfirm: confirmAfter, wantBySilence: true,
		},
		{
			name:            "an owner that trickles answers is confirmed by silence, and keeps the slot until syncSlotHold",
			silenceConfirms: true, allAt: never,
			answers:     []time.Duration{time.Second, 2 * time.Second, 3 * time.Second, 4 * time.Second, 5 * time.Second, 6 * time.Second, 7 * time.Second, 8 * time.Second, 9 * time.Second, 10 * time.Second, 11 * time.Second, 12 * time.Second, 13 * time.Second, 14 * time.Second, 15 * time.Second, 16 * time.Second, 17 * time.Second, 18 * time.Second, 19 * time.Second, 20 * time.Second, 21 * time.Second, 22 * time.Second, 23 * time.Second, 24 * time.Second, 25 * time.Second, 26 * time.Second, 27 * time.Second, 28 * time.Second, 29 * time.Second, 30 * time.Second},
			wantRelease: syncSlotHold, wantConfirm: confirmAfter, wantBySilence: true,
		},
		{
			name:            "a SotW upstream that answers every type before the silence counts",
			silenceConfirms: true, answers: []time.Duration{time.Second}, allAt: 0,
			wantRelease: time.Second, wantConfirm: time.Second,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				start := time.Now()
				f := newFirstAnswers(start, tc.silenceConfirms)
				defer f.stop()
				released, confirmed := time.Duration(never), time.Duration(never)
				bySilence := false
				end := time.After(syncSlotHold + time.Minute)
				for i := 0; ; {
					var answer <-chan time.Time
					if i < len(tc.answers) {
						answer = time.After(tc.answers[i] - time.Since(start))
					}
					var back, confirm bool
					select {
					case <-answer:
						back, confirm = f.answered(time.Now(), i == tc.allAt)
						i++
					case <-f.C():
						back, confirm = f.fired(time.Now(), tc.mayBeSilent)
						bySilence = bySilence || confirm
					case <-end:
						if released != tc.wantRelease || confirmed != tc.wantConfirm || bySilence != tc.wantBySilence {
							t.Errorf("slot back at %v, views confirmed at %v (by silence %v); want %v, %v (%v)",
								released, confirmed, bySilence, tc.wantRelease, tc.wantConfirm, tc.wantBySilence)
						}
						return
					}
					if back {
						if released != never {
							t.Fatalf("the slot went back twice: at %v and %v", released, time.Since(start))
						}
						released = time.Since(start)
					}
					if confirm {
						if confirmed != never {
							t.Fatalf("the views were confirmed twice: at %v and %v", confirmed, time.Since(start))
						}
						confirmed = time.Since(start)
					}
				}
			})
		})
	}
}
