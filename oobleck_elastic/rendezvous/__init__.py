"""Control plane: `torchrun --rdzv-backend=oobleck` on etcd v3, in the torchrun agent.

`handler` (the in-place RendezvousHandler torchrun calls, registered through `entry`, which picks
it or `restart`, torch's dynamic rendezvous on etcd for plain scripts; `options` reads the launch
and the `--rdzv-conf` options), `membership` (a
node's leased record), `leader` (election, and the loop that reads a view, decides and publishes
plans) with `decide` (its rules, a pure function) and `planner` (its planning and profile
pinning), `detect` (the roll call and the deputies that find dead nodes and leaders) with
`liveness` (agents' sockets), `hang` (hung workers of this node), `preempt` (preemption notices),
`stragglers` (the leader's side of a slow node), and `worker` (what a worker sees of the control
plane). The keys and values it keeps in etcd are the records layer's (records/). The handler is
not imported here: torch loads the entry point while its own rendezvous package is still
importing.

Imports: `records`, `etcd`, `planning`, `config` and `logs`; never the engine.
"""
