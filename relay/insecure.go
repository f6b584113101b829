package relay

// Settings that leave a relay open to whoever reaches it: refused where
// the xDS port authenticates (Config.validate, shard.NewNode), unless
// Tier.InsecureForDevelopment says otherwise; then, like a plaintext xDS
// port on an address other hosts reach, said every minute in the log and
// on /healthz, so that nobody runs it by accident.

import (
	"context"
	"net"
	"time"
)

// insecureEvery is how often the relay says again, in its log, what
// leaves it open.
const insecureEvery = time.Minute

// WarnInsecure records a setting that leaves the relay open and that it
// cannot see itself (shard.Node: gossip without a key): the relay says it
// every minute in its log and on /healthz. Call it before Start.
func (r *Relay) WarnInsecure(what string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.insecure = append(r.insecure, what)
}

// noteInsecureLocked adds, at Start, what of the relay's own settings
// leaves it open: a plaintext xDS port (lis, beside a TLS one or not) on an
// address other hosts reach, an authenticating relay's tier without mTLS;
// and says at once all that does. A plaintext port on loopback is said
// once, as information. r.mu is held.
func (r *Relay) noteInsecureLocked(lis net.Listener, besideTLS bool) {
	if lis != nil {
		msg := "PLAINTEXT xDS port open: it authenticates no one and serves every namespace's config to " +
			"whoever reaches it (istiod's 15010); sidecars of a default Istio mesh want the TLS port"
		if besideTLS {
			msg = "PLAINTEXT xDS port open beside the TLS one: it authenticates no one and serves every " +
				"namespace's config to whoever reaches it"
		}
		if isLoopback(lis.Addr()) {
			r.log.Info(msg+" (on loopback only: this host's processes)", "xds_plaintext", lis.Addr().String())
		} else {
			r.insecure = append(r.insecure, msg+": "+lis.Addr().String())
		}
	}
	if r.cfg.Tier.Owners != nil && r.cfg.XDS.Authenticator != nil && r.cfg.Tier.TLS == nil {
		// Only with Tier.InsecureForDevelopment: validate refuses it else.
		r.insecure = append(r.insecure, "relay-to-relay traffic without mTLS while the xDS port authenticates "+
			"(--insecure-tier-for-development): a client that claims to be a relay is served every key's config, secrets included")
	}
	for _, what := range r.insecure {
		r.log.Warn(what)
	}
}

// insecurities returns what leaves the relay open.
func (r *Relay) insecurities() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.insecure...)
}

// warnInsecure says again what leaves the relay open (Start said it
// first) every insecureEvery, until ctx ends; it returns at once if
// nothing does.
func (r *Relay) warnInsecure(ctx context.Context) {
	if len(r.insecurities()) == 0 {
		return
	}
	every(ctx, insecureEvery, func() {
		for _, what := range r.insecurities() {
			r.log.Warn(what)
		}
	})
}
