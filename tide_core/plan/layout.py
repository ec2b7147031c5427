"""Per-group layout: the paper's R_p, K_p, s_p, o_p, S and Landing(p, r) (Section 2.1, Eq. 2).

Every byte offset the transports use comes from here. A parameter p of an FSDP2 group is viewed
as a (D_p, K_p) matrix sharded along dimension 0 over N ranks; each rank holds R_p = ceil(D_p/N)
padded rows. Rank-major FSDP2 would put rank r's shard of p at r*S + o_p; TIDE lands it directly
at the parameter-major offset o_p*N + r*s_p.

A parameter FSDP2 shards on a dim k > 0 (``Shard(k)``, which FSDP2 requires to be even) of shape
(outer, n_k, inner) with outer and inner the products of the dims before and after k: rank r holds
the contiguous chunk (outer, n_k/N, inner), so the transport sees it as D_p = N*outer rows of
K_p = (n_k/N)*inner, rank-blocked like any other. What the transport lands, (N, R_p, K_p), is the
parameter (R_p, N, K_p) with its first two dims swapped: one reorder copy (``reorder_shape``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tide_core.errors import PlanError

#: Byte alignment of each parameter's place in a reorder buffer (any dtype's, and 16-byte vector loads).
REORDER_ALIGN = 16


def _as_2d(shape: Sequence[int] | int, index: int, shard_dim: int = 0, world_size: int = 1) -> tuple[int, int]:
    """Reduce a parameter shape to (D, K): D = dim 0, K = product of the trailing dims. Sharded on
    dim k > 0 over N ranks: D = N * (product of the dims before k), K = (product from dim k on) / N."""
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
    if shard_dim == 0:
        return dims[0], math.prod(dims[1:])
    if not 0 < shard_dim < len(dims):
        raise PlanError(f"shapes[{index}]={dims} has no dim {shard_dim} to shard on")
    if dims[shard_dim] % world_size:
        raise PlanError(
            f"shapes[{index}]={dims}: dim {shard_dim} ({dims[shard_dim]}) does not split evenly over "
            f"{world_size} ranks (FSDP2 shards a dim other than 0 only evenly)"
        )
    return world_size * math.prod(dims[:shard_dim]), math.prod(dims[shard_dim:]) // world_size


def _shard_dims(shard_dims: Sequence[int] | None, count: int) -> tuple[int, ...]:
    if shard_dims is None:
        return (0,) * count
    if len(shard_dims) != count:
        raise PlanError(f"{len(shard_dims)} shard dims for {count} shapes")
    return tuple(int(k) for k in shard_dims)


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

    ``shard_rows`` (None: ceil(D_p/N) each) gives R_p explicitly, for shards padded beyond
    ceil(D_p/N): FSDP2's post-forward shards (``post_forward``).
    ``shard_dims`` (empty: all 0) is the dim FSDP2 shards each parameter on; rows and cols of a
    parameter sharded on k > 0 are already its (N*outer, n_k/N*inner) view (``from_shapes``).
    """

    rows: tuple[int, ...]
    cols: tuple[int, ...]
    world_size: int
    itemsize: int = 2
    align: int = 1
    shard_rows: tuple[int, ...] | None = None
    shard_dims: tuple[int, ...] = ()

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
        shard_dims = _shard_dims(self.shard_dims or None, len(self.rows))
        for p, (k, d) in enumerate(zip(shard_dims, self.rows)):
            if k < 0 or (k > 0 and d % self.world_size):
                raise PlanError(
                    f"parameter {p} sharded on dim {k} has {d} rows; a dim-k parameter has N*outer rows (k > 0)"
                )
        object.__setattr__(self, "shard_dims", shard_dims)
        padded = tuple(-(-d // self.world_size) for d in self.rows)
        if self.shard_rows is not None:
            if len(self.shard_rows) != len(self.rows):
                raise PlanError(f"shard_rows has {len(self.shard_rows)} entries for {len(self.rows)} parameters")
            for p, (explicit, least) in enumerate(zip(self.shard_rows, padded)):
                if not isinstance(explicit, int) or explicit < least:
                    raise PlanError(
                        f"shard_rows[{p}]={explicit!r}: {self.world_size} shards of it cannot hold "
                        f"D_p={self.rows[p]} rows (at least {least} each)"
                    )
            padded = tuple(self.shard_rows)
        numels = tuple(r * k for r, k in zip(padded, self.cols))
        offsets = [0]
        for n in numels[:-1]:
            end = offsets[-1] + n
            offsets.append(-(-end // self.align) * self.align)
        object.__setattr__(self, "_padded", padded)
        object.__setattr__(self, "_numels", numels)
        object.__setattr__(self, "_elem_offsets", tuple(offsets))
        reorder_offsets, end = [], 0
        for p, k in enumerate(shard_dims):
            reorder_offsets.append(end if k else None)
            if k:
                end = -(-(end + self.unsharded_numel(p) * self.itemsize) // REORDER_ALIGN) * REORDER_ALIGN
        object.__setattr__(self, "_reorder_offsets", tuple(reorder_offsets))
        object.__setattr__(self, "_reorder_bytes", end)

    @classmethod
    def from_shapes(
        cls,
        shapes: Iterable[Sequence[int] | int],
        world_size: int,
        itemsize: int = 2,
        shard_dims: Sequence[int] | None = None,
    ) -> GroupLayout:
        shapes = list(shapes)
        dims = _shard_dims(shard_dims, len(shapes))
        dk = [_as_2d(s, i, k, world_size) for i, (s, k) in enumerate(zip(shapes, dims))]
        return cls(
            rows=tuple(d for d, _ in dk),
            cols=tuple(k for _, k in dk),
            world_size=world_size,
            itemsize=itemsize,
            shard_dims=dims,
        )

    @classmethod
    def bytes_of(
        cls,
        shapes: Iterable[Sequence[int] | int],
        itemsizes: Sequence[int],
        world_size: int,
        align: int = 16,
        shard_dims: Sequence[int] | None = None,
    ) -> GroupLayout:
        """The layout of parameters of different item sizes moved as bytes: row width K_p * itemsize_p,
        every o_p aligned to ``align`` bytes."""
        shapes = list(shapes)
        if len(itemsizes) != len(shapes):
            raise PlanError(f"{len(itemsizes)} item sizes for {len(shapes)} shapes")
        dims = _shard_dims(shard_dims, len(shapes))
        dk = [_as_2d(s, i, k, world_size) for i, (s, k) in enumerate(zip(shapes, dims))]
        return cls(
            rows=tuple(d for d, _ in dk),
            cols=tuple(k * size for (_, k), size in zip(dk, itemsizes)),
            world_size=world_size,
            itemsize=1,
            align=align,
            shard_dims=dims,
        )

    def with_itemsize(self, itemsize: int) -> GroupLayout:
        return GroupLayout(
            self.rows,
            self.cols,
            self.world_size,
            itemsize,
            self.align,
            shard_rows=self.shard_rows,
            shard_dims=self.shard_dims,
        )

    def post_forward(self, size: int) -> GroupLayout:
        """The layout of FSDP2's post-forward all-gather (``reshard_after_forward=size``): after
        forward each rank keeps 1/size of every padded unsharded parameter, so the same N*R_p rows
        are split over ``size`` ranks, (N/size)*R_p rows each (not ceil(D_p/size): FSDP2 cuts the
        padded all-gather output). Post-forward rank j's shard is this layout's shards j*m .. j*m+m-1
        (m = N/size); o_p and the alignment scale by m, so every landing is one of this layout's
        and the group buffer is the same: both all-gathers land in the same bytes."""
        N = self.world_size
        if not isinstance(size, int) or size < 1 or N % size:
            raise PlanError(f"post-forward size={size!r} must divide world_size={N}")
        if any(self.shard_dims):
            # A dim-k parameter's rows are its (N*outer) view for N ranks, not rows FSDP2 splits
            # again after forward.
            raise PlanError("a post-forward layout needs every parameter sharded on dim 0")
        m = N // size
        post = GroupLayout(
            self.rows, self.cols, size, self.itemsize, self.align * m, shard_rows=tuple(m * r for r in self._padded)
        )
        moved = [
            (p, j)
            for p in range(self.num_params)
            for j in range(size)
            if post.landing(p, j) != self.landing(p, j * m) or post.shard_bytes(p) != m * self.shard_bytes(p)
        ]
        if moved or post.group_bytes != self.group_bytes:
            raise PlanError(f"post-forward layout over {size} ranks lands elsewhere than {self}: (p, rank) {moved}")
        return post

    # -- per parameter ---------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return len(self.rows)

    def _check(self, p: int) -> int:
        if not 0 <= p < len(self.rows):
            raise PlanError(f"parameter index p={p} out of range [0, {len(self.rows)})")
        return p

    def padded_rows(self, p: int) -> int:
        """R_p = ceil(D_p / N) (or ``shard_rows[p]``)."""
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

    def needs_reorder(self, p: int) -> bool:
        """p is sharded on a dim other than 0: what the transport lands is rank-major, not p."""
        return self.shard_dims[self._check(p)] != 0

    def reorder_shape(self, p: int) -> tuple[int, int, int]:
        """(N, R_p, K_p): the transport's (N*R_p, K_p) output of p split by rank. For a parameter
        sharded on dim k > 0 the parameter itself (contiguous) is this with dims 0 and 1 swapped,
        (R_p, N, K_p) = (outer, n_k, inner) with n_k split into N chunks: the all-gather copies
        output -> parameter through that swap, the reduce-scatter gradient -> rows the same way."""
        return (self.world_size, self.padded_rows(p), self.cols[p])

    def reorder_offset(self, p: int) -> int:
        """Byte offset of p's rank-major all-gather output in the group's reorder buffer (only for
        ``needs_reorder(p)``); each aligned to REORDER_ALIGN bytes."""
        offset = self._reorder_offsets[self._check(p)]
        if offset is None:
            raise PlanError(f"parameter {p} is sharded on dim 0: it lands in place, not in the reorder buffer")
        return offset

    @property
    def reorder_bytes(self) -> int:
        """Bytes of the reorder buffer: every parameter sharded on a dim other than 0, unsharded
        (0: none is)."""
        return self._reorder_bytes

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
        return (self.rows, self.cols, self.world_size, self.itemsize, self.align, self.shard_rows, self.shard_dims)

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
