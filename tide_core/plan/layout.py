"""Per-group layout: the paper's R_p, K_p, s_p, o_p, S and Landing(p, r) (Section 2.1, Eq. 2).

Every byte offset the transports use comes from here. A parameter p of an FSDP2 group is viewed
as a (D_p, K_p) matrix sharded along dimension 0 over N ranks; each rank holds R_p = ceil(D_p/N)
padded rows. Rank-major FSDP2 would put rank r's shard of p at r*S + o_p; TIDE lands it directly
at the parameter-major offset o_p*N + r*s_p.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tide_core.errors import PlanError


def _as_2d(shape: Sequence[int] | int, index: int) -> tuple[int, int]:
    """Reduce a parameter shape to (D, K): D = dim 0, K = product of the trailing dims."""
    if isinstance(shape, int):
        shape = (shape,)
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"shapes[{index}]={shape!r} is not a sequence of ints") from exc
    if len(dims) == 0:
        raise PlanError(f"shapes[{index}]=() has no dimension 0 to shard; scalars are not 2-D reducible")
    if any(d <= 0 for d in dims):
        raise PlanError(f"shapes[{index}]={dims} has a non-positive dimension; every dimension must be >= 1")
    return dims[0], math.prod(dims[1:])


def gathered_shape(input_shape: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The unsharded shape of an all-gather input whose per-rank shape is ``input_shape``: the N
    ranks' inputs stacked on dimension 0 (FSDP2's all-gather extensions; a 0-d input gathers to N
    elements). Its layout entry then has R = the input's dim 0 and no padding."""
    dims = tuple(int(d) for d in input_shape) or (1,)
    return (dims[0] * world_size, *dims[1:])


