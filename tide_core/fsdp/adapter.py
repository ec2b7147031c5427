"""``tide_core.install(model)``: serve every FSDP2 parameter group inside ``model`` with TIDE.

    handle = tide_core.install(model, mode="in_place", transport="auto")   # after fully_shard
    print(handle.report())
    tide_core.uninstall(model)

FSDP2's collectives are routed to TIDE for served groups and to stock for everything else by
``tide_core.fsdp.dispatch``; FSDP2's private names are touched only in this package (``profiles``:
per torch version, docs/torch-accessors.md; ``accessors``: what is read; ``landing``: what is written).
Groups outside the contract
fall back to stock collectives with a logged reason; ranks that disagree on the configuration or
the groups abort on every rank with a message naming the difference. Installing twice is a no-op.
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from tide_core.config import TIDEConfig
from tide_core.errors import RankMismatchError, TIDEError
from tide_core.fsdp import accessors, dispatch
from tide_core.fsdp.group import ReorderBuffer, ServedGroup, SlotRing
from tide_core.fsdp.landing import mark_served, unmark_served
from tide_core.fsdp.profiles import probe
from tide_core.plan import Topology, backward_live_bytes
from tide_core.plan.report import fmt_bytes
from tide_core.runtime.groups import check_agreement, handshake, point_to_point_unavailable_reason
from tide_core.transport import make_transport
from tide_core.transport.availability import warn_if_cuda_transport_missing

log = logging.getLogger("tide")

#: Parameter and gradient dtypes TIDE serves (gradients are summed in fp32).
SERVED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: What else a group may all-gather (moved as bytes; never reduced): frozen integer or fp64 parameters,
#: and the float8 data of all-gather extensions (torchao's float8 all-gather).
GATHERED_ONLY_DTYPES = (
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
)

_HANDLE_ATTR = "_tide_handle"


@dataclass
class GroupEntry:
    index: int
    name: str
    num_params: int
    shard_bytes: int
    dtype: str  # the all-gather dtype, or the dtypes joined by "+" when parameters differ
    served: ServedGroup | None
    install_reason: str | None  # why install left the group on stock collectives
    trainable: bool = True  # has a parameter that requires a gradient (else nothing is reduced)
    shard_dims_note: str | None = None  # parameters sharded on a dim other than 0, e.g. "Shard(1): 3 params"
    setup: str = ""  # how FSDP2 set the group up (accessors.setup_notes): its mesh dims, ...
    extension_inputs: list | None = None  # per parameter: its all-gather extension's inputs, or None

    @property
    def active(self) -> bool:
        """Served by TIDE now (a served group can hand itself back to stock collectives later)."""
        return self.served is not None and self.served.fallback_reason is None

    @property
    def reason(self) -> str | None:
        """Why the group is on stock collectives now (None while TIDE serves it)."""
        if self.served is not None:
            return self.served.fallback_reason
        return self.install_reason


class TIDEHandle:
    """Returned by ``install``: what is served, how, and what it costs."""

    def __init__(
        self, model: nn.Module, config: TIDEConfig, internals, entries: list[GroupEntry], transports: dict, rings: dict
    ):
        self.model = model
        self.config = config
        self.internals = internals
        self.entries = entries
        self.transports = transports
        self.rings = rings

    @property
    def served_groups(self) -> list[ServedGroup]:
        return [e.served for e in self.entries if e.active]

    @property
    def fallback_groups(self) -> list[GroupEntry]:
        return [e for e in self.entries if not e.active]

    def stats(self) -> dict:
        """Cumulative counters over served groups (calls and bytes sent by this rank)."""
        total = {"all_gathers": 0, "reduce_scatters": 0, "ag_bytes": 0, "rs_bytes": 0, "slot_sources": 0}
        for g in self.served_groups:
            for k in total:
                total[k] += g.stats[k]
        return total

    def collect_timings(self) -> dict[str, float]:
        """AG/RS milliseconds since the last call, summed over groups (needs TIDEConfig.profile on CUDA)."""
        totals = {"ag_ms": 0.0, "rs_ms": 0.0}
        for g in self.served_groups:
            for k, v in g.collect_timings().items():
                totals[k] += v
        return totals

    def memory(self) -> dict:
        """Bytes per component on this GPU: TIDE's arena and staging against the memory model."""
        arena = sum(t.arena.reserved_bytes for t in self.transports.values())
        staging = sum(t.staging_bytes for t in self.transports.values())
        by_kind: dict[str, tuple[int, int]] = {}
        for t in self.transports.values():
            for kind, (count, nbytes) in t.arena.bytes_by_kind().items():
                have = by_kind.get(kind, (0, 0))
                by_kind[kind] = (have[0] + count, have[1] + nbytes)
        out = {
            "arena_reserved": arena,
            "transport_staging": staging,
            "transports": len(self.transports),
            "arena_by_kind": by_kind,
        }
        served = self.served_groups
        if served:
            largest = max(served, key=lambda g: g.layout.total_shard_bytes)
            topo = largest.transport.topology
            for mode in ("stock", self.config.mode):
                # On one node the staging is the transport's chunk ring, not the multi-node bound.
                staging = largest.transport.staging_bytes if topo.nodes == 1 and mode != "stock" else None
                live = backward_live_bytes(
                    mode,
                    nodes=topo.nodes,
                    gpus_per_node=topo.gpus_per_node,
                    shard_bytes=largest.layout.total_shard_bytes,
                    staging_bytes=staging,
                )
                out[f"model_{mode}"] = live.components | {"total": live.total}
            out["largest_group"] = largest.name
        return out

    def report(self) -> str:
        if not self.config.enabled:  # nothing is patched: one line, not one per group
            return (
                f"TIDE is switched off (enabled=False): stock FSDP2 collectives run for all "
                f"{len(self.entries)} FSDP2 parameter group(s)"
            )
        served = self.served_groups
        lines = [
            f"TIDE {self.config.mode} on {len(self.entries)} FSDP2 parameter group(s): {len(served)} served, "
            f"{len(self.entries) - len(served)} on stock collectives",
        ]
        for t in self.transports.values():
            summary, *details = t.describe()
            lines += [f"  transport: {summary}"] + [f"    {line}" for line in details]
        name_width = max([5] + [len(e.name) for e in self.entries])
        dtype_width = max([5] + [len(e.dtype) for e in self.entries])
        setup_width = max([5] + [len(e.setup) for e in self.entries])
        lines.append(
            f"  {'#':>3} {'group':<{name_width}} {'P':>4} {'S/rank':>11} {'dtype':<{dtype_width}} "
            f"{'setup':<{setup_width}} status"
        )
        for e in self.entries:
            if e.active:
                status = f"TIDE, {e.served.placement}"
                post_forward = accessors.post_forward_group_size(e.served.param_group)
                if post_forward is not None:
                    status += f"; reshards to {post_forward} ranks after forward"
                if not e.trainable:
                    status += "; all-gather only (no trainable parameter, nothing to reduce)"
                if e.served.extensions:
                    status += f"; all-gather extension: {', '.join(e.served.extensions)}"
            else:
                status = f"stock: {e.reason}"
            if e.shard_dims_note:
                status += f"; {e.shard_dims_note}"
            lines.append(
                f"  {e.index:>3} {e.name:<{name_width}} {e.num_params:>4} {fmt_bytes(e.shard_bytes):>11} "
                f"{e.dtype:<{dtype_width}} {e.setup:<{setup_width}} {status}"
            )
        mem = self.memory()
        lines.append(
            f"  memory: arena reserved {fmt_bytes(mem['arena_reserved'])} in {mem['transports']} transport(s) "
            "("
            + ", ".join(
                f"{kind} {fmt_bytes(nbytes)}" + (f" in {count}" if count > 1 else "")
                for kind, (count, nbytes) in sorted(mem["arena_by_kind"].items(), key=lambda kv: -kv[1][1])
            )
            + f"), transport staging {fmt_bytes(mem['transport_staging'])}"
        )
        unbound = sum(1 for g in served if g.landings is None)
        if unbound:
            # At install no group has gathered yet: the arena holds only the signal words so far.
            lines[-1] += (
                f"; {unbound} group(s) not yet gathered: their ring slots or landings come at the first all-gather"
            )
        if "largest_group" in mem:
            for key in ("model_stock", f"model_{self.config.mode}"):
                parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mem[key].items())
                lines.append(f"  model ({key[6:]}, largest group {mem['largest_group']}): {parts}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        served, fallback = len(self.served_groups), len(self.fallback_groups)
        return f"TIDEHandle(mode={self.config.mode!r}, served={served}, fallback={fallback})"


# -- group discovery and eligibility ------------------------------------------------------------


def _ring_eligible(param_group, module: nn.Module, fsdp_modules: list[nn.Module]) -> bool:
    """Leaf groups that reshard after forward share the 2-slot ring. Roots (live through the whole
    step), groups with FSDP2 children (live while their children run), groups of several modules
    (``fully_shard([a, b])``: live from a's forward to b's, e.g. tied embedding and output around
    every layer) and groups kept unsharded after forward get dedicated landings."""
    if not accessors.reshards_after_forward(param_group) or accessors.module_count(param_group) > 1:
        return False
    has_child = any(other is not module and any(m is other for m in module.modules()) for other in fsdp_modules)
    has_parent = any(other is not module and any(m is module for m in other.modules()) for other in fsdp_modules)
    return has_parent and not has_child


def _ineligible(param_group, config: TIDEConfig, names: dict[int, str]) -> str | None:
    """Why a group cannot be served (None: it can). ``names``: id(sharded parameter) -> its name."""
    num_params = len(accessors.fsdp_params(param_group))
    if num_params > config.max_params:
        return f"{num_params} parameters > max_params={config.max_params}"
    reason = accessors.ineligible(param_group, names)
    if reason is not None:
        return reason
    for dtype in sorted(set(accessors.all_gather_dtypes(param_group)), key=str):
        if dtype not in SERVED_DTYPES + GATHERED_ONLY_DTYPES:
            return f"unsupported dtype {dtype}"
    ranks = accessors.shard_process_group(param_group).size()
    if ranks == 1:
        return "shard group has one rank: nothing to gather"
    reduce_dtype = accessors.reduce_dtype(param_group)  # None: nothing is reduced
    if reduce_dtype is not None and reduce_dtype not in SERVED_DTYPES:
        return f"unsupported reduce dtype {reduce_dtype}"
    if reduce_dtype in (torch.bfloat16, torch.float16) and config.exact_stock_sums and ranks > 2:
        return (
            f"FSDP2 reduces gradients in {reduce_dtype} over {ranks} ranks and exact_stock_sums=True keeps "
            "stock's rounding (TIDE rounds its fp32 sum once; with two ranks that is stock's result)"
        )
    return point_to_point_unavailable_reason(accessors.shard_process_group(param_group))


def _check_shard_bytes_agree(entries: list[GroupEntry], param_groups: list, config: TIDEConfig) -> None:
    """Abort on every rank unless the ranks of each shard group hold the same shard bytes for every
    group TIDE is to serve (the layout their transport shares). Only within a shard group:
    tensor-parallel ranks legitimately hold different local shapes (a dim that does not divide by
    the tensor-parallel size). Called after the world-wide agreement, so every rank runs the same
    sequence of shard-group checks; a second world-wide agreement makes a mismatch inside one
    shard group an error on every rank."""
    per_group: dict[int, tuple] = {}  # id(shard process group) -> (process group, description)
    for e, param_group in zip(entries, param_groups):
        if e.install_reason is None:
            process_group = accessors.shard_process_group(param_group)
            _, description = per_group.setdefault(id(process_group), (process_group, {}))
            description[f"group {e.index} ({e.name}) shard bytes"] = e.shard_bytes
    problems = []
    for process_group, description in per_group.values():
        what = f"tide_core.install (shard group of ranks {dist.get_process_group_ranks(process_group)})"
        try:
            check_agreement(description, process_group, what, config.timeout_s)
        except RankMismatchError as exc:
            problems.append(str(exc))
    outcome = "; ".join(problems) or "agree"
    check_agreement({"shard bytes in this rank's shard group": outcome}, None, "tide_core.install", config.timeout_s)
    if problems:  # every rank found the same mismatch (its shard group is the world)
        raise RankMismatchError(outcome)


def _plan_extensions(entries: list[GroupEntry], param_groups: list, names: dict[int, str], timeout_s) -> None:
    """What the served groups' all-gather extensions gather, known only from their
    ``fsdp_pre_all_gather``: one call per such parameter now (after the ranks agreed on the groups,
    since it may be collective: torchao reduces the amax over the shard group) plans every input's
    landing, and the ranks agree on the result. Each all-gather checks its inputs against this plan
    (other inputs before the group's first all-gather: stock collectives; after: an error)."""
    planned = []
    for entry, param_group in zip(entries, param_groups):
        fsdp_params = accessors.fsdp_params(param_group)
        if entry.install_reason is not None or not any(accessors.has_all_gather_extension(fp) for fp in fsdp_params):
            continue
        planned.append(entry)
        inputs, reason = [], None
        for fp in fsdp_params:
            if not accessors.has_all_gather_extension(fp):
                inputs.append(None)
                continue
            name = names.get(id(fp.sharded_param), "?")
            if fp.fsdp_placement.dim != 0 or accessors.post_forward_process_group(param_group) is not None:
                # Each input lands as one rank-blocked entry: no reorder, no post-forward layout.
                reason = f"parameter {name}: an all-gather extension with Shard(dim != 0) or reshard_after_forward=int"
                break
            try:
                with torch.no_grad():
                    specs = accessors.extension_input_sizes(fp)
            except Exception as exc:  # an extension's own error, named in the fallback reason
                reason = f"parameter {name}: fsdp_pre_all_gather failed at install: {type(exc).__name__}: {exc}"
                break
            bad = sorted({str(d) for _, d in specs if d not in SERVED_DTYPES + GATHERED_ONLY_DTYPES})
            if not specs or bad or any(math.prod(size) == 0 for size, _ in specs):
                what = f"unsupported dtype {', '.join(bad)}" if bad else "no or empty all-gather inputs"
                reason = f"parameter {name}: all-gather extension with {what}"
                break
            inputs.append(specs)
        entry.install_reason, entry.extension_inputs = reason, inputs if reason is None else None
        if reason is None:  # the report shows what is moved
            moved = []
            for numel, dtype, specs in zip(
                accessors.padded_shard_numels(param_group), accessors.all_gather_dtypes(param_group), inputs
            ):
                moved += [(numel, dtype)] if specs is None else [(math.prod(size), d) for size, d in specs]
            dtypes = [d for _, d in moved]
            entry.dtype = "+".join(str(d).replace("torch.", "") for d in sorted(set(dtypes), key=dtypes.index))
            entry.shard_bytes = sum(numel * d.itemsize for numel, d in moved)
    if planned and dist.get_world_size() > 1:
        description = {
            f"group {e.index} ({e.name})": (e.dtype, e.shard_bytes, e.reason, repr(e.extension_inputs)) for e in planned
        }
        check_agreement(description, None, "tide_core.install (all-gather extensions)", timeout_s)


def _topology(process_group, config: TIDEConfig, hosts: list[str]) -> tuple[Topology | None, str | None]:
    size = process_group.size()
    if config.gpus_per_node is not None:
        if size % config.gpus_per_node:
            return None, f"gpus_per_node={config.gpus_per_node} does not divide the shard group size {size}"
        return Topology.from_world_size(size, config.gpus_per_node), None
    ranks = dist.get_process_group_ranks(process_group)
    names = [hosts[r] for r in ranks]
    L = names.count(names[0])
    if size % L or any(names[i] != names[(i // L) * L] for i in range(size)) or len(set(names)) != size // L:
        return None, "shard-group ranks are not node-major (L consecutive ranks per host); set TIDE_GPUS_PER_NODE"
    return Topology.from_world_size(size, L), None


def _post_forward_topology(param_group, topo: Topology, config: TIDEConfig) -> tuple[Topology | None, str | None]:
    """The topology of the group's post-forward process group (``reshard_after_forward=k``), else
    why it cannot be served. FSDP2 cuts the shard mesh into rows of k ranks, so the post-forward
    group is k consecutive ranks of the shard group: part of one node where k divides the node's
    L ranks, whole nodes where L divides k (the reference transport only: the CUDA transport lands
    the post-forward all-gather in the shard group's arena, which node-local groups can)."""
    group = accessors.post_forward_process_group(param_group)
    k, L = group.size(), topo.gpus_per_node
    if any(dim for dim in accessors.shard_dims(accessors.fsdp_params(param_group))):
        return None, f"reshard_after_forward={k} with parameters sharded on a dim other than 0"
    shard_ranks = dist.get_process_group_ranks(accessors.shard_process_group(param_group))
    ranks = dist.get_process_group_ranks(group)
    first = shard_ranks.index(ranks[0]) if ranks[0] in shard_ranks else -1
    if first < 0 or first % k or shard_ranks[first : first + k] != ranks:
        return None, f"reshard_after_forward={k}: the post-forward group {ranks} is not a row of the shard group"
    if L % k == 0:
        return Topology.from_world_size(k, k), None
    if k % L == 0:
        if accessors.param_group_device(param_group).type == "cuda" and config.transport != "reference":
            return None, (
                f"reshard_after_forward={k} spans nodes of {L} ranks: the CUDA transport lands a "
                "post-forward group's all-gather in the shard group's arena only where the group is "
                "node-local (k dividing the node's ranks); over whole nodes its rail exchanges through "
                "an arena of its own (transport='reference' serves it)"
            )
        return Topology.from_world_size(k, L), None
    return None, f"reshard_after_forward={k} splits nodes of {L} ranks (node-local or whole nodes are served)"


# -- install / uninstall --------------------------------------------------------------------------


def install(
    model: nn.Module,
    mode: str | None = None,
    transport: str | None = None,
    *,
    config: TIDEConfig | None = None,
    **options,
) -> TIDEHandle:
    """Serve every FSDP2 parameter group inside ``model`` with TIDE. Call after ``fully_shard``
    on every rank (it is collective), before the first forward. Returns the handle; a second
    call on the same model returns the existing handle."""
    existing = model.__dict__.get(_HANDLE_ATTR)
    if existing is not None:
        return existing
    config = TIDEConfig.from_env(config, mode=mode, transport=transport, **options)
    with torch.profiler.record_function("TIDE::install"):
        return _install(model, config)


def _install(model: nn.Module, config: TIDEConfig) -> TIDEHandle:
    if accessors.inside_functorch_transform():
        raise TIDEError(
            "tide_core.install was called inside a torch.func transform (jvp, vmap, grad), e.g. from a "
            "model's first forward run under torch.func.jvp: install exchanges tensors between ranks, "
            "which a transform's wrapped tensors cannot do. Call tide_core.install(model) on every rank "
            "after fully_shard and before the transformed call"
        )
    if not dist.is_initialized():
        raise TIDEError("tide_core.install needs torch.distributed to be initialized (it is collective)")
    if not any(_is_fsdp(m) for m in model.modules()):
        raise TIDEError("model has no FSDP2 module: call fully_shard(...) before tide_core.install(model)")
    # Every rank must be here before the first collective: one that skipped install or runs another
    # collective meets a named error, not a size mismatch that aborts the process inside gloo.
    if dist.get_world_size() > 1:
        handshake("tide_core.install", None, config.timeout_s)
    found = accessors.fsdp_param_groups(model)
    # Switched off: every group is reported on stock collectives and nothing is patched.
    internals, unsupported = probe() if config.enabled else (None, "TIDE is switched off (enabled=False)")
    if config.enabled:
        warn_if_cuda_transport_missing(config.transport)

    hosts: list = [socket.gethostname()] * dist.get_world_size()
    if dist.get_world_size() > 1:  # one process: nothing to agree on, no collective issued
        dist.all_gather_object(hosts, socket.gethostname())
    fsdp_modules = [m for _, _, m in found]
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    entries, plans = [], []
    for index, (name, param_group, module) in enumerate(found):
        dtypes = accessors.all_gather_dtypes(param_group)
        shard_bytes = sum(n * d.itemsize for n, d in zip(accessors.padded_shard_numels(param_group), dtypes))
        reason = unsupported or _ineligible(param_group, config, names)
        topo = post_forward_topo = None
        if reason is None:
            topo, reason = _topology(accessors.shard_process_group(param_group), config, hosts)
        if reason is None and accessors.post_forward_process_group(param_group) is not None:
            post_forward_topo, reason = _post_forward_topology(param_group, topo, config)
        dtype = "+".join(str(d).replace("torch.", "") for d in sorted(set(dtypes), key=dtypes.index))
        entries.append(
            GroupEntry(
                index,
                name,
                len(dtypes),
                shard_bytes,
                dtype,
                None,
                reason,
                trainable=bool(accessors.trainable_params(param_group)),
                shard_dims_note=accessors.shard_dims_note(param_group),
                setup="; ".join(accessors.setup_notes(param_group)),
            )
        )
        ring_ok = config.ring and _ring_eligible(param_group, module, fsdp_modules)
        plans.append((param_group, topo, post_forward_topo, ring_ok))

    description = {
        "torch": torch.__version__,
        **{f"config.{k}": v for k, v in config.describe().items()},
        **{f"group {e.index} ({e.name})": (e.num_params, e.dtype, e.reason, e.shard_dims_note) for e in entries},
    }
    if dist.get_world_size() > 1:
        check_agreement(description, None, "tide_core.install", config.timeout_s)
        _check_shard_bytes_agree(entries, [plan[0] for plan in plans], config)
    _plan_extensions(entries, [plan[0] for plan in plans], names, config.timeout_s)

    transports: dict = {}
    rings: dict = {}
    handle = TIDEHandle(model, config, internals, entries, transports, rings)
    ring_members: dict = {}
    reorder_members: dict = {}
    for entry, (param_group, topo, post_forward_topo, ring_ok) in zip(entries, plans):
        if entry.install_reason is not None:
            continue
        # One transport per (ranks, topology); a group that reshards to a smaller group after
        # forward (reshard_after_forward=int) also gets one over that group. Keyed by the ranks, not
        # the process group object: FSDP2 may build a new group of the same ranks per fully_shard
        # call (its default mesh over gloo, every post-forward group), and a transport per group
        # would give each block its own arena, ring and staging.
        wanted = [(accessors.shard_process_group(param_group), topo)]
        if post_forward_topo is not None:
            wanted.append((accessors.post_forward_process_group(param_group), post_forward_topo))
        keys = [(tuple(dist.get_process_group_ranks(process_group)), t) for process_group, t in wanted]
        try:
            for key, (process_group, t) in zip(keys, wanted):
                if key not in transports:
                    single_host = len({hosts[r] for r in dist.get_process_group_ranks(process_group)}) == 1
                    transports[key] = make_transport(
                        config.transport,
                        t,
                        process_group,
                        device=accessors.param_group_device(param_group),
                        options=config.cuda_options(),
                        validate_calls=config.validate_calls,
                        single_host=single_host,
                    )
            if len(keys) > 1:
                # The post-forward all-gather lands in the landings the shard group's transport
                # allocated: its rank j is shard-group rank keys[0][0].index(global rank).
                shard_ranks, post_forward_ranks = keys[0][0], keys[1][0]
                transports[keys[1]].add_landing_arena(
                    transports[keys[0]].arena, [shard_ranks.index(r) for r in post_forward_ranks]
                )
        except TIDEError as exc:
            if config.transport == "cuda":  # asked for by name: not met is an error, not a fallback
                for served in entries:  # leave the model as install found it
                    if served.served:
                        unmark_served(served.served.param_group)
                for transport in transports.values():
                    transport.close()
                raise TIDEError(
                    f"group {entry.index} ({entry.name}): {exc} (transport='auto' keeps stock "
                    "collectives where the CUDA transport cannot serve)"
                ) from exc
            entry.install_reason = f"transport unavailable: {exc}"
            continue
        key = keys[0]
        post_forward_transport = transports[keys[1]] if len(keys) > 1 else None
        group = ServedGroup(
            config,
            entry.index,
            entry.name,
            param_group,
            transports[key],
            None,
            post_forward_transport,
            extension_inputs=entry.extension_inputs,
        )
        if ring_ok:
            ring_members.setdefault(key, []).append(group)
        if group.layout.reorder_bytes:
            reorder_members.setdefault(key, []).append(group)
        mark_served(param_group, group, copy_out_hook=internals is not None and internals.profile.copy_out_hook)
        entry.served = group
    for key, members in ring_members.items():
        # Both ring slots are sized for the largest ring group on this transport.
        rings[key] = SlotRing(
            transport=transports[key], slot_bytes=max(g.layout.group_bytes for g in members), members=members
        )
        for g in members:
            g.ring = rings[key]
    for key, members in reorder_members.items():
        # One reorder buffer per transport, for its largest group (see ReorderBuffer).
        shared = ReorderBuffer(transports[key], max(g.layout.reorder_bytes for g in members))
        for g in members:
            g.reorder = shared

    if internals is not None:
        dispatch.patch(internals, id(handle))
    model.__dict__[_HANDLE_ATTR] = handle
    if dist.get_rank() == 0:
        for e in entries:
            if e.served is None and config.enabled:  # switched off: the report's one line says so
                log.warning("TIDE: group %d (%s) runs stock collectives: %s", e.index, e.name, e.reason)
        log.info("%s", handle.report())
    return handle


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def uninstall(model: nn.Module) -> None:
    """Return every served group to stock FSDP2 (between steps, on every rank)."""
    handle = model.__dict__.get(_HANDLE_ATTR)
    if handle is None:
        return
    live = [g.name for g in handle.served_groups if g.unsharded]
    if live:  # checked before anything is undone: the model stays fully served
        raise TIDEError(
            f"cannot uninstall TIDE while group(s) {', '.join(live)} are unsharded (e.g. after a "
            "forward under torch.no_grad(), where FSDP2 keeps the root unsharded): call "
            "model.reshard() first, or uninstall between training steps"
        )
    for group in handle.served_groups:
        group.unbind()
    if handle.internals is not None:
        dispatch.unpatch(handle.internals, id(handle))
    del model.__dict__[_HANDLE_ATTR]


def get_handle(model: nn.Module) -> TIDEHandle | None:
    return model.__dict__.get(_HANDLE_ATTR)
