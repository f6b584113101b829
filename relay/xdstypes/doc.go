// Package xdstypes links every Envoy v3 proto package (go-control-plane)
// and every Istio proto package (istio.io/api: Istio's Envoy extensions,
// mesh config, networking, security, telemetry) into a binary that imports
// it, for their descriptors and types alone:
//
//   - config dumps (the admin API, istio.io/debug/config_dump) decode and
//     redact every extension an Envoy config may embed in an Any, instead
//     of replacing the ones the relay does not know by a note;
//   - server reflection on the admin listener serves their descriptors, so
//     grpcurl renders those Anys.
//
// It costs compile time (about 400 packages) and binary size, so only the
// meshrelay binary imports it; the relay package itself needs only the
// types it serves. The list is generated: see gen.sh.
package xdstypes
