"""``tide_core.install(model)``: serve every FSDP2 parameter group inside ``model`` with TIDE.

    handle = tide_core.install(model, mode="in_place", transport="auto")   # after fully_shard
    print(handle.report())
    tide_core.uninstall(model)

FSDP2's collectives are routed to TIDE for served groups and to stock for everything else
through ``tide_core.fsdp.compat``, the one module that touches FSDP2's private names (per torch
version: docs/torch-compat.md). Groups outside the contract
fall back to stock collectives with a logged reason; ranks that disagree on the configuration or
the groups abort on every rank with a message naming the difference. Installing twice is a no-op.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from tide_core.config import TIDEConfig
from tide_core.errors import TIDEError
from tide_core.fsdp import compat
from tide_core.fsdp.group import SlotRing, TideGroup
from tide_core.fsdp.options import cuda_options
from tide_core.plan import Topology, backward_live_bytes
from tide_core.plan.report import fmt_bytes
from tide_core.runtime.groups import check_agreement, handshake, point_to_point_unavailable_reason
from tide_core.transport import make_transport

log = logging.getLogger("tide")

_HANDLE_ATTR = "_tide_handle"


@dataclass
class GroupEntry:
    index: int
    name: str
    num_params: int
    shard_bytes: int
    dtype: str
    served: TideGroup | None
    install_reason: str | None  # why install left the group on stock collectives

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
    def served_groups(self) -> list[TideGroup]:
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
        out = {"arena_reserved": arena, "transport_staging": staging}
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
        served = self.served_groups
        lines = [
            f"TIDE {self.config.mode} on {len(self.entries)} FSDP2 parameter group(s): {len(served)} served, "
            f"{len(self.entries) - len(served)} on stock collectives",
        ]
        for t in self.transports.values():
            summary, *details = t.describe()
            lines += [f"  transport: {summary}"] + [f"    {line}" for line in details]
        lines.append(f"  {'#':>3} {'group':<32} {'P':>4} {'S/rank':>11} {'dtype':<9} status")
        for e in self.entries:
            status = f"TIDE, {e.served.placement}" if e.active else f"stock: {e.reason}"
            lines.append(
                f"  {e.index:>3} {e.name[:32]:<32} {e.num_params:>4} {fmt_bytes(e.shard_bytes):>11} "
                f"{e.dtype:<9} {status}"
            )
        mem = self.memory()
        lines.append(
            f"  memory: arena reserved {fmt_bytes(mem['arena_reserved'])}, "
            f"transport staging {fmt_bytes(mem['transport_staging'])}"
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


def _ring_eligible(pg, module: nn.Module, fsdp_modules: list[nn.Module]) -> bool:
    """Leaf groups that reshard after forward share the 2-slot ring. Roots (live through the whole
    step), groups with FSDP2 children (live while their children run), groups of several modules
    (``fully_shard([a, b])``: live from a's forward to b's, e.g. tied embedding and output around
    every layer) and groups kept unsharded after forward get dedicated landings."""
    if not compat.reshards_after_forward(pg) or compat.module_count(pg) > 1:
        return False
    has_child = any(other is not module and any(m is other for m in module.modules()) for other in fsdp_modules)
    has_parent = any(other is not module and any(m is module for m in other.modules()) for other in fsdp_modules)
    return has_parent and not has_child


def _ineligible(pg, config: TIDEConfig, names: dict[int, str]) -> str | None:
    """Why a group cannot be served (None: it can). ``names``: id(sharded parameter) -> its name."""
    num_params = len(compat.fsdp_params(pg))
    if num_params > config.max_params:
        return f"{num_params} parameters > max_params={config.max_params}"
    reason = compat.ineligible(pg, names)
    if reason is not None:
        return reason
    dtype = compat.all_gather_dtype(pg)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"unsupported dtype {dtype}"
    reduce_dtype = compat.reduce_dtype(pg)
    if reduce_dtype != torch.float32 and not config.fp32_reduce:
        return (
            f"FSDP2 reduces gradients in {reduce_dtype}, TIDE sums in fp32 (set fp32_reduce=True to "
            "serve it with fp32 sums)"
        )
    if compat.shard_process_group(pg).size() == 1:
        return "shard group has one rank: nothing to gather"
    return point_to_point_unavailable_reason(compat.shard_process_group(pg))


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
    if not dist.is_initialized():
        raise TIDEError("tide_core.install needs torch.distributed to be initialized (it is collective)")
    if not any(_is_fsdp(m) for m in model.modules()):
        raise TIDEError("model has no FSDP2 module: call fully_shard(...) before tide_core.install(model)")
    # Every rank must be here before the first collective: one that skipped install or runs another
    # collective meets a named error, not a size mismatch that aborts the process inside gloo.
    if dist.get_world_size() > 1:
        handshake("tide_core.install", None, config.timeout_s)
    found = compat.fsdp_param_groups(model)
    internals, unsupported = compat.probe()

    hosts: list = [socket.gethostname()] * dist.get_world_size()
    if dist.get_world_size() > 1:  # one process: nothing to agree on, no collective issued
        dist.all_gather_object(hosts, socket.gethostname())
    fsdp_modules = [m for _, _, m in found]
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    entries, plans = [], []
    for index, (name, pg, module) in enumerate(found):
        dtype = compat.all_gather_dtype(pg)
        shard_bytes = compat.padded_shard_numel(pg) * dtype.itemsize
        reason = unsupported or _ineligible(pg, config, names)
        topo = None
        if reason is None:
            topo, reason = _topology(compat.shard_process_group(pg), config, hosts)
        entries.append(
            GroupEntry(
                index, name, len(compat.fsdp_params(pg)), shard_bytes, str(dtype).replace("torch.", ""), None, reason
            )
        )
        plans.append((pg, topo, config.ring and _ring_eligible(pg, module, fsdp_modules)))

    # Shard bytes must agree only for groups TIDE serves: tensor-parallel ranks legitimately hold
    # different local shapes, and their groups fall back (the reason must agree).
    description = {
        "torch": torch.__version__,
        **{f"config.{k}": v for k, v in config.describe().items()},
        **{
            f"group {e.index} ({e.name})": (e.num_params, e.dtype, e.reason)
            + ((e.shard_bytes,) if e.reason is None else ())
            for e in entries
        },
    }
    if dist.get_world_size() > 1:
        check_agreement(description, None, "tide_core.install", config.timeout_s)

    transports: dict = {}
    rings: dict = {}
    handle = TIDEHandle(model, config, internals, entries, transports, rings)
    ring_members: dict = {}
    for entry, (pg, topo, ring_ok) in zip(entries, plans):
        if entry.install_reason is not None:
            continue
        pg_dist = compat.shard_process_group(pg)
        key = (id(pg_dist), topo)
        if key not in transports:
            try:
                single_host = len({hosts[r] for r in dist.get_process_group_ranks(pg_dist)}) == 1
                transports[key] = make_transport(
                    config.transport,
                    topo,
                    pg_dist,
                    device=compat.group_device(pg),
                    options=cuda_options(config),
                    validate_calls=config.validate_calls,
                    single_host=single_host,
                )
            except TIDEError as exc:
                if config.transport == "cuda":  # asked for by name: not met is an error, not a fallback
                    for served in entries:  # leave the model as install found it
                        if served.served:
                            compat.unmark_served(internals, served.served.pg)
                    for transport in transports.values():
                        transport.close()
                    raise TIDEError(
                        f"group {entry.index} ({entry.name}): {exc} (transport='auto' keeps stock "
                        "collectives where the CUDA transport cannot serve)"
                    ) from exc
                entry.install_reason = f"transport unavailable: {exc}"
                continue
        group = TideGroup(config, entry.index, entry.name, pg, transports[key], None, internals)
        if ring_ok:
            ring_members.setdefault(key, []).append(group)
        compat.mark_served(internals, pg, group)
        entry.served = group
    for key, members in ring_members.items():
        # Both ring slots are sized for the largest ring group on this transport.
        rings[key] = SlotRing(
            transport=transports[key], slot_bytes=max(g.layout.group_bytes for g in members), members=members
        )
        for g in members:
            g.ring = rings[key]

    if internals is not None:
        compat.patch(internals, id(handle))
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
        compat.unpatch(handle.internals, id(handle))
    del model.__dict__[_HANDLE_ATTR]


def get_handle(model: nn.Module) -> TIDEHandle | None:
    return model.__dict__.get(_HANDLE_ATTR)