@dataclass(frozen=True)
class GroupLayout:
    """Layout of one FSDP2 parameter group sharded over ``world_size`` ranks.

    ``itemsize`` is the all-gather element size b_ag in bytes. Element-based helpers
    (``shard_numel``, ``shard_elem_offset``) are independent of it and are what the
    reduce-scatter uses with its own gradient and output item sizes.

    ``align`` (elements) rounds every o_p up to a multiple of it. FSDP2's packed shard has no gaps
    (align 1, what the reduce-scatter output needs); a group whose parameters have different dtypes
    is all-gathered as bytes (itemsize 1, each row K_p * its item size wide), and aligning its o_p to
    16 bytes keeps every landing aligned for its own dtype (o_p*N + r*s_p, s_p a multiple of the
    item size).
    """

    rows: tuple[int, ...]
    cols: tuple[int, ...]
    world_size: int
    itemsize: int = 2
    align: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise PlanError(f"world_size={self.world_size!r} must be an integer >= 1")
        if self.itemsize not in (1, 2, 4, 8):
            raise PlanError(f"itemsize={self.itemsize!r} must be 1, 2, 4 or 8 bytes")
        if len(self.rows) != len(self.cols):
            raise PlanError(f"rows has {len(self.rows)} entries but cols has {len(self.cols)}")
        if len(self.rows) == 0:
            raise PlanError("shapes is empty: a group needs at least one parameter")
        for p, (d, k) in enumerate(zip(self.rows, self.cols)):
            if d < 1 or k < 1:
                raise PlanError(f"parameter {p} has shape ({d}, {k}); both dimensions must be >= 1")
        if not isinstance(self.align, int) or self.align < 1:
            raise PlanError(f"align={self.align!r} must be an integer >= 1")
        padded = tuple(-(-d // self.world_size) for d in self.rows)
        numels = tuple(r * k for r, k in zip(padded, self.cols))
        offsets = [0]
        for n in numels[:-1]:
            end = offsets[-1] + n
            offsets.append(-(-end // self.align) * self.align)
        object.__setattr__(self, "_padded", padded)
        object.__setattr__(self, "_numels", numels)
        object.__setattr__(self, "_elem_offsets", tuple(offsets))

    @classmethod
    def from_shapes(cls, shapes: Iterable[Sequence[int] | int], world_size: int, itemsize: int = 2) -> GroupLayout:
        shapes = list(shapes)
        dk = [_as_2d(s, i) for i, s in enumerate(shapes)]
        return cls(
            rows=tuple(d for d, _ in dk),
            cols=tuple(k for _, k in dk),
            world_size=world_size,
            itemsize=itemsize,
        )

    @classmethod
    def bytes_of(
        cls, shapes: Iterable[Sequence[int] | int], itemsizes: Sequence[int], world_size: int, align: int = 16
    ) -> GroupLayout:
        """The layout of parameters of different item sizes moved as bytes: row width K_p * itemsize_p,
        every o_p aligned to ``align`` bytes."""
        shapes = list(shapes)
        if len(itemsizes) != len(shapes):
            raise PlanError(f"{len(itemsizes)} item sizes for {len(shapes)} shapes")
        dk = [_as_2d(s, i) for i, s in enumerate(shapes)]
        return cls(
            rows=tuple(d for d, _ in dk),
            cols=tuple(k * size for (_, k), size in zip(dk, itemsizes)),
            world_size=world_size,
            itemsize=1,
            align=align,
        )

    def with_itemsize(self, itemsize: int) -> GroupLayout:
        return GroupLayout(self.rows, self.cols, self.world_size, itemsize, self.align)

    # -- per parameter ---------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return len(self.rows)

    def _check(self, p: int) -> int:
        if not 0 <= p < len(self.rows):
            raise PlanError(f"parameter index p={p} out of range [0, {len(self.rows)})")
        return p

    def padded_rows(self, p: int) -> int:
        """R_p = ceil(D_p / N)."""
        return self._padded[self._check(p)]

    def shard_numel(self, p: int) -> int:
        """Elements of one rank's padded shard of p: R_p * K_p."""
        return self._numels[self._check(p)]

    def shard_bytes(self, p: int) -> int:
        """s_p = R_p * K_p * itemsize."""
        return self.shard_numel(p) * self.itemsize

    def shard_elem_offset(self, p: int) -> int:
        """Element offset of p inside one rank's packed shard (FSDP2's packed per-rank layout)."""
        return self._elem_offsets[self._check(p)]

    def shard_offset(self, p: int) -> int:
        """o_p = sum of s_i for i < p (bytes)."""
        return self.shard_elem_offset(p) * self.itemsize

    def valid_rows(self, p: int, r: int) -> int:
        """Rows of rank r's shard of p that hold data; the rest (rows past D_p) are padding."""
        self._check_rank(r)
        return max(0, min(self.padded_rows(p), self.rows[p] - r * self.padded_rows(p)))

    def landing(self, p: int, r: int) -> int:
        """Byte offset of rank r's shard of p in the parameter-major group buffer (Eq. 2)."""
        self._check_rank(r)
        return self.shard_offset(p) * self.world_size + r * self.shard_bytes(p)

    def unsharded_numel(self, p: int) -> int:
        """Elements of p's padded unsharded storage: N * R_p * K_p."""
        return self.world_size * self.shard_numel(p)

    def _check_rank(self, r: int) -> None:
        if not 0 <= r < self.world_size:
            raise PlanError(f"rank r={r} out of range [0, {self.world_size})")

    # -- whole group -----------------------------------------------------------------------
    @property
    def total_shard_numel(self) -> int:
        """E: elements of one rank's packed shard (also FSDP2's reduce-scatter output numel), gaps
        of ``align`` included."""
        return self._elem_offsets[-1] + self._numels[-1]

    @property
    def total_shard_bytes(self) -> int:
        """S."""
        return self.total_shard_numel * self.itemsize

    @property
    def group_bytes(self) -> int:
        """N*S: bytes of the whole unsharded (padded) group."""
        return self.total_shard_bytes * self.world_size

    def signature(self) -> tuple:
        """Hashable identity used to cache plans and to compare ranks."""
        return (self.rows, self.cols, self.world_size, self.itemsize, self.align)

    def param_at_element(self, e: int) -> int:
        """Parameter whose packed shard range holds element e (binary search)."""
        if not 0 <= e < self.total_shard_numel:
            raise PlanError(f"element e={e} out of range [0, {self.total_shard_numel})")
        lo, hi = 0, self.num_params - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._elem_offsets[mid] <= e:
                lo = mid
            else:
                hi = mid - 1
        return lo
