package snapshot

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/meshrelay/meshrelay/ledger"
)

// sealer encrypts Secret resources with AES-256-GCM. The nonce is random
// and stored in front of the ciphertext; the content hash is the
// additional data, so a sealed body cannot be moved under another hash.
type sealer struct{ aead cipher.AEAD }

func newSealer(key []byte) (*sealer, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("snapshot: seal key: %w", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("snapshot: seal key: %w", err)
	}
	return &sealer{aead: aead}, nil
}

func (s *sealer) seal(plain []byte, h ledger.Hash) ([]byte, error) {
	nonce := make([]byte, s.aead.NonceSize(), s.aead.NonceSize()+len(plain)+s.aead.Overhead())
	if _, err := rand.Read(nonce); err != nil {
		return nil, fmt.Errorf("snapshot: seal: %w", err)
	}
	return s.aead.Seal(nonce, nonce, plain, h[:]), nil
}

var errOpen = errors.New("snapshot: sealed body does not open with this key")

func (s *sealer) open(sealed []byte, h ledger.Hash) ([]byte, error) {
	n := s.aead.NonceSize()
	if len(sealed) < n+s.aead.Overhead() {
		return nil, errOpen
	}
	plain, err := s.aead.Open(nil, sealed[:n], sealed[n:], h[:])
	if err != nil {
		return nil, errOpen
	}
	return plain, nil
}

// LoadSealKey reads a seal key from a file: 32 bytes, base64-encoded (as
// `head -c32 /dev/urandom | base64` writes it). The key never appears in
// errors.
func LoadSealKey(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("snapshot: seal key file: %w", err)
	}
	key, err := base64.StdEncoding.DecodeString(strings.TrimSpace(string(b)))
	if err != nil {
		return nil, fmt.Errorf("snapshot: seal key file %s: not base64", path)
	}
	if len(key) != 32 {
		return nil, fmt.Errorf("snapshot: seal key file %s: %d bytes, want 32", path, len(key))
	}
	return key, nil
}
