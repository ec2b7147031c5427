"""M nodes x L GPUs per node with node-major ranks r = n*L + l (Table 2)."""

from __future__ import annotations

from dataclasses import dataclass

from tide_core.errors import PlanError


@dataclass(frozen=True)
class Topology:
    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{name}={value!r} must be an integer >= 1")

    @classmethod
    def from_world_size(cls, world_size: int, gpus_per_node: int) -> Topology:
        if not isinstance(world_size, int) or world_size < 1:
            raise PlanError(f"world_size={world_size!r} must be an integer >= 1")
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise PlanError(f"gpus_per_node={gpus_per_node!r} must be an integer >= 1")
        if world_size % gpus_per_node:
            raise PlanError(
                f"gpus_per_node={gpus_per_node} does not divide world_size={world_size}; "
                "TIDE needs the same number of GPUs on every node"
            )
        return cls(nodes=world_size // gpus_per_node, gpus_per_node=gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def rank(self, node: int, local: int) -> int:
        if not 0 <= node < self.nodes:
            raise PlanError(f"node={node} out of range [0, {self.nodes})")
        if not 0 <= local < self.gpus_per_node:
            raise PlanError(f"local={local} out of range [0, {self.gpus_per_node})")
        return node * self.gpus_per_node + local

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.gpus_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The L ranks of one node (one NVLink/NVSwitch domain)."""
        return [self.rank(node, l) for l in range(self.gpus_per_node)]

    def rail_ranks(self, local: int) -> list[int]:
        """The M ranks with local index ``local``: one rail, one rank per node."""
        return [self.rank(n, local) for n in range(self.nodes)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank={rank} out of range [0, {self.world_size})")
