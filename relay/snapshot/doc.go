// Package snapshot persists the relay's key snapshots in etcd so that a
// relay starts warm: Store implements relay.Snapshots, and Embedded runs an
// in-process etcd for a single machine and for tests. The etcd client and
// server are used here and nowhere else.
//
// What is stored, and why it is shaped so:
//
//   - Resources are content-addressed (res/<sha256>) and shared by every
//     key, so 100 keys that see the same 60,000 resources store them once.
//     A body over 1 MiB is stored in parts (etcd refuses requests over
//     1.5 MiB). Secrets are sealed with a key from a file, or not stored.
//   - A key's index (name → content hash, per type) is a base, cut into
//     content-defined chunks that identical views share, plus a log of
//     change records: one endpoint change appends one record of one name
//     and hash, instead of rewriting the index. The base is rewritten when
//     the log grows past CompactAfter records or half the base's bytes.
//   - Every record carries the Merkle root its type must have after it, and
//     the loader checks it: a lost or damaged record costs a warm type, not
//     a wrong one.
//   - Only the member that claimed a key writes it: its head and log writes
//     are transactions that compare the fence key's mod revision with the
//     one its claim produced (a revision fence, not a lease), so a deposed
//     owner's late writes fail.
package snapshot
