package shard

import (
	"strings"
	"testing"
)

func TestMetaRoundTrip(t *testing.T) {
	m := meta{V: metaVersion, XDS: "10.0.0.7:15010", Conns: 1234, Admin: "10.0.0.7:15014"}
	b, err := m.encode()
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeMeta(b)
	if err != nil || got != m {
		t.Fatalf("decodeMeta(encode(%+v)) = %+v, %v", m, got, err)
	}
	if _, err := (meta{V: metaVersion, XDS: strings.Repeat("a", 600) + ":1"}).encode(); err == nil {
		t.Error("encode of a 600-byte address succeeded, want an error")
	}
}

func TestDecodeMetaRefusesBadInput(t *testing.T) {
	for _, in := range []string{
		"",
		"{",
		`{"v":2,"xds":"a:1"}`,
		`{"v":1,"xds":""}`,
		`{"v":1,"xds":"a"}`,
		`{"v":1,"xds":":15010"}`,
		`{"v":1,"xds":"a:0"}`,
		`{"v":1,"xds":"a:99999"}`,
		`{"v":1,"xds":"a:1","conns":-1}`,
		`{"v":1,"xds":"a:1","conns":99999999999}`,
		`{"v":1,"xds":"a:1","admin":"a"}`,
		`{"v":1,"xds":"a:1","admin":"a:0"}`,
		strings.Repeat(" ", 513),
	} {
		if m, err := decodeMeta([]byte(in)); err == nil {
			t.Errorf("decodeMeta(%q) = %+v, nil; want an error", in, m)
		}
	}
}

// FuzzDecodeMeta: gossiped metadata is untrusted input. Whatever it is,
// decodeMeta returns an error or a meta that re-encodes to something it
// decodes to the same value.
func FuzzDecodeMeta(f *testing.F) {
	for _, s := range []string{`{"v":1,"xds":"10.0.0.7:15010","conns":3}`, `{"v":1,"xds":"a:1","admin":"b:2"}`, `{"v":1,"xds":"[::1]:1"}`, `{}`, `null`, `[]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeMeta(b)
		if err != nil {
			return
		}
		wire, err := m.encode()
		if err != nil {
			t.Fatalf("decoded %+v does not encode: %v", m, err)
		}
		again, err := decodeMeta(wire)
		if err != nil || again != m {
			t.Fatalf("round trip of %+v = %+v, %v", m, again, err)
		}
	})
}
