"""Links between devices and what crosses them: the communication costs of the planner's model.

Three kinds of traffic: activations between consecutive stages (one point-to-point message,
`Links.p2p_s` = latency + bytes / bandwidth, inside a node or across nodes), tensor-parallel
collectives inside a layer (part of the profile's layer times; `all_reduce_s` for analytic
profiles), and the cross-replica gradient all-reduce (ring: 2 (k - 1) / k x bytes / bandwidth +
2 (k - 1) x latency for k members). Bandwidths are per device, in GB/s, from `planning.*`
settings. docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Links:
    """Bandwidth and latency of the links between devices (per device, one direction)."""

    intra_node_gb_s: float = 150.0
    """GB/s between two devices of one node (NVLink class)."""
    inter_node_gb_s: float = 12.5
    """GB/s between devices of different nodes (a 100 Gb/s NIC per device)."""
    latency_s: float = 10e-6
    """Seconds per message, added to every transfer."""

    def __post_init__(self) -> None:
        if self.intra_node_gb_s <= 0 or self.inter_node_gb_s <= 0 or self.latency_s < 0:
            raise ValueError(f"link bandwidths must be > 0 and latency >= 0 (got {self})")

    def bandwidth(self, same_node: bool) -> float:
        """Bytes per second of a link inside a node, or across nodes."""
        return (self.intra_node_gb_s if same_node else self.inter_node_gb_s) * 1e9

    def p2p_s(self, nbytes: float, *, same_node: bool) -> float:
        """Time of one message of `nbytes` between two devices."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth(same_node)

    def all_reduce_s(self, nbytes: float, members: int, *, same_node: bool) -> float:
        """Ring all-reduce of `nbytes` among `members` devices (0 for one member)."""
        if members < 2 or nbytes <= 0:
            return 0.0
        k = members
        return 2 * (k - 1) * self.latency_s + 2 * (k - 1) / k * nbytes / self.bandwidth(same_node)

    def to_json(self) -> dict[str, Any]:
        return {
            "intra_node_gb_s": self.intra_node_gb_s,
            "inter_node_gb_s": self.inter_node_gb_s,
            "latency_s": self.latency_s,
        }
