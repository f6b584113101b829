package wire

import (
	"errors"
	"fmt"
	"unicode/utf8"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
)

// DeltaIn and SotWIn are the responses a key's feed reads from its source
// (istiod, or the key's owner), read off the wire the way the relay needs
// them: a first answer is the key's whole config (16 MB of clusters at
// 30,000 services), most of which the relay already holds for other keys,
// so a resource's bytes stay in gRPC's receive buffer until the store has
// hashed them, and only content it lacks is copied and parsed
// (xds.Store.Decode). The buffer is held until Release. The scalar fields
// are decoded; fields the relay does not use are skipped, not checked.

// DeltaIn is a DeltaDiscoveryResponse.
type DeltaIn struct {
	SystemVersionInfo string
	TypeURL           string
	Nonce             string
	Resources         []ResourceIn
	RemovedResources  []string
	buf               mem.Buffer
}

// ResourceIn is a Delta response's Resource.
type ResourceIn struct {
	Name, Version string
	// Body is the resource, nil when the Resource carries none (a TTL
	// heartbeat). Its Value is valid until the response is released.
	Body *AnyIn
}

// SotWIn is a DiscoveryResponse.
type SotWIn struct {
	VersionInfo string
	TypeURL     string
	Nonce       string
	Resources   []*AnyIn
	buf         mem.Buffer
}

// AnyIn is a google.protobuf.Any whose value may alias a response's buffer.
type AnyIn struct {
	TypeUrl string //nolint:revive // as anypb.Any names it
	Value   []byte
}

// GetTypeUrl and GetValue read a as anypb.Any's do: a nil AnyIn is empty.
func (a *AnyIn) GetTypeUrl() string {
	if a == nil {
		return ""
	}
	return a.TypeUrl
}

func (a *AnyIn) GetValue() []byte {
	if a == nil {
		return nil
	}
	return a.Value
}

// Getters, as the generated messages have them, for the feed's code that
// reads either.
func (r *DeltaIn) GetTypeUrl() string            { return r.TypeURL }
func (r *DeltaIn) GetNonce() string              { return r.Nonce }
func (r *DeltaIn) GetSystemVersionInfo() string  { return r.SystemVersionInfo }
func (r *DeltaIn) GetRemovedResources() []string { return r.RemovedResources }
func (r *SotWIn) GetTypeUrl() string             { return r.TypeURL }
func (r *SotWIn) GetNonce() string               { return r.Nonce }
func (r *SotWIn) GetVersionInfo() string         { return r.VersionInfo }

// Release gives the response's buffer back; its resources' values are not
// to be read after it. Calling it again does nothing.
func (r *DeltaIn) Release() { release(&r.buf) }

// Release: see DeltaIn.Release.
func (r *SotWIn) Release() { release(&r.buf) }

func release(b *mem.Buffer) {
	if *b != nil {
		(*b).Free()
		*b = nil
	}
}

// Field numbers of the messages read here (envoy.service.discovery.v3,
// google.protobuf.Any).
const (
	fDeltaInVersion, fDeltaInResources, fDeltaInTypeURL, fDeltaInNonce, fDeltaInRemoved = 1, 2, 4, 5, 6
	fSotWInVersion, fSotWInResources, fSotWInTypeURL, fSotWInNonce                      = 1, 2, 4, 5
	fResInVersion, fResInBody, fResInName                                               = 1, 2, 3
)

var errBadUTF8 = errors.New("string field is not valid UTF-8")

// field walks a message's fields, calling fn with each field's number,
// wire type and value bytes (for BytesType, the bytes without their
// length); it stops at the first malformed field or error of fn.
func fields(b []byte, fn func(num protowire.Number, typ protowire.Type, v []byte) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return protowire.ParseError(m)
		}
		v := b[n : n+m]
		if typ == protowire.BytesType {
			v, _ = protowire.ConsumeBytes(v)
		}
		if err := fn(num, typ, v); err != nil {
			return err
		}
		b = b[n+m:]
	}
	return nil
}

// str decodes a proto3 string field's value.
func str(v []byte) (string, error) {
	if !utf8.Valid(v) {
		return "", errBadUTF8
	}
	return string(v), nil
}

// readMessage holds data in one buffer (gRPC's own, or a copy from its
// pool when the message came in several) and walks its length-delimited
// fields with fn (every field the relay reads is one). The buffer goes to
// *keep, for the caller's Release, or back to the pool on an error.
func readMessage(data mem.BufferSlice, keep *mem.Buffer, fn func(num protowire.Number, v []byte) error) error {
	buf := gather(data)
	err := fields(buf.ReadOnlyData(), func(num protowire.Number, typ protowire.Type, v []byte) error {
		if typ != protowire.BytesType {
			return nil
		}
		return fn(num, v)
	})
	if err != nil {
		buf.Free()
		return fmt.Errorf("relay: bad response: %w", err)
	}
	*keep = buf
	return nil
}

func unmarshalDeltaIn(data mem.BufferSlice, into *DeltaIn) error {
	return readMessage(data, &into.buf, func(num protowire.Number, v []byte) (err error) {
		switch num {
		case fDeltaInVersion:
			into.SystemVersionInfo, err = str(v)
		case fDeltaInTypeURL:
			into.TypeURL, err = str(v)
		case fDeltaInNonce:
			into.Nonce, err = str(v)
		case fDeltaInRemoved:
			var s string
			if s, err = str(v); err == nil {
				into.RemovedResources = append(into.RemovedResources, s)
			}
		case fDeltaInResources:
			var r ResourceIn
			if r, err = unmarshalResourceIn(v); err == nil {
				into.Resources = append(into.Resources, r)
			}
		}
		return err
	})
}

func unmarshalResourceIn(b []byte) (r ResourceIn, err error) {
	err = fields(b, func(num protowire.Number, typ protowire.Type, v []byte) (err error) {
		if typ != protowire.BytesType {
			return nil
		}
		switch num {
		case fResInName:
			r.Name, err = str(v)
		case fResInVersion:
			r.Version, err = str(v)
		case fResInBody:
			r.Body, err = unmarshalAnyIn(v, r.Body)
		}
		return err
	})
	return r, err
}

// unmarshalAnyIn reads an Any; a second occurrence of the field merges
// into the first (have), as proto does.
func unmarshalAnyIn(b []byte, have *AnyIn) (*AnyIn, error) {
	a := have
	if a == nil {
		a = new(AnyIn)
	}
	err := fields(b, func(num protowire.Number, typ protowire.Type, v []byte) (err error) {
		if typ != protowire.BytesType {
			return nil
		}
		switch num {
		case fAnyTypeURL:
			a.TypeUrl, err = str(v)
		case fAnyValue:
			a.Value = v
		}
		return err
	})
	return a, err
}

func unmarshalSotWIn(data mem.BufferSlice, into *SotWIn) error {
	return readMessage(data, &into.buf, func(num protowire.Number, v []byte) (err error) {
		switch num {
		case fSotWInVersion:
			into.VersionInfo, err = str(v)
		case fSotWInTypeURL:
			into.TypeURL, err = str(v)
		case fSotWInNonce:
			into.Nonce, err = str(v)
		case fSotWInResources:
			var a *AnyIn
			if a, err = unmarshalAnyIn(v, nil); err == nil {
				into.Resources = append(into.Resources, a)
			}
		}
		return err
	})
}
