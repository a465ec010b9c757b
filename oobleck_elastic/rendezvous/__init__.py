"""Control plane: `torchrun --rdzv-backend=oobleck` on etcd v3.

`keys` (the etcd key layout) and `records` (the values stored there), `membership` (a node's
leased record), `decide` (the leader's rules, a pure function), `leader` (election, and the loop
that reads a view, decides and publishes plans), `detect` (the roll call and the deputies that
find dead nodes and leaders) with `liveness` (agents' sockets), `hang` (hung workers) and
`preempt` (preemption notices), `worker` (what a worker sees of the control plane), and
`handler` (the RendezvousHandler torchrun calls, registered through `entry`). The handler is not
imported here: torch loads the entry point while its own rendezvous package is still importing.
"""

from ..records.keys import Keys
from ..records.control import Event, NodeRecord

__all__ = ["Event", "Keys", "NodeRecord"]
