"""One FSDP2 parameter group served by TIDE: direct landing and per-parameter reduce-scatter.

All-gather: shards land in an arena slot at Landing(p, r); ``FSDPParam.all_gather_outputs[0]``
*is* that landing (a zero-offset storage rooted at the slot address), so FSDP2's
``init_unsharded_param`` builds the unsharded parameter over it and neither the rank-major buffer
nor ``split_with_sizes_copy`` exists. A parameter with an all-gather extension has one landing per
input its ``fsdp_pre_all_gather`` returns, each an entry of the layout in its own dtype, and
FSDP2's ``fsdp_post_all_gather`` builds the parameter from them. Freeing after reshard is logical
(the slot is released for the next group), never a ``resize_``.

Reduce-scatter: the gradients autograd produced go straight to the transport, which writes the
fp32 packed shard FSDP2 expects (no ``_chunk_cat``, no full-group fp32 buffer); FSDP2's divide
factors become alpha; an existing packed sharded gradient is accumulated into in place.

Parameters sharded on a dim other than 0 (``Shard(k)``) cost one copy each way, as in stock FSDP2:
the transport lands them rank-major in a reorder buffer, copied into the landing as the parameter
(stock's ``torch.cat`` of the chunks along dim k); their gradients are copied rank-major before
the reduce-scatter (stock's ``torch.chunk`` and ``torch.cat``), then reduce like any other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tide_core.config import TIDEConfig
from tide_core.errors import TIDEError
from tide_core.fsdp import accessors
from tide_core.fsdp.calls import AllGatherCall, ReduceCall, ReduceOutcome
from tide_core.fsdp.grads import set_sharded_grads
from tide_core.fsdp.landing import release_landings, root_landings, unmark_served
from tide_core.plan import GroupLayout, gathered_shape
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
    members: list = field(default_factory=list)  # the ServedGroups sharing the two slots

    def segment(self, q: int) -> Segment:
        if self.segments[q] is None:
            self.segments[q] = self.transport.arena.segment(f"ring{q}", self.slot_bytes)
        return self.segments[q]


@dataclass
class ReorderBuffer:
    """Where the transport lands the parameters sharded on a dim other than 0 (rank-major) until
    the reorder copy puts them into their landings. In the transport's arena (its peers write
    there); shared by the groups of one transport, sized for the largest: their all-gathers run one
    after another, and the next waits for the last reorder copy out of it."""

    transport: object
    nbytes: int
    name: str = "reorder"
    allocated: Segment | None = None
    release_event: object | None = None

    def segment(self) -> Segment:
        if self.allocated is None:
            self.allocated = self.transport.arena.segment(self.name, self.nbytes)
        return self.allocated


class _ReadHold:
    """What FSDP2 keeps as the reduce-scatter "input" until the compute stream waited for the
    reduce-scatter: here, the per-parameter gradients (or slot views) the transport reads."""

    def __init__(self, tensors):
        self.tensors = tensors


class ServedGroup:
    """One FSDP2 parameter group (``param_group``) served by TIDE over ``transport``. FSDP2's calls
    reach it as typed requests (``calls``) from ``dispatch``, whatever the torch version."""

    def __init__(
        self,
        config: TIDEConfig,
        index: int,
        name: str,
        param_group,
        transport,
        ring: SlotRing | None,
        post_forward_transport=None,
        extension_inputs: list | None = None,
    ):
        """``post_forward_transport``: for ``reshard_after_forward=int``, the transport over the
        post-forward process group, which backward's re-gather runs over (into the same landings).
        ``extension_inputs``: per parameter, None, or the (per-rank size, dtype) of each input its
        all-gather extension returns (``accessors.extension_input_sizes``)."""
        self.config = config
        self.index = index
        self.name = name
        self.param_group = param_group
        self.fsdp_params = accessors.fsdp_params(param_group)
        self.transport = transport
        self.ring = ring
        self.device = accessors.param_group_device(param_group)
        self.world_size = transport.topology.world_size
        N = self.world_size
        shapes = accessors.param_shapes(self.fsdp_params)
        dims = accessors.shard_dims(self.fsdp_params)
        # One layout entry per all-gather input: a parameter's own shard, or each input of its
        # all-gather extension (landing in its own dtype; FSDP2's fsdp_post_all_gather builds the
        # parameter from them). Install keeps extensions to parameters sharded on dim 0.
        entry_shapes, entry_dims, self.ag_dtypes, self.inputs_per_param = [], [], [], []
        for shape, dim, dtype, inputs in zip(
            shapes, dims, accessors.all_gather_dtypes(param_group), extension_inputs or [None] * len(shapes)
        ):
            if inputs is None:
                inputs = [(None, dtype)]
            entry_shapes += [shape if size is None else gathered_shape(size, N) for size, _ in inputs]
            entry_dims += [dim if size is None else 0 for size, _ in inputs]
            self.ag_dtypes += [d for _, d in inputs]
            self.inputs_per_param.append(len(inputs))
        self.extensions = accessors.extension_names(param_group) if extension_inputs else []
        # One dtype: the layout in its elements. Several (frozen bf16 weights beside fp32 adapters,
        # float8 data beside fp32 scales): the all-gather moves bytes, every landing aligned for its
        # own dtype; the reduce-scatter keeps FSDP2's packed fp32 element layout, per parameter.
        self.mixed_dtypes = len(set(self.ag_dtypes)) > 1
        if self.mixed_dtypes:
            itemsizes = [d.itemsize for d in self.ag_dtypes]
            self.layout = GroupLayout.bytes_of(entry_shapes, itemsizes, N, shard_dims=entry_dims)
        else:
            itemsize = self.ag_dtypes[0].itemsize
            self.layout = GroupLayout.from_shapes(entry_shapes, world_size=N, itemsize=itemsize, shard_dims=entry_dims)
        if self.mixed_dtypes or self.extensions:
            self.reduce_layout = GroupLayout.from_shapes(shapes, world_size=N, shard_dims=dims)
        else:
            self.reduce_layout = self.layout
        self.post_forward_transport = post_forward_transport
        self.post_forward_group = accessors.post_forward_process_group(param_group)
        self.post_forward_layout = None
        if post_forward_transport is not None:
            self.post_forward_layout = self.layout.post_forward(post_forward_transport.topology.world_size)
        # Where parameters sharded on a dim other than 0 land first: install gives every group with
        # such parameters the one buffer its transport's groups share.
        self.reorder: ReorderBuffer | None = None
        self.reorder_outputs: dict[int, torch.Tensor] = {}  # p -> its rank-major all-gather output
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
            and accessors.reshards_after_backward(self.param_group)
            and not accessors.keeps_unsharded_storage(self.param_group)
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
            self.segment.tensor(
                self.layout.shard_offset(p) * N,
                self.layout.unsharded_numel(p) * self.layout.itemsize // dtype.itemsize,
                dtype,
            )
            for p, dtype in enumerate(self.ag_dtypes)
        ]
        per_param, start = [], 0
        for count in self.inputs_per_param:
            per_param.append(self.landings[start : start + count])
            start += count
        root_landings(self.fsdp_params, per_param, self._released)
        if self.reorder is not None:
            segment, wire = self.reorder.segment(), self._wire_dtype
            self.reorder_outputs = {
                p: segment.tensor(
                    self.layout.reorder_offset(p),
                    self.layout.unsharded_numel(p) * self.layout.itemsize // wire.itemsize,
                    wire,
                ).view(N * self.layout.padded_rows(p), self.layout.cols[p])
                for p in range(self.layout.num_params)
                if self.layout.needs_reorder(p)
            }

    @property
    def _wire_dtype(self) -> torch.dtype:
        """The dtype the transport moves: bytes when the group's dtypes differ."""
        return torch.uint8 if self.mixed_dtypes else self.ag_dtypes[0]

    def _released(self) -> None:
        """FSDPParam.free_unsharded_param for served parameters: a logical free of the slot."""
        if not self.live:
            return
        self.live = False
        if self.slot is not None:
            self.ring.occupant[self.slot] = None
            self.ring.release_event[self.slot] = self._device_handle.current_stream().record_event()

    def is_post_forward(self, process_group) -> bool:
        """Whether an all-gather over ``process_group`` is the re-gather from post-forward shards."""
        return self.post_forward_group is not None and process_group is self.post_forward_group

    def planned_inputs(self, process_group=None) -> list[tuple[torch.dtype, int]]:
        """(dtype, numel) of every all-gather input the landings were planned for, over
        ``process_group`` (the post-forward group's shards hold N/k of the main ones)."""
        layout = self.post_forward_layout if self.is_post_forward(process_group) else self.layout
        return [(d, layout.shard_bytes(e) // d.itemsize) for e, d in enumerate(self.ag_dtypes)]

    def planned_inputs_differ(self, shards, process_group=None) -> bool:
        """FSDP2 all-gathers other dtypes or sizes than install planned (parameters cast after
        install, an all-gather extension that changed what it gathers)."""
        return [(t.dtype, t.numel()) for t in shards] != self.planned_inputs(process_group)

    def stock_gradient_pending(self) -> bool:
        """Before the first TIDE all-gather: FSDP2 holds an unreduced gradient on an unsharded
        parameter it built over its own storage (steps without gradient sync ran on stock
        collectives, e.g. ``unshard()`` before the first forward). Binding would rebuild that
        parameter over the landing and drop the gradient."""
        return self.landings is None and accessors.unsharded_grad_pending(self.fsdp_params)

    def fall_back(self, reason: str) -> None:
        """Hand the group to stock collectives for good (before it was ever bound); the install
        report then lists it as on stock collectives with ``reason``."""
        self.unbind()
        self.fallback_reason = reason
        log.warning("TIDE: group %s runs stock collectives from now on: %s", self.name, reason)

    def _gather_dropped(self) -> bool:
        """FSDP2 discarded this group's all-gather without unsharding (a prefetch nobody waited
        for, cleared at the end of backward): the landing holds nothing, and no free follows."""
        return self.live and accessors.all_gather_dropped(self.param_group)

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
        release_landings(self.fsdp_params, rooted=self.landings is not None)
        unmark_served(self.param_group)
        self.landings = None
        self.reorder_outputs = {}

    # -- all-gather ------------------------------------------------------------------------
    def all_gather(self, call: AllGatherCall):
        """Land every rank's shards in this group's landings; returns the event FSDP2 waits on."""
        with torch.profiler.record_function("TIDE::all_gather"):
            return self._all_gather(call.shards, call.copy_in_stream, call.all_gather_stream, call.process_group)

    def _all_gather(self, shards, copy_in_stream, ag_stream, process_group):
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
        if self.planned_inputs_differ(shards, process_group):  # after binding the landings cannot change
            raise TIDEError(
                f"group {self.name}: FSDP2 all-gathers {[(t.dtype, t.numel()) for t in shards]} but its "
                f"landings hold {self.planned_inputs(process_group)} (parameter dtypes or all-gather extension inputs "
                "changed after its first all-gather)"
            )
        ag_stream.wait_stream(copy_in_stream)
        # After forward (reshard_after_forward=int) each rank holds 1/k of the padded parameters:
        # the k ranks of the post-forward group gather them into the same landings.
        transport, layout = self.transport, self.layout
        if self.is_post_forward(process_group):
            transport, layout = self.post_forward_transport, self.post_forward_layout
        wire_shards, outputs = shards, self.landings
        if self.mixed_dtypes:  # the transport moves bytes
            wire_shards = [t.view(torch.uint8) for t in shards]
            outputs = [t.view(torch.uint8) for t in self.landings]
        outputs = [t.view(layout.world_size * layout.padded_rows(p), layout.cols[p]) for p, t in enumerate(outputs)]
        # Parameters sharded on a dim other than 0 land rank-major in the reorder buffer.
        landed = [self.reorder_outputs.get(p, t) for p, t in enumerate(outputs)]
        with dh.stream(ag_stream):
            if self.slot is not None and self.ring.release_event[self.slot] is not None:
                ag_stream.wait_event(self.ring.release_event[self.slot])
            if self.reorder_outputs and self.reorder.release_event is not None:
                ag_stream.wait_event(self.reorder.release_event)
            # The transport writes into storages autograd may have saved; FSDP2 preserves the
            # version counter around its own copy-out for the same reason.
            timing = self._timing_start(ag_stream)
            with torch.autograd._unsafe_preserve_version_counter(tuple(self.landings)):
                work = transport.all_gather(layout, wire_shards, landed)
                if work is not None:
                    work.wait()
                for p, rank_major in self.reorder_outputs.items():
                    N, R, K = self.layout.reorder_shape(p)
                    outputs[p].view(R, N, K).copy_(rank_major.view(N, R, K).transpose(0, 1))
            self._timing_end("ag", timing, ag_stream)
            event = ag_stream.record_event()
            if self.reorder_outputs:
                self.reorder.release_event = event
        self.stats["all_gathers"] += 1
        self.stats["ag_bytes"] += layout.total_shard_bytes * (layout.world_size - 1)
        return event

    def _conflict_cause(self) -> str:
        if accessors.explicit_prefetch([g.param_group for g in self.ring.members]):
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
    def reduce(self, call: ReduceCall) -> ReduceOutcome:
        """FSDP2's ``foreach_reduce`` for this group. The transport sums in fp32 (alpha folded) into a
        packed fp32 shard; a bf16/fp16 reduce dtype rounds that once to it (with two ranks exactly
        stock's ``a + b``), unless ``fp32_reduce`` keeps fp32. Then what FSDP2 does next, in the
        reduce output's dtype: HSDP partial sums and all-reduce, the hook, the post-divide, the cast
        to each parameter's gradient dtype and the accumulation."""
        with torch.profiler.record_function("TIDE::reduce_scatter"):
            return self._reduce(call)

    def _reduce(self, call: ReduceCall) -> ReduceOutcome:
        dh = self._device_handle
        fsdp_params, reduce_dtype, divide = call.fsdp_params, call.reduce_dtype, call.divide
        rs_stream, ar_stream, ar_group = call.reduce_scatter_stream, call.all_reduce_stream, call.all_reduce_group
        grads = autograd_grads = list(call.unsharded_grads)
        call.unsharded_grads.clear()  # FSDP2's list owns autograd's gradients
        mixed = len({g.dtype for g in grads}) > 1
        if mixed or (reduce_dtype != torch.float32 and not self.config.fp32_reduce):
            # FSDP2's copy-in casts every gradient to the reduce dtype: fp32 gradients under
            # reduce_dtype=bf16 are rounded before the sum, and so they are here. torch 2.15 also
            # hands over several dtypes (e.g. rms_norm's fp32 weight gradient next to bf16 ones whose
            # upcast it deferred), and the transport takes one. 16-bit gradients of an fp32 reduce
            # need no cast: the transport sums them in fp32 exactly as their upcast would be.
            # fp32_reduce keeps uniform gradients as they are.
            grads = [g if g.dtype == reduce_dtype else g.to(reduce_dtype) for g in grads]
        if divide.pre_divide not in (None, 1):
            # In place on the casts made above; autograd's own gradients are divided into new tensors.
            pre = divide.pre_divide
            grads = [g.div_(pre) if g is not mine else g / pre for g, mine in zip(grads, autograd_grads)]
        if fsdp_params == self.fsdp_params:
            layout = self.reduce_layout
        else:  # parameters without gradients this step are skipped (2.15: or reordered by dtype), as FSDP2 does
            shapes, dims = accessors.param_shapes(fsdp_params), accessors.shard_dims(fsdp_params)
            layout = GroupLayout.from_shapes(shapes, world_size=self.world_size, shard_dims=dims)
        output_dtype = torch.float32 if self.config.fp32_reduce else reduce_dtype
        current = dh.current_stream()

        # The transport reduces rank-blocked rows: a gradient sharded on dim k > 0 goes as its N
        # chunks along k one after another, (N, R_p, K_p) (a permuted view here, copied below).
        rows = list(grads)
        for p in range(layout.num_params):
            if layout.needs_reorder(p):
                N, R, K = layout.reorder_shape(p)
                rows[p] = grads[p].reshape(R, N, K).transpose(0, 1)
        slot_source = (
            self.config.mode == "slot_reuse"
            and self.landings is not None
            and not self.live  # resharded: the landing is vacated (not so with reshard_after_backward=False)
            and layout is self.layout
            and grads[0].dtype == self.ag_dtypes[0]
        )
        if slot_source:
            # Slot-Reuse: the vacated landing has the gradients' exact geometry. Copy them in
            # (rank-major where sharded on dim k > 0) and drop autograd's storage at once
            # (stream-ordered: later compute-stream allocations run after the copy); the slot's
            # next all-gather waits for the read. Autograd may
            # still hold the unsharded parameters built over the landing (a group's modules
            # backpropagated in several passes); like the all-gather, the copy keeps their
            # version counter, because FSDP2 re-gathers the group before they are read again.
            sources = [landing[: t.numel()].view(t.shape) for landing, t in zip(self.landings, rows)]
            with torch.autograd._unsafe_preserve_version_counter(tuple(self.landings)):
                torch._foreach_copy_(sources, rows)
            grads = autograd_grads = rows = None
            self.stats["slot_sources"] += 1
        else:
            sources = rows
        sources = [t.reshape(-1, t.shape[-1]) if layout.needs_reorder(p) else t for p, t in enumerate(sources)]
        # Accumulating straight into the existing sharded gradient only matches FSDP2 when the fp32
        # sum is the final gradient: not under HSDP (the replica all-reduce, or the partial-reduce
        # buffer, comes first), with an all-reduce hook (it sees this step's sum), a post-divide, or a
        # reduce dtype the sum is rounded to first.
        fused = None
        if (
            ar_group is None
            and call.all_reduce_hook is None
            and divide.post_divide in (None, 1)
            and output_dtype == torch.float32
        ):
            fused = self._fused_output(fsdp_params, layout, call.cast_dtypes)
        rs_stream.wait_stream(current)
        with dh.stream(rs_stream):
            out = (
                fused
                if fused is not None
                else torch.empty(layout.total_shard_numel, dtype=torch.float32, device=call.device)
            )
            timing = self._timing_start(rs_stream)
            work = self.transport.reduce_scatter(layout, sources, out, alpha=divide.alpha, accumulate=fused is not None)
            if work is not None:
                work.wait()
            # One rounding of the fp32 sum to the reduce dtype: with two ranks stock's a + b.
            reduce_output = out if out.dtype == output_dtype else out.to(output_dtype)
            self._timing_end("rs", timing, rs_stream)
            rs_event = rs_stream.record_event()
        if slot_source and self.slot is not None:
            self.ring.release_event[self.slot] = rs_event
        self.stats["reduce_scatters"] += 1
        self.stats["rs_bytes"] += layout.total_shard_numel * sources[0].element_size() * (self.world_size - 1)

        hold = _ReadHold(sources)
        post_stream = rs_stream
        all_reduce_input = all_reduce_event = hook_input = hook_event = None
        if ar_group is not None:  # HSDP: the shard-group output goes to FSDP2's replica all-reduce
            partial = call.partial_reduce_output
            with dh.stream(rs_stream):
                if not call.all_reduce_grads:
                    if partial is not None:
                        partial += reduce_output
                    else:
                        partial = reduce_output
                    event = post_stream.record_event()
                    return ReduceOutcome(hold, rs_event, post_stream, event, None, None, partial, None, None)
                if partial is not None:
                    reduce_output += partial
            post_stream = ar_stream
            ar_stream.wait_stream(rs_stream)
            with dh.stream(ar_stream):
                dist.all_reduce(reduce_output, group=ar_group, op=divide.all_reduce_op)
                all_reduce_input = reduce_output
                all_reduce_event = ar_stream.record_event()
        if call.all_reduce_hook is not None:
            post_stream = ar_stream
            ar_stream.wait_stream(rs_stream)
            with dh.stream(ar_stream):
                call.all_reduce_hook(reduce_output)
                hook_input, hook_event = reduce_output, ar_stream.record_event()

        with dh.stream(post_stream):
            if divide.post_divide not in (None, 1):
                reduce_output.div_(divide.post_divide)
            offsets = [layout.shard_elem_offset(p) for p in range(layout.num_params)]
            set_sharded_grads(fsdp_params, reduce_output, offsets, call.cast_dtypes, accumulated=fused is not None)
            post_reduce_event = post_stream.record_event()
        return ReduceOutcome(
            hold,
            rs_event,
            post_stream,
            post_reduce_event,
            all_reduce_input,
            all_reduce_event,
            None,
            hook_input,
            hook_event,
        )

    def _fused_output(self, fsdp_params, layout: GroupLayout, cast_dtypes):
        """The packed fp32 buffer all existing sharded grads are views of, in layout order, or None."""
        if any(dtype not in (None, torch.float32) for dtype in cast_dtypes):
            return None
        offsets = [layout.shard_elem_offset(p) for p in range(layout.num_params)]
        return accessors.packed_sharded_grad_base(fsdp_params, offsets, layout.total_shard_numel)
