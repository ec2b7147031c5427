"""One FSDP2 parameter group served by TIDE: direct landing and per-parameter reduce-scatter.

All-gather: shards land in an arena slot at Landing(p, r); ``FSDPParam.all_gather_outputs[0]``
*is* that landing (a zero-offset storage rooted at the slot address), so FSDP2's
``init_unsharded_param`` builds the unsharded parameter over it and neither the rank-major buffer
nor ``split_with_sizes_copy`` exists. Freeing after reshard is logical (the slot is released for
the next group), never a ``resize_``.

Reduce-scatter: the gradients autograd produced go straight to the transport, which writes the
fp32 packed shard FSDP2 expects (no ``_chunk_cat``, no full-group fp32 buffer); FSDP2's divide
factors become alpha; an existing packed sharded gradient is accumulated into in place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tide_core.config import TIDEConfig
from tide_core.errors import TIDEError
from tide_core.fsdp import compat
from tide_core.plan import GroupLayout
from tide_core.runtime.arena import Segment

log = logging.getLogger("tide")


class SlotConflictError(TIDEError, RuntimeError):
    """Two groups that are live at the same time were placed in one ring slot."""


@dataclass
class SlotRing:
    """Two landing slots shared by leaf groups in execution order (Appendix F: group g uses g mod 2)."""

    transport: object
    slot_bytes: int
    segments: list[Segment | None] = field(default_factory=lambda: [None, None])
    occupant: list[object | None] = field(default_factory=lambda: [None, None])
    release_event: list[object | None] = field(default_factory=lambda: [None, None])
    next_index: int = 0
    members: list = field(default_factory=list)  # the TideGroups sharing the two slots

    def segment(self, q: int) -> Segment:
        if self.segments[q] is None:
            self.segments[q] = self.transport.arena.segment(f"ring{q}", self.slot_bytes)
        return self.segments[q]


class _ReadHold:
    """What FSDP2 keeps as the reduce-scatter "input" until the compute stream waited for the
    reduce-scatter: here, the per-parameter gradients (or slot views) the transport reads."""

    def __init__(self, tensors):
        self.tensors = tensors


class TideGroup:
    def __init__(
        self, config: TIDEConfig, index: int, name: str, param_group, transport, ring: SlotRing | None, internals
    ):
        self.config = config
        self.index = index
        self.name = name
        self.pg = param_group
        self.fsdp_params = compat.fsdp_params(param_group)
        self.transport = transport
        self.ring = ring
        self.internals = internals
        self.device = compat.group_device(param_group)
        self.world_size = transport.topology.world_size
        self.ag_dtype = compat.all_gather_dtype(param_group)
        shapes = compat.param_shapes(self.fsdp_params)
        self.layout = GroupLayout.from_shapes(shapes, world_size=self.world_size, itemsize=self.ag_dtype.itemsize)
        self.landings: list[torch.Tensor] | None = None
        self.segment: Segment | None = None
        self.slot: int | None = None  # ring slot index, or None for a dedicated segment
        self.live = False
        self.fallback_reason: str | None = None  # set when the group was handed back to stock collectives
        self.stats = {"all_gathers": 0, "reduce_scatters": 0, "ag_bytes": 0, "rs_bytes": 0, "slot_sources": 0}
        self.pending_timings: dict[str, list] = {"ag": [], "rs": []}  # (start, end) CUDA events when profiling
        self._device_handle = getattr(torch, self.device.type)

    # -- placement -------------------------------------------------------------------------
    @property
    def placement(self) -> str:
        if self.landings is None:
            return "unbound (no all-gather yet)"
        return f"ring slot {self.slot}" if self.slot is not None else "dedicated landing"

    def _bind(self) -> None:
        """Choose the landing at the group's first all-gather (execution order) and root FSDP2's
        all-gather outputs there. Only done while sharded, before any unsharded parameter exists
        over the new storage."""
        # A group kept unsharded after backward (set_reshard_after_backward(False)) or keeping its
        # unsharded storage (set_keep_unsharded_storage(True)) would hold its ring slot while the
        # next groups gather into it: it gets a dedicated landing.
        if (
            self.ring is not None
            and compat.reshards_after_backward(self.pg)
            and not compat.keeps_unsharded_storage(self.pg)
        ):
            order = [self.ring.next_index, 1 - self.ring.next_index]
            free = [q for q in order if self.ring.occupant[q] is None]
            if free:
                self.slot = free[0]
                self.ring.next_index = 1 - self.slot
                self.segment = self.ring.segment(self.slot)
            else:
                log.info("TIDE: group %s is live with both ring slots in use; giving it a dedicated landing", self.name)
        if self.segment is None:
            self.segment = self.transport.arena.segment(f"group{self.index}", self.layout.group_bytes)
        N = self.world_size
        self.landings = [
            self.segment.tensor(self.layout.shard_offset(p) * N, self.layout.unsharded_numel(p), self.ag_dtype)
            for p in range(self.layout.num_params)
        ]
        compat.root_landings(self.fsdp_params, self.landings, self._released)

    def _released(self) -> None:
        """FSDPParam.free_unsharded_param for served parameters: a logical free of the slot."""
        if not self.live:
            return
        self.live = False
        if self.slot is not None:
            self.ring.occupant[self.slot] = None
            self.ring.release_event[self.slot] = self._device_handle.current_stream().record_event()

    def stock_gradient_pending(self) -> bool:
        """Before the first TIDE all-gather: FSDP2 holds an unreduced gradient on an unsharded
        parameter it built over its own storage (steps without gradient sync ran on stock
        collectives, e.g. ``unshard()`` before the first forward). Binding would rebuild that
        parameter over the landing and drop the gradient."""
        return self.landings is None and compat.unsharded_grad_pending(self.fsdp_params)

    def fall_back(self, reason: str) -> None:
        """Hand the group to stock collectives for good (before it was ever bound); the install
        report then lists it as on stock collectives with ``reason``."""
        self.unbind()
        compat.unmark_served(self.internals, self.pg)
        self.fallback_reason = reason
        log.warning("TIDE: group %s runs stock collectives from now on: %s", self.name, reason)

    def _gather_dropped(self) -> bool:
        """FSDP2 discarded this group's all-gather without unsharding (a prefetch nobody waited
        for, cleared at the end of backward): the landing holds nothing, and no free follows."""
        return self.live and compat.all_gather_dropped(self.pg)

    @property
    def unsharded(self) -> bool:
        """FSDP2 holds this group's unsharded parameters over its landing (a dropped all-gather
        does not count: nothing was built over it)."""
        return self.live and not self._gather_dropped()

    def unbind(self) -> None:
        """Give FSDP2 its own storage back (uninstall). Only between steps."""
        if self._gather_dropped():
            self._released()
        if self.live:
            raise TIDEError(f"cannot uninstall TIDE while group {self.name} is unsharded; uninstall between steps")
        compat.release_landings(self.fsdp_params, rooted=self.landings is not None)
        compat.unmark_served(self.internals, self.pg)
        self.landings = None

    # -- all-gather ------------------------------------------------------------------------
    def all_gather(self, async_op, copy_in_stream, ag_stream):
        if self.landings is None:
            self._bind()
        if self.slot is not None:
            holder = self.ring.occupant[self.slot]
            if holder is not None and holder is not self and holder._gather_dropped():
                holder._released()
                holder = None
            if holder is not None and holder is not self:
                raise SlotConflictError(
                    f"TIDE ring slot {self.slot} is still held by group {holder.name} (unsharded) while group "
                    f"{self.name} all-gathers into it: {self._conflict_cause()}. Set TIDE_RING=0 (every group "
                    "gets its own landing)."
                )
            self.ring.occupant[self.slot] = self
        self.live = True
        dh = self._device_handle
        with dh.stream(copy_in_stream):
            shards = compat.all_gather_inputs(self.internals, self.fsdp_params)  # FSDP2's fused cast under MP
        if shards[0].dtype != self.ag_dtype:
            raise TIDEError(f"group {self.name}: FSDP2 all-gathers {shards[0].dtype} but TIDE planned {self.ag_dtype}")
        ag_stream.wait_stream(copy_in_stream)
        outputs = [
            t.view(self.world_size * self.layout.padded_rows(p), self.layout.cols[p])
            for p, t in enumerate(self.landings)
        ]
        with dh.stream(ag_stream):
            if self.slot is not None and self.ring.release_event[self.slot] is not None:
                ag_stream.wait_event(self.ring.release_event[self.slot])
            # The transport writes into storages autograd may have saved; FSDP2 preserves the
            # version counter around its own copy-out for the same reason.
            timing = self._timing_start(ag_stream)
            with torch.autograd._unsafe_preserve_version_counter(tuple(self.landings)):
                work = self.transport.all_gather(self.layout, shards, outputs)
                if work is not None:
                    work.wait()
            self._timing_end("ag", timing, ag_stream)
            event = ag_stream.record_event()
        self.stats["all_gathers"] += 1
        self.stats["ag_bytes"] += self.layout.total_shard_bytes * (self.world_size - 1)
        return compat.tide_all_gather_result(self.internals, shards, event, self.ag_dtype, self.device)

    def _conflict_cause(self) -> str:
        if compat.explicit_prefetch([g.pg for g in self.ring.members]):
            return (
                "explicit prefetch (set_modules_to_forward/backward_prefetch) of more groups than were "
                "live when the landings were placed"
            )
        return (
            "a ring group stayed unsharded while two others were gathered (reshard after forward or "
            "after backward turned off after its landing was placed)"
        )

    def _timing_start(self, stream):
        if not (self.config.profile and self.device.type == "cuda"):
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start

    def _timing_end(self, kind: str, start, stream) -> None:
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self.pending_timings[kind].append((start, end))

    def collect_timings(self) -> dict[str, float]:
        """Milliseconds spent in this group's collectives since the last call (waits for them)."""
        totals = {}
        for kind, pairs in self.pending_timings.items():
            total = 0.0
            for start, end in pairs:
                end.synchronize()
                total += start.elapsed_time(end)
            totals[f"{kind}_ms"] = total
            pairs.clear()
        return totals

    # -- reduce-scatter --------------------------------------------------------------------
    def divide(self, rs_group, ar_group, reduce_dtype, divide_factor, force_sum):
        """(alpha, all-reduce op): FSDP2's pre/post divide, AVG and PREMUL_SUM folded into alpha."""
        pre, post, rs_op, ar_op = compat.gradient_divide_factors(
            self.internals, rs_group, ar_group, reduce_dtype, self.device.type, divide_factor, force_sum
        )
        if pre is not None or post is not None:
            return 1.0 / ((pre or 1) * (post or 1)), ar_op
        if isinstance(rs_op, dist.ReduceOp.RedOpType):
            if rs_op == dist.ReduceOp.AVG:
                return 1.0 / rs_group.size(), ar_op
            if rs_op == dist.ReduceOp.SUM:
                return 1.0, ar_op
            raise TIDEError(f"unexpected reduce-scatter op {rs_op}")
        return 1.0 / float(divide_factor), ar_op  # PREMUL_SUM(1 / factor)

    def _fused_output(self, fsdp_params, layout: GroupLayout, orig_dtype):
        """The packed fp32 buffer all existing sharded grads are views of, in layout order, or None."""
        if orig_dtype not in (None, torch.float32):
            return None
        offsets = [layout.shard_elem_offset(p) for p in range(layout.num_params)]
        return compat.packed_sharded_grad_base(fsdp_params, offsets, layout.total_shard_numel)

    def reduce(
        self,
        fsdp_params,
        unsharded_grads,
        rs_group,
        rs_stream,
        orig_dtype,
        reduce_dtype,
        device,
        divide_factor,
        ar_group,
        ar_stream,
        all_reduce_grads,
        partial_reduce_output,
        all_reduce_hook,
        force_sum,
    ):
        dh = self._device_handle
        grads = list(unsharded_grads)
        unsharded_grads.clear()
        reduce_dtype = reduce_dtype or grads[0].dtype
        if len({g.dtype for g in grads}) > 1:
            # torch 2.15 hands over gradients of several dtypes (e.g. rms_norm's fp32 weight gradient
            # next to bf16 ones whose upcast it deferred); its copy-in casts each to the reduce
            # dtype, and so does this.
            grads = [g if g.dtype == reduce_dtype else g.to(reduce_dtype) for g in grads]
        if list(fsdp_params) == self.fsdp_params:
            layout = self.layout
        else:  # parameters without gradients this step are skipped (2.15: or reordered by dtype), as FSDP2 does
            layout = GroupLayout.from_shapes(compat.param_shapes(fsdp_params), world_size=self.world_size)
        alpha, ar_op = self.divide(rs_group, ar_group, reduce_dtype, divide_factor, force_sum)
        current = dh.current_stream()

        sources = grads
        slot_source = (
            self.config.mode == "slot_reuse"
            and self.landings is not None
            and not self.live  # resharded: the landing is vacated (not so with reshard_after_backward=False)
            and layout is self.layout
            and grads[0].dtype == self.ag_dtype
        )
        if slot_source:
            # Slot-Reuse: the vacated landing has the gradients' exact geometry. Copy them in and
            # drop autograd's storage at once (stream-ordered: later compute-stream allocations
            # run after the copy); the slot's next all-gather waits for the read. Autograd may
            # still hold the unsharded parameters built over the landing (a group's modules
            # backpropagated in several passes); like the all-gather, the copy keeps their
            # version counter, because FSDP2 re-gathers the group before they are read again.
            sources = [landing[: g.numel()].view(g.shape) for landing, g in zip(self.landings, grads)]
            with torch.autograd._unsafe_preserve_version_counter(tuple(self.landings)):
                torch._foreach_copy_(sources, grads)
            grads = None
            self.stats["slot_sources"] += 1
        # Accumulating straight into the existing sharded gradient only matches FSDP2 when the
        # reduce-scatter output is the final gradient: under HSDP it first goes to the replica
        # all-reduce (or the partial-reduce buffer), and an all-reduce hook sees this step's sum.
        fused = None
        if ar_group is None and all_reduce_hook is None:
            fused = self._fused_output(fsdp_params, layout, orig_dtype)
        rs_stream.wait_stream(current)
        with dh.stream(rs_stream):
            out = (
                fused
                if fused is not None
                else torch.empty(layout.total_shard_numel, dtype=torch.float32, device=device)
            )
            timing = self._timing_start(rs_stream)
            work = self.transport.reduce_scatter(layout, sources, out, alpha=alpha, accumulate=fused is not None)
            if work is not None:
                work.wait()
            self._timing_end("rs", timing, rs_stream)
            rs_event = rs_stream.record_event()
        if slot_source and self.slot is not None:
            self.ring.release_event[self.slot] = rs_event
        self.stats["reduce_scatters"] += 1
        self.stats["rs_bytes"] += layout.total_shard_numel * sources[0].element_size() * (self.world_size - 1)

        post_stream = rs_stream
        all_reduce_input = all_reduce_event = None
        reduce_output = out
        if ar_group is not None:  # HSDP: the shard-group output goes to FSDP2's replica all-reduce
            with dh.stream(rs_stream):
                if not all_reduce_grads:
                    if partial_reduce_output is not None:
                        partial_reduce_output += reduce_output
                    else:
                        partial_reduce_output = reduce_output
                    return self._result(
                        _ReadHold(sources),
                        rs_event,
                        post_stream,
                        post_stream.record_event(),
                        None,
                        None,
                        partial_reduce_output,
                    )
                if partial_reduce_output is not None:
                    reduce_output += partial_reduce_output
            post_stream = ar_stream
            ar_stream.wait_stream(rs_stream)
            with dh.stream(ar_stream):
                dist.all_reduce(reduce_output, group=ar_group, op=ar_op)
                all_reduce_input = reduce_output
                all_reduce_event = ar_stream.record_event()
        if all_reduce_hook is not None:
            post_stream = ar_stream
            ar_stream.wait_stream(rs_stream)
            with dh.stream(ar_stream):
                all_reduce_hook(reduce_output)
                if self.internals.profile.hook_output_held:
                    # 2.15: FSDP2 holds the hook's input across layers, like the HSDP all-reduce buffer.
                    all_reduce_input, all_reduce_event = reduce_output, ar_stream.record_event()

        with dh.stream(post_stream):
            offsets = [layout.shard_elem_offset(p) for p in range(layout.num_params)]
            compat.set_sharded_grads(fsdp_params, reduce_output, offsets, orig_dtype, accumulated=fused is not None)
            post_reduce_event = post_stream.record_event()
        return self._result(
            _ReadHold(sources), rs_event, post_stream, post_reduce_event, all_reduce_input, all_reduce_event, None
        )

    def _result(self, hold, rs_event, post_stream, post_event, ar_input, ar_event, partial):
        return compat.reduce_result(
            self.internals, hold, rs_event, post_stream, post_event, ar_input, ar_event, partial
        )
