"""Control plane: `torchrun --rdzv-backend=oobleck` on etcd v3, in the torchrun agent.

The handler torchrun calls, membership, the leader and its rules, failure detection. It imports
`records`, `etcd`, `planning`, `config` and `logs`, never the engine. The handler is not imported
here: torch loads the entry point while its own rendezvous package is still importing. The
story: docs/design.md.
"""
