"""``tide_core.install(model)``: serve every FSDP2 parameter group inside ``model`` with TIDE.

    handle = tide_core.install(model, mode="in_place", transport="auto")   # after fully_shard
    print(handle.report())
    tide_core.uninstall(model)

FSDP2's ``foreach_all_gather``, ``foreach_all_gather_copy_out`` and ``foreach_reduce`` are
replaced (in ``_fsdp_param_group``'s namespace, where FSDP2 looks them up) by dispatchers that
route served groups to TIDE and everything else to the originals. Groups outside the contract
fall back to stock collectives with a logged reason; ranks that disagree on the configuration or
the groups abort on every rank with a message naming the difference. Installing twice is a no-op.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from tide_core.config import TIDEConfig
from tide_core.errors import TIDEError
from tide_core.fsdp import compat
from tide_core.fsdp.group import SlotRing, TideGroup
from tide_core.plan import Topology, backward_live_bytes
from tide_core.plan.report import fmt_bytes
from tide_core.runtime.groups import check_agreement, point_to_point_unavailable_reason
from tide_core.transport import make_transport

log = logging.getLogger("tide")

_HANDLE_ATTR = "_tide_handle"
_PATCH_USERS: set[int] = set()


@dataclass
class GroupEntry:
    index: int
    name: str
    num_params: int
    shard_bytes: int
    dtype: str
    served: "TideGroup | None"
    reason: str | None


class TIDEHandle:
    """Returned by ``install``: what is served, how, and what it costs."""

    def __init__(self, model: nn.Module, config: TIDEConfig, internals, entries: list[GroupEntry], transports: dict,
                 rings: dict):
        self.model = model
        self.config = config
        self.internals = internals
        self.entries = entries
        self.transports = transports
        self.rings = rings

    @property
    def served_groups(self) -> list[TideGroup]:
        return [e.served for e in self.entries if e.served is not None]

    @property
    def fallback_groups(self) -> list[GroupEntry]:
        return [e for e in self.entries if e.served is None]

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
        out = {"arena_reserved": arena, "transport_staging": staging}
        served = self.served_groups
        if served:
            largest = max(served, key=lambda g: g.layout.total_shard_bytes)
            topo = largest.transport.topology
            for mode in ("stock", self.config.mode):
                # On one node the staging is the transport's chunk ring, not the multi-node bound.
                staging = largest.transport.staging_bytes if topo.nodes == 1 and mode != "stock" else None
                live = backward_live_bytes(mode, nodes=topo.nodes, gpus_per_node=topo.gpus_per_node,
                                           shard_bytes=largest.layout.total_shard_bytes, staging_bytes=staging)
                out[f"model_{mode}"] = live.components | {"total": live.total}
            out["largest_group"] = largest.name
        return out

    def report(self) -> str:
        served = self.served_groups
        lines = [
            f"TIDE {self.config.mode} on {len(self.entries)} FSDP2 parameter group(s): {len(served)} served, "
            f"{len(self.entries) - len(served)} on stock collectives",
        ]
        for t in self.transports.values():
            topo = t.topology
            device = "GPU(s)" if t.device.type == "cuda" else f"{t.device.type} process(es)"
            lines.append(f"  transport: {t.name} ({topo.nodes} node(s) x {topo.gpus_per_node} {device})")
            if getattr(t, "rail", None) is not None:
                lines.append(f"    {t.rail.name} rail; reduce-scatter Level 2 in {len(t.waves.waves)} Latin-square "
                             f"wave(s) of width {t.waves.wave_width}")
        lines.append(f"  {'#':>3} {'group':<32} {'P':>4} {'S/rank':>11} {'dtype':<9} status")
        for e in self.entries:
            status = f"TIDE, {e.served.placement}" if e.served else f"stock: {e.reason}"
            lines.append(f"  {e.index:>3} {e.name[:32]:<32} {e.num_params:>4} {fmt_bytes(e.shard_bytes):>11} {e.dtype:<9} {status}")
        mem = self.memory()
        lines.append(f"  memory: arena reserved {fmt_bytes(mem['arena_reserved'])}, "
                     f"transport staging {fmt_bytes(mem['transport_staging'])}")
        if "largest_group" in mem:
            for key in ("model_stock", f"model_{self.config.mode}"):
                parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mem[key].items())
                lines.append(f"  model ({key[6:]}, largest group {mem['largest_group']}): {parts}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TIDEHandle(mode={self.config.mode!r}, served={len(self.served_groups)}, fallback={len(self.fallback_groups)})"


# -- dispatchers -------------------------------------------------------------------------------


def _served(fsdp_params) -> TideGroup | None:
    if not fsdp_params:
        return None
    group = fsdp_params[0].__dict__.get("_tide_group")
    if group is None or any(fp.__dict__.get("_tide_group") is not group for fp in fsdp_params):
        return None
    return group


def _make_dispatchers(internals) -> dict:
    orig = internals.originals

    @functools.wraps(orig["foreach_all_gather"])
    def foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device,
                           all_gather_comm):
        served = _served(fsdp_params)
        if served is not None and served.stock_gradient_pending():
            served.fall_back("an unreduced gradient from steps on stock collectives (installed after an unshard)")
            served = None
        if served is None or served.fsdp_params != list(fsdp_params):
            return orig["foreach_all_gather"](fsdp_params, group, async_op, all_gather_copy_in_stream,
                                              all_gather_stream, device, all_gather_comm)
        with torch.no_grad():
            return served.all_gather(async_op, all_gather_copy_in_stream, all_gather_stream)

    @functools.wraps(orig["foreach_all_gather_copy_out"])
    def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
        if _served(fsdp_params) is None or not hasattr(all_gather_result.all_gather_output, "_tide_inputs"):
            return orig["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group)
        return TideGroup.copy_out(all_gather_result)

    @functools.wraps(orig["foreach_reduce"])
    def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                       reduce_scatter_comm, orig_dtype, reduce_dtype, device, gradient_divide_factor,
                       all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output,
                       all_reduce_hook, force_sum_reduction_for_comms=False):
        served = _served(fsdp_params)
        args = (fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream, reduce_scatter_comm,
                orig_dtype, reduce_dtype, device, gradient_divide_factor, all_reduce_group, all_reduce_stream,
                all_reduce_grads, partial_reduce_output, all_reduce_hook, force_sum_reduction_for_comms)
        if served is None or reduce_scatter_group is None or any(fp.fsdp_placement.dim != 0 for fp in fsdp_params):
            return orig["foreach_reduce"](*args)
        with torch.no_grad():
            return served.reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                                 orig_dtype, reduce_dtype, device, gradient_divide_factor, all_reduce_group,
                                 all_reduce_stream, all_reduce_grads, partial_reduce_output, all_reduce_hook,
                                 force_sum_reduction_for_comms)

    for fn, name in ((foreach_all_gather, "foreach_all_gather"), (foreach_all_gather_copy_out, "foreach_all_gather_copy_out"),
                     (foreach_reduce, "foreach_reduce")):
        fn.__tide_original__ = orig[name]
    return {"foreach_all_gather": foreach_all_gather, "foreach_all_gather_copy_out": foreach_all_gather_copy_out,
            "foreach_reduce": foreach_reduce}


def _patch(internals, owner: int) -> None:
    module = internals.param_group_module
    if not _PATCH_USERS:
        for name, fn in _make_dispatchers(internals).items():
            setattr(module, name, fn)
    _PATCH_USERS.add(owner)


def _unpatch(internals, owner: int) -> None:
    _PATCH_USERS.discard(owner)
    if not _PATCH_USERS:
        for name, fn in internals.originals.items():
            setattr(internals.param_group_module, name, fn)


# -- group discovery and eligibility ------------------------------------------------------------


def _fsdp_groups(model: nn.Module) -> list[tuple[str, object, nn.Module]]:
    found, seen = [], set()
    for fqn, module in model.named_modules():
        if not _is_fsdp(module):
            continue
        for pg in compat.param_groups(module._get_fsdp_state()):
            if pg is None or id(pg) in seen or not pg.fsdp_params:
                continue
            seen.add(id(pg))
            found.append((fqn or "<root>", pg, module))
    return found


def _ring_eligible(pg, module: nn.Module, fsdp_modules: list[nn.Module]) -> bool:
    """Leaf groups that reshard after forward share the 2-slot ring. Roots (live through the whole
    step), groups with FSDP2 children (live while their children run), groups of several modules
    (``fully_shard([a, b])``: live from a's forward to b's, e.g. tied embedding and output around
    every layer) and groups kept unsharded after forward get dedicated landings."""
    if getattr(pg, "post_forward_mesh_info", None) is None or len(getattr(pg, "modules", ())) > 1:
        return False
    has_child = any(other is not module and any(m is other for m in module.modules()) for other in fsdp_modules)
    has_parent = any(other is not module and any(m is module for m in other.modules()) for other in fsdp_modules)
    return has_parent and not has_child


def _reduce_dtype(pg) -> torch.dtype:
    """The dtype stock FSDP2 reduce-scatters this group's gradients in: MixedPrecisionPolicy's
    reduce_dtype, else the gradients' own dtype (param_dtype, else the parameters')."""
    policy = getattr(pg, "mp_policy", None)
    grad_dtype = getattr(policy, "param_dtype", None) or pg.fsdp_params[0].sharded_param.dtype
    return getattr(policy, "reduce_dtype", None) or grad_dtype


def _ineligible(pg, config: TIDEConfig, names: dict[int, str]) -> str | None:
    """Why a group cannot be served (None: it can). ``names``: id(sharded parameter) -> its name."""
    params = pg.fsdp_params
    if len(params) > config.max_params:
        return f"{len(params)} parameters > max_params={config.max_params}"
    for fp in params:
        name = names.get(id(fp.sharded_param), "?")
        missing = [a for a in compat.FSDP_PARAM_ATTRIBUTES if not hasattr(fp, a)]
        if missing:
            return f"unknown torch internal: FSDPParam lacks {missing}"
        if fp.fsdp_placement.dim != 0:
            return f"parameter {name} is sharded on dim {fp.fsdp_placement.dim} (TIDE needs dim 0)"
        if math.prod(fp._orig_size) == 0:
            return f"parameter {name} has no elements"
        if fp.offload_to_cpu:
            return "CPU offload"
        if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            return f"parameter {name} uses an all-gather extension (fsdp_pre_all_gather)"
        if getattr(fp, "_unsharded_dtensor_spec", None) is not None or getattr(fp, "_tp_spec", None) is not None:
            return f"parameter {name} is also tensor-parallel (a DTensor on a 2-D+ mesh)"
    dtypes = {fp.sharded_param.dtype for fp in params}
    if len(dtypes) != 1:
        return f"mixed parameter dtypes {sorted(map(str, dtypes))}"
    dtype = compat.all_gather_dtype(pg)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"unsupported dtype {dtype}"
    reduce_dtype = _reduce_dtype(pg)
    if reduce_dtype != torch.float32 and not config.fp32_reduce:
        return (f"FSDP2 reduces gradients in {reduce_dtype}, TIDE sums in fp32 (set fp32_reduce=True to "
                "serve it with fp32 sums)")
    if getattr(pg, "_use_post_forward_mesh", False):
        return "reshard_after_forward=int (post-forward mesh) is served by stock collectives"
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    if not isinstance(pg._all_gather_comm, DefaultAllGather) or not isinstance(pg._reduce_scatter_comm, DefaultReduceScatter):
        return "a custom all-gather/reduce-scatter comm is set on this group"
    if pg._all_gather_process_group is not pg._reduce_scatter_process_group:
        return "all-gather and reduce-scatter use different process groups"
    if pg._all_gather_process_group.size() == 1:
        return "shard group has one rank: nothing to gather"
    return point_to_point_unavailable_reason(pg._all_gather_process_group)


def _topology(pg_dist, config: TIDEConfig, hosts: list[str]) -> tuple[Topology | None, str | None]:
    size = pg_dist.size()
    if config.gpus_per_node is not None:
        if size % config.gpus_per_node:
            return None, f"gpus_per_node={config.gpus_per_node} does not divide the shard group size {size}"
        return Topology.from_world_size(size, config.gpus_per_node), None
    ranks = dist.get_process_group_ranks(pg_dist)
    names = [hosts[r] for r in ranks]
    L = names.count(names[0])
    if size % L or any(names[i] != names[(i // L) * L] for i in range(size)) or len(set(names)) != size // L:
        return None, "shard-group ranks are not node-major (L consecutive ranks per host); set TIDE_GPUS_PER_NODE"
    return Topology.from_world_size(size, L), None


# -- install / uninstall --------------------------------------------------------------------------


def install(model: nn.Module, mode: str | None = None, transport: str | None = None, *,
            config: TIDEConfig | None = None, **options) -> TIDEHandle:
    """Serve every FSDP2 parameter group inside ``model`` with TIDE. Call after ``fully_shard``
    on every rank (it is collective), before the first forward. Returns the handle; a second
    call on the same model returns the existing handle."""
    existing = model.__dict__.get(_HANDLE_ATTR)
    if existing is not None:
        return existing
    config = TIDEConfig.from_env(config, mode=mode, transport=transport, **options)
    if not dist.is_initialized():
        raise TIDEError("tide_core.install needs torch.distributed to be initialized (it is collective)")
    if not any(_is_fsdp(m) for m in model.modules()):
        raise TIDEError("model has no FSDP2 module: call fully_shard(...) before tide_core.install(model)")
    found = _fsdp_groups(model)
    internals, unsupported = compat.probe()

    hosts: list = [socket.gethostname()] * dist.get_world_size()
    if dist.get_world_size() > 1:  # one process: nothing to agree on, no collective issued
        dist.all_gather_object(hosts, socket.gethostname())
    fsdp_modules = [m for _, _, m in found]
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    entries, plans = [], []
    for index, (name, pg, module) in enumerate(found):
        dtype = compat.all_gather_dtype(pg)
        shard_bytes = sum(fp.padded_sharded_param_size.numel() for fp in pg.fsdp_params) * dtype.itemsize
        reason = unsupported or _ineligible(pg, config, names)
        topo = None
        if reason is None:
            topo, reason = _topology(pg._all_gather_process_group, config, hosts)
        entries.append(GroupEntry(index, name, len(pg.fsdp_params), shard_bytes, str(dtype).replace("torch.", ""),
                                  None, reason))
        plans.append((pg, topo, config.ring and _ring_eligible(pg, module, fsdp_modules)))

    # Shard bytes must agree only for groups TIDE serves: tensor-parallel ranks legitimately hold
    # different local shapes, and their groups fall back (the reason must agree).
    description = {
        "torch": torch.__version__,
        **{f"config.{k}": v for k, v in config.describe().items()},
        **{f"group {e.index} ({e.name})": (e.num_params, e.dtype, e.reason) + ((e.shard_bytes,) if e.reason is None else ())
           for e in entries},
    }
    if dist.get_world_size() > 1:
        check_agreement(description, None, "tide_core.install")

    transports: dict = {}
    rings: dict = {}
    handle = TIDEHandle(model, config, internals, entries, transports, rings)
    ring_members: dict = {}
    for entry, (pg, topo, ring_ok) in zip(entries, plans):
        if entry.reason is not None:
            continue
        pg_dist = pg._all_gather_process_group
        key = (id(pg_dist), topo)
        if key not in transports:
            try:
                single_host = len({hosts[r] for r in dist.get_process_group_ranks(pg_dist)}) == 1
                transports[key] = make_transport(config.transport, topo, pg_dist, device=pg.device, config=config,
                                                 single_host=single_host)
            except TIDEError as exc:
                entry.reason = f"transport unavailable: {exc}"
                continue
        group = TideGroup(handle, entry.index, entry.name, pg, transports[key], None, internals)
        if ring_ok:
            ring_members.setdefault(key, []).append(group)
        for fp in pg.fsdp_params:
            fp._tide_group = group
        entry.served = group
    for key, members in ring_members.items():
        # Both ring slots are sized for the largest ring group on this transport.
        rings[key] = SlotRing(transport=transports[key], slot_bytes=max(g.layout.group_bytes for g in members))
        for g in members:
            g.ring = rings[key]

    if internals is not None:
        _patch(internals, id(handle))
    model.__dict__[_HANDLE_ATTR] = handle
    if dist.get_rank() == 0:
        for e in entries:
            if e.served is None:
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
    for group in handle.served_groups:
        group.unbind()
    if handle.internals is not None:
        _unpatch(handle.internals, id(handle))
    del model.__dict__[_HANDLE_ATTR]


def get_handle(model: nn.Module) -> TIDEHandle | None:
    return model.__dict__.get(_HANDLE_ATTR)
