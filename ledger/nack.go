package ledger

import (
	"crypto/sha256"
	"encoding/hex"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"
)

// Fingerprint names a kind of NACK: the type and the error text with what
// differs from one proxy or resource to the next taken out, so that the
// same failure on 400 proxies is one row with a count.
type Fingerprint string

var (
	// Quoted strings (names of resources, addresses), IP addresses with
	// optional ports, hex runs (hashes, versions) and numbers vary between
	// Envoys rejecting the same thing.
	quotedRE = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'`)
	ipRE     = regexp.MustCompile(`\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\[[0-9a-fA-F:]+\](?::\d+)?`)
	hexRE    = regexp.MustCompile(`\b[0-9a-fA-F]{8,}\b`)
	numRE    = regexp.MustCompile(`\d+`)
	spaceRE  = regexp.MustCompile(`\s+`)
)

// NormalizeNACK returns detail with what varies between Envoys replaced by
// placeholders.
func NormalizeNACK(detail string) string {
	s := quotedRE.ReplaceAllString(detail, `"…"`)
	s = ipRE.ReplaceAllString(s, "<ip>")
	s = hexRE.ReplaceAllString(s, "<hex>")
	s = numRE.ReplaceAllString(s, "<n>")
	return strings.TrimSpace(spaceRE.ReplaceAllString(s, " "))
}

// FingerprintOf returns the Fingerprint of a NACK of typeURL with detail.
func FingerprintOf(typeURL, detail string) Fingerprint {
	return fingerprint(typeURL, NormalizeNACK(detail))
}

func fingerprint(typeURL, normalized string) Fingerprint {
	sum := sha256.Sum256([]byte(typeURL + "\x00" + normalized))
	return Fingerprint(hex.EncodeToString(sum[:8]))
}

// NACKRow is one kind of NACK and how many Envoys hold it now.
type NACKRow struct {
	Fingerprint Fingerprint
	Type        string
	Normalized  string
	Example     string // the first detail seen
	Envoys      int
	First, Last time.Time
}

type nackRow struct {
	fp  Fingerprint
	row NACKRow
}

// nackTable counts the NACKs Envoys hold, by fingerprint.
type nackTable struct {
	mu   sync.Mutex
	rows map[Fingerprint]*nackRow
}

func (t *nackTable) acquire(typeURL, detail string, at time.Time) *nackRow {
	norm := NormalizeNACK(detail)
	fp := fingerprint(typeURL, norm)
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.rows[fp]
	if r == nil {
		r = &nackRow{fp: fp, row: NACKRow{Fingerprint: fp, Type: typeURL, Normalized: norm, Example: detail, First: at}}
		t.rows[fp] = r
	}
	r.row.Envoys++
	r.row.Last = at
	return r
}

func (t *nackTable) release(r *nackRow) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r.row.Envoys--
	if r.row.Envoys <= 0 {
		delete(t.rows, r.fp)
	}
}

func (t *nackTable) snapshot() []NACKRow {
	t.mu.Lock()
	out := make([]NACKRow, 0, len(t.rows))
	for _, r := range t.rows {
		out = append(out, r.row)
	}
	t.mu.Unlock()
	slices.SortFunc(out, func(a, b NACKRow) int {
		if a.Envoys != b.Envoys {
			return b.Envoys - a.Envoys
		}
		return strings.Compare(string(a.Fingerprint), string(b.Fingerprint))
	})
	return out
}
