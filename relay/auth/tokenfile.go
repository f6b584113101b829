package auth

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
)

// TokenFile is a bearer token in a file, read at each use: kubelet
// rewrites a projected service-account token in place (an atomic swap)
// well before it expires, and a long-lived client outlives one. As a gRPC
// per-RPC credential it sends "authorization: Bearer <token>", over TLS
// only. Errors name Flag (the command-line flag that gave the file) and
// the path, never the file's content.
type TokenFile struct {
	Path string
	Flag string
}

// Token reads the token: the file's content, trimmed, at most
// MaxTokenBytes (Kubernetes tokens are 1–2 KiB; relays refuse longer
// authorization headers), and not empty.
func (f TokenFile) Token() (string, error) {
	fh, err := os.Open(f.Path)
	if err != nil {
		return "", fmt.Errorf("%s: %w", f.Flag, err)
	}
	defer fh.Close()
	b, err := io.ReadAll(io.LimitReader(fh, MaxTokenBytes+1))
	if err != nil {
		return "", fmt.Errorf("%s: %w", f.Flag, err)
	}
	tok := strings.TrimSpace(string(b))
	switch {
	case len(b) > MaxTokenBytes:
		return "", fmt.Errorf("%s %s holds more than %d bytes: not a token", f.Flag, f.Path, MaxTokenBytes)
	case tok == "":
		return "", fmt.Errorf("%s %s is empty", f.Flag, f.Path)
	}
	return tok, nil
}

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (f TokenFile) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	tok, err := f.Token()
	if err != nil {
		return nil, err
	}
	return map[string]string{"authorization": "Bearer " + tok}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials: a
// token never crosses the network in clear text.
func (TokenFile) RequireTransportSecurity() bool { return true }
