// Package tlsfiles serves TLS material from files that are replaced while
// the process runs. cert-manager, istiod and Kubernetes Secret volumes
// rotate certificates by writing new files or by swapping a symlinked
// directory; a long-lived relay must pick the new ones up without a restart
// and without dropping the connections it holds. Each handshake looks at
// the files (two stat calls) and reads them again only when they changed;
// a pair that does not load (a key written before its certificate, a
// truncated file) leaves the last good one in service, and is tried again
// at the next handshake.
package tlsfiles

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"sync"
	"time"
)

// stamp identifies a file's content as far as stat can tell: a rewrite
// changes the time or the size, a swapped symlink the file itself.
type stamp struct {
	info os.FileInfo
}

func (s stamp) same(fi os.FileInfo) bool {
	return s.info != nil && os.SameFile(s.info, fi) && s.info.ModTime().Equal(fi.ModTime()) && s.info.Size() == fi.Size()
}

// watched reads a set of files into a value of T again whenever one of
// them changed since the last good read.
type watched[T any] struct {
	files []string
	load  func() (T, error)

	mu     sync.Mutex
	stamps []stamp
	cur    T
	err    error // of the last attempt, nil once one succeeded after it
	loaded time.Time
}

func newWatched[T any](load func() (T, error), files ...string) (*watched[T], error) {
	w := &watched[T]{files: files, load: load, stamps: make([]stamp, len(files))}
	if _, err := w.get(); err != nil {
		return nil, err
	}
	return w, nil
}

// get returns the current value, reading the files first if they changed.
// It fails only if no read ever succeeded.
func (w *watched[T]) get() (T, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	infos := make([]os.FileInfo, len(w.files))
	changed := w.loaded.IsZero()
	for i, f := range w.files {
		fi, err := os.Stat(f)
		if err != nil {
			w.err = err
			return w.current()
		}
		infos[i] = fi
		changed = changed || !w.stamps[i].same(fi)
	}
	if !changed {
		return w.cur, nil
	}
	v, err := w.load()
	if err != nil {
		w.err = err
		return w.current()
	}
	for i, fi := range infos {
		w.stamps[i] = stamp{fi}
	}
	w.cur, w.err, w.loaded = v, nil, time.Now()
	return v, nil
}

func (w *watched[T]) current() (T, error) {
	if w.loaded.IsZero() {
		var zero T
		return zero, w.err
	}
	return w.cur, nil
}

// status returns when the files were last read, and the error of the
// latest attempt if it failed after that.
func (w *watched[T]) status() (time.Time, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.loaded, w.err
}

// KeyPair is a certificate and its key, from PEM files.
type KeyPair struct{ w *watched[*tls.Certificate] }

// LoadKeyPair reads certFile and keyFile; they must load now.
func LoadKeyPair(certFile, keyFile string) (*KeyPair, error) {
	w, err := newWatched(func() (*tls.Certificate, error) {
		c, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("tlsfiles: %s, %s: %w", certFile, keyFile, err)
		}
		return &c, nil
	}, certFile, keyFile)
	if err != nil {
		return nil, err
	}
	return &KeyPair{w}, nil
}

// Certificate returns the current certificate.
func (k *KeyPair) Certificate() *tls.Certificate {
	c, _ := k.w.get()
	return c
}

// Status returns when the files were last read, and why the latest attempt
// to read them again failed, if it did (the previous pair is in service).
func (k *KeyPair) Status() (time.Time, error) { return k.w.status() }

// CAPool is a set of CA certificates from a PEM file.
type CAPool struct{ w *watched[caSet] }

type caSet struct {
	pool  *x509.CertPool
	certs []*x509.Certificate
}

// LoadCAPool reads file; it must hold at least one certificate now.
func LoadCAPool(file string) (*CAPool, error) {
	w, err := newWatched(func() (caSet, error) {
		b, err := os.ReadFile(file)
		if err != nil {
			return caSet{}, fmt.Errorf("tlsfiles: %w", err)
		}
		var set caSet
		for len(b) > 0 {
			var blk *pem.Block
			if blk, b = pem.Decode(b); blk == nil {
				break
			}
			if blk.Type != "CERTIFICATE" {
				continue
			}
			c, err := x509.ParseCertificate(blk.Bytes)
			if err != nil {
				return caSet{}, fmt.Errorf("tlsfiles: %s: %w", file, err)
			}
			set.certs = append(set.certs, c)
		}
		if len(set.certs) == 0 {
			return caSet{}, fmt.Errorf("tlsfiles: %s: no PEM certificate in it", file)
		}
		set.pool = x509.NewCertPool()
		for _, c := range set.certs {
			set.pool.AddCert(c)
		}
		return set, nil
	}, file)
	if err != nil {
		return nil, err
	}
	return &CAPool{w}, nil
}

// Pool returns the current pool.
func (p *CAPool) Pool() *x509.CertPool {
	c, _ := p.w.get()
	return c.pool
}

// Certificates returns the current CA certificates (for verifiers that want
// them one by one, such as a SPIFFE trust bundle). The caller must not
// modify them.
func (p *CAPool) Certificates() []*x509.Certificate {
	c, _ := p.w.get()
	return c.certs
}

// Status is KeyPair.Status for the CA file.
func (p *CAPool) Status() (time.Time, error) { return p.w.status() }

// modernSuites are the TLS 1.2 cipher suites served: forward secret and
// AEAD only (no CBC, no RSA key exchange). TLS 1.3's are all of that kind.
var modernSuites = []uint16{
	tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
	tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256, tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
}

// ServerConfig returns a server TLS config (TLS 1.2 or later, modern
// cipher suites) that serves
// pair's current certificate and, if clientCAs is set, requires client
// certificates chained to its current CAs (clientAuth says how: e.g.
// tls.RequireAndVerifyClientCert, or tls.VerifyClientCertIfGiven), with
// ALPN protocols protos (none: h2, for gRPC). Connections already open keep
// the certificate they were made with.
func ServerConfig(pair *KeyPair, clientCAs *CAPool, clientAuth tls.ClientAuthType, protos ...string) *tls.Config {
	if len(protos) == 0 {
		protos = []string{"h2"}
	}
	base := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: protos, CipherSuites: modernSuites}
	base.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		c := base.Clone()
		c.GetConfigForClient = nil
		c.Certificates = []tls.Certificate{*pair.Certificate()}
		if clientCAs != nil {
			c.ClientCAs, c.ClientAuth = clientCAs.Pool(), clientAuth
		}
		return c, nil
	}
	return base
}
