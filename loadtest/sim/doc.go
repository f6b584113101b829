// Package sim owns meshrelay's deterministic simulation: a whole tier (the
// synthetic upstream, relays as shard.Nodes, simulated Envoys of both
// protocols) in one process, inside one testing/synctest bubble, over an
// in-memory network whose deliveries, latencies and faults come from a
// seed, with an in-memory snapshot store behind relay.Snapshots. Each seed
// draws the Envoys' and the upstream's protocols and a schedule of faults
// (relay crashes, freezes, partitions between relays, upstream crashes,
// rolling restarts, store outages, connection resets), plays them under
// churn, and checks the history with the chaos suite's checker
// (loadtest/validation), the simulated Envoys' own protocol checks, and
// the steady state: exactly one upstream stream per key once faults stop.
//
// Network (with Host, Listener and Transport, a memberlist transport over
// it), Store and Run are usable on their own; `go test ./loadtest/sim/`
// runs seeds (see loadtest/README.md, "loadtest sim", for the flags and
// what replays). Everything here must run inside a synctest bubble.
package sim
