"""Shared random cases for transport tests: every rank can rebuild every rank's inputs from a seed."""

from __future__ import annotations

import numpy as np
import torch

from tide_core.plan import GroupLayout


def random_shapes(rng: np.random.Generator, world_size: int, max_params: int = 30) -> list[tuple[int, ...]]:
    P = int(rng.integers(max(2, max_params // 2), max_params + 1))
    shapes: list[tuple[int, ...]] = []
    for p in range(P):
        kind = p % 5
        if kind == 0:
            shapes.append((int(rng.integers(1, world_size + 1)),))  # D_p <= N, often < N
        elif kind == 1:
            shapes.append((int(rng.integers(1, 4 * world_size + 3)), int(rng.integers(1, 9))))
        elif kind == 2:
            shapes.append((world_size * int(rng.integers(1, 4)) + 1, int(rng.integers(1, 5)), 2))
        elif kind == 3:
            shapes.append((max(1, world_size - 1), int(rng.integers(1, 7))))
        else:
            shapes.append((int(rng.integers(world_size, 6 * world_size)), int(rng.integers(1, 6))))
    return shapes


def layout_for(shapes, world_size: int, itemsize: int) -> GroupLayout:
    return GroupLayout.from_shapes(shapes, world_size=world_size, itemsize=itemsize)


def all_shards(seed: int, layout: GroupLayout, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(layout.shard_numel(p), generator=g).to(dtype) for p in range(layout.num_params)]
        for _ in range(layout.world_size)
    ]


def all_grads(
    seed: int, shapes, world_size: int, dtype: torch.dtype, integer: bool = False
) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(world_size):
        if integer:
            out.append([torch.randint(-50, 50, s, generator=g).to(dtype) for s in shapes])
        else:
            out.append([torch.randn(s, generator=g).to(dtype) for s in shapes])
    return out


MIXED = (torch.bfloat16, torch.float32, torch.float16)  # a mixed-dtype group's parameters cycle through these


def mixed_case(seed: int, shapes, world_size: int) -> tuple[GroupLayout, list[list[torch.Tensor]]]:
    """A mixed-dtype group as FSDP2's all-gather sees it: each parameter in its own dtype, laid out
    in bytes (``GroupLayout.bytes_of``); every rank's shards as bytes of random values."""
    dtypes = [MIXED[p % len(MIXED)] for p in range(len(shapes))]
    lay = GroupLayout.bytes_of(shapes, [d.itemsize for d in dtypes], world_size)
    g = torch.Generator().manual_seed(seed)
    shards = [
        [
            torch.randn(lay.shard_numel(p) // dtypes[p].itemsize, generator=g).to(dtypes[p]).view(torch.uint8)
            for p in range(lay.num_params)
        ]
        for _ in range(world_size)
    ]
    return lay, shards


def expected_unsharded(layout: GroupLayout, shards, p: int) -> torch.Tensor:
    N = layout.world_size
    return torch.cat([shards[r][p] for r in range(N)]).view(N * layout.padded_rows(p), layout.cols[p])


def fp64_reduce_scatter(layout: GroupLayout, grads, rank: int, alpha: float, base: torch.Tensor | None) -> torch.Tensor:
    pieces = []
    N = layout.world_size
    for p in range(layout.num_params):
        R, K, D = layout.padded_rows(p), layout.cols[p], layout.rows[p]
        total = torch.zeros(R, K, dtype=torch.float64)
        for u in range(N):
            padded = torch.zeros(N * R, K, dtype=torch.float64)
            padded[:D] = grads[u][p].reshape(D, K).double()
            total += padded[rank * R : (rank + 1) * R]
        pieces.append(total.reshape(-1))
    y = alpha * torch.cat(pieces)
    return y + base.double() if base is not None else y
