"""Control plane: `torchrun --rdzv-backend=oobleck` on etcd v3.

`keys` (key layout and JSON records), `membership` (a node's leased record), `leader`
(election and plan publication), `handler` (the RendezvousHandler torchrun calls, registered
through `entry`). The handler is not imported here: torch loads the entry point while its own
rendezvous package is still importing.
"""

from .keys import Event, Keys, NodeRecord

__all__ = ["Event", "Keys", "NodeRecord"]
