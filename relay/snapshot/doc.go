// Package snapshot persists the relay's key snapshots in etcd so that a
// relay starts warm: Store implements relay.Snapshots (of the views in
// relay/xds, so this package does not import the relay), and Embedded runs an
// in-process etcd for a single machine and for tests. The etcd client and
// server are used here and nowhere else.
//
// What is stored, and why it is shaped so:
//
//   - Resources are content-addressed (res/<sha256>) and shared by every
//     key, so 100 keys that see the same 60,000 resources store them once.
//     A body over 1 MiB is stored in parts (etcd refuses requests over
//     1.5 MiB). Secrets, and every resource that sets a field Envoy marks
//     sensitive anywhere in it (an inline TLS key in a Cluster's transport
//     socket, say; relay/sensitive finds them), are sealed with a key from
//     a file (AES-256-GCM, the content hash as additional data, so hashes
//     stay those of the clear body), or not stored.
//   - A key's index (name → content hash, per type) is a base, cut into
//     content-defined chunks that identical views share, plus batch
//     records: every flush (FlushInterval) writes one record of what
//     changed on every key the relay owns, keys that changed alike sharing
//     one entry. One endpoint change seen by 100 keys is one record of a
//     couple of kilobytes, not 100 index rewrites. A key's base is
//     rewritten after CompactAfter records, or when they outgrow half of it.
//   - Every record carries the Merkle root its type must have after it.
//     The relay checks each view against it as it restores the view, so a
//     lost or damaged record costs a warm type, not a wrong one.
//   - Only the member that claimed a key writes it: its head and batch
//     writes are transactions that compare the fence key's mod revision with
//     the one its claim produced (a revision fence, not a lease), so a
//     deposed owner's late writes fail. A deposed member claims the key
//     back when its ring changes, or after ReclaimAfter if its ring still
//     says it is the owner (a partitioned peer's claim must not hold for
//     good).
package snapshot
