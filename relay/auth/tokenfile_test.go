package auth

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestTokenFileReadAtEachCall: a token file is read at each call,
// so a token kubelet rotated is the one sent; a file that is missing,
// empty or far too large for a token fails the call, naming the file,
// never its content. (relayctl's --token-file, the upstream token.)
func TestTokenFileReadAtEachCall(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "token")
	write := func(content string) {
		// As kubelet's atomic writer: a new file swapped in.
		tmp := filepath.Join(dir, "token.tmp")
		if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	f := TokenFile{Path: path, Flag: "--token-file"}
	for _, tc := range []struct {
		content, want, err string
	}{
		{"first-token\n", "Bearer first-token", ""},
		{"  rotated-token  ", "Bearer rotated-token", ""},
		{"\n", "", "is empty"},
		{strings.Repeat("x", MaxTokenBytes+1), "", "not a token"},
	} {
		write(tc.content)
		md, err := f.GetRequestMetadata(context.Background())
		if got := md["authorization"]; got != tc.want || (err == nil) != (tc.err == "") || err != nil && !strings.Contains(err.Error(), tc.err) {
			t.Errorf("with %q in the file: authorization %q, %v; want %q, %q", tc.content, got, err, tc.want, tc.err)
		}
		if err != nil && strings.Contains(err.Error(), "xxxx") {
			t.Errorf("the error %q repeats the file's content", err)
		}
	}
	os.Remove(path)
	if _, err := f.GetRequestMetadata(context.Background()); err == nil || !strings.Contains(err.Error(), "--token-file") {
		t.Errorf("with no file: %v, want an error naming --token-file", err)
	}
	if !f.RequireTransportSecurity() {
		t.Error("a token file's token may cross the network in clear text")
	}
}
