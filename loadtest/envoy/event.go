package envoy

import (
	"fmt"
	"time"
)

// EventKind says what an Event records.
type EventKind int

const (
	// Received: a response arrived (before it is checked or applied).
	Received EventKind = iota
	// ACKed: an ACK was sent for a response.
	ACKed
	// NACKed: a NACK was sent for a response.
	NACKed
	// Removed: resources stopped being held (removed by the server, or
	// dropped because they are no longer subscribed).
	Removed
	// Declared: the first request of a new stream told the server what the
	// Envoy holds of a type (Delta initial_resource_versions, SotW
	// version_info): Names and Generations are what it holds. A response
	// applied just before a stream broke, whose ACK was never sent, is
	// known to the server from then on.
	Declared
	// Opened: a new stream was opened (nonces start afresh on it). Only At
	// is set. It comes before every other event of the stream.
	Opened
)

// String returns the kind's name.
func (k EventKind) String() string {
	switch k {
	case Received:
		return "received"
	case ACKed:
		return "acked"
	case NACKed:
		return "nacked"
	case Removed:
		return "removed"
	case Declared:
		return "declared"
	case Opened:
		return "opened"
	default:
		return fmt.Sprintf("EventKind(%d)", int(k))
	}
}

// Event records one step of the stream, for benchmarks that measure when a
// version was received and ACKed.
type Event struct {
	Kind    EventKind
	TypeURL string
	// Names of the resources in the response (Received, NACKed), of those
	// it applied (ACKed: a resource that came, within UnsubscribeGrace,
	// for a name no longer subscribed is ignored, as Envoy does, and left
	// out), or removed (Removed). Owned by the receiver of the event.
	Names []string
	// Versions, in Delta, holds each named resource's version (parallel to
	// Names); nil in SotW, where Version applies to all.
	Versions []string
	// Generations holds each named resource's generation, as
	// Config.Generation reads it (0 where unknown), parallel to Names.
	Generations []uint64
	// Version is the response's version_info (SotW) or system_version_info
	// (Delta).
	Version string
	// Nonce is the response's nonce.
	Nonce string
	// At is when the response was read (Received), the ACK or NACK was
	// sent, or the resources were removed.
	At time.Time
	// Bytes is the proto.Size of the response (Received only).
	Bytes int
	// Err is the reason of a NACK.
	Err error
	// ControlPlane is the response's control_plane.identifier (Received
	// only): which server sent it.
	ControlPlane string
}

// Rule names a protocol rule a Violation broke.
type Rule string

// The rules the simulated Envoy checks.
const (
	// RuleNonce: a response without a nonce, or with a nonce already used on
	// the stream.
	RuleNonce Rule = "nonce"
	// RuleTypeURL: a response without type_url, or with resources of another
	// type.
	RuleTypeURL Rule = "type-url"
	// RuleDuplicate: a name twice in one response, or in both resources and
	// removed_resources.
	RuleDuplicate Rule = "duplicate"
	// RuleUnsubscribed: a resource (or a response type) that was not
	// subscribed.
	RuleUnsubscribed Rule = "unsubscribed"
	// RuleGeneration: a resource older (lower generation) than one seen.
	RuleGeneration Rule = "generation"
	// RuleOrdering: make-before-break broken: a route or listener naming a
	// cluster not held or still warming (an EDS cluster whose
	// ClusterLoadAssignment has not arrived), or a cluster removed while
	// still referenced.
	RuleOrdering Rule = "ordering"
	// RuleMalformed: a resource that does not decode or has no name.
	RuleMalformed Rule = "malformed"
)

// Violation is a broken protocol rule, recorded by the simulated Envoy.
type Violation struct {
	Rule    Rule
	TypeURL string
	// Nonce of the offending response.
	Nonce string
	// Detail says what was wrong, naming resources.
	Detail string
	// At is when it was seen.
	At time.Time
}

// Error implements error.
func (v *Violation) Error() string {
	return fmt.Sprintf("envoy: %s violation on %s (nonce %q): %s", v.Rule, v.TypeURL, v.Nonce, v.Detail)
}
