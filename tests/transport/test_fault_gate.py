"""The negative-test gate: every protocol invariant removed at the transport level and detected.

Each case injects one typed fault (``tide_core.transport.faults``) into one rank's CUDA transport on
the emulated device and asserts one outcome per rank: which error, or which corruption (which
contributor's rows are missing, counted twice, poisoned or from the next call). Invariants:
(I1) every contributor lands exactly once; (I2) gradients and shards stay live until the call's
completion covers their reads; (I3) staging, stage, inbox and landing buffers are reused only after
their previous consumer; (I4) every wait has an earlier producer in the common order (a wait
enqueued before its producer on one hardware queue deadlocks). Layouts are tiny (4 KiB chunks)
and timeouts short, so the whole gate runs in a few minutes on two cores.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from tests.support.emulated_device import EmulatedDevice, shared_memory_allocator, shut_down
from tests.transport.cases import all_grads, all_shards, fp64_reduce_scatter, layout_for
from tide_core import PeerFailure, PeerStallTimeout
from tide_core.plan import Topology
from tide_core.transport.cuda import CudaOptions, CudaTransport
from tide_core.transport.faults import (
    CountTwice,
    DropCopy,
    DropRailCredits,
    DropStagingCredits,
    PushBeforeReady,
    PushesBeforeSums,
    ReleaseInputsEarly,
    ReorderCalls,
    ReuseRailEarly,
    ReuseStagingEarly,
    Site,
    SkipCompletion,
    SkipRailSignal,
)
from tide_core.transport.reference import ReferenceTransport

AG, RS = "all_gather", "reduce_scatter"
CALLS = 3
TIMEOUT_S = 2.0


def _shapes(world_size: int, collective: str) -> list[tuple]:
    if collective == RS:  # 12 KiB of bf16 rows per peer: three 4 KiB chunks per call, the slot ring wraps
        return [(4096, 3), (37,), (2 * world_size + 1, 5)]
    return [(world_size * 16, 9), (5,), (3 * world_size + 1, 4), (world_size * 8, 3), (7, 2)]


def _ag_status(rows: torch.Tensor, shards, nxt, r: int, p: int) -> str:
    if torch.equal(rows, shards[r][p]):
        return "exact"
    if torch.isinf(rows.float()).any():
        return "refilled (inf)"
    if torch.isnan(rows.float()).all():
        return "nan"
    if nxt is not None and torch.equal(rows, nxt[r][p]):
        return "next call's"
    if (rows == 0).all():
        return "zero"
    return "wrong"


def _classify_ag(lay, outs, shards, nxt) -> str:
    """exact, or per source rank the status of its rows where not exact (rows of rank 0: nan)."""
    N = lay.world_size
    bad = set()
    for p in range(lay.num_params):
        flat = outs[p].reshape(-1)
        n = lay.shard_numel(p)
        for r in range(N):
            status = _ag_status(flat[r * n : (r + 1) * n], shards, nxt, r, p)
            if status != "exact":
                bad.add(f"rows of rank {r}: {status}")
    return "; ".join(sorted(bad)) or "exact"


def _classify_rs(lay, topo, out, expected, grads_all, rank) -> str:
    """One of: exact; refilled (inf): inputs refilled before their reads; nan: never written;
    missing rank r / rank r counted twice: out = expected -/+ rank r's rows (in fp64; or a node's
    ranks), "(part)" where only some elements are affected; else wrong."""
    if torch.equal(out, expected):
        return "exact"
    if torch.isinf(out).any():
        return "refilled (inf)"
    if torch.isnan(out).any():
        return "nan"
    candidates = [(f"rank {r}", [r]) for r in range(topo.world_size)]
    if topo.nodes > 1 and topo.gpus_per_node > 1:
        candidates += [(f"node {n}", topo.node_ranks(n)) for n in range(topo.nodes)]
    differs = out != expected
    for name, ranks in candidates:
        only = [g if q in ranks else [torch.zeros_like(t) for t in g] for q, g in enumerate(grads_all)]
        contribution = fp64_reduce_scatter(lay, only, rank, 1.0, None)
        for sign, what in ((-1, f"missing {name}"), (1, f"{name} counted twice")):
            close = torch.isclose(out.double(), expected.double() + sign * contribution, rtol=1e-5, atol=1e-5)
            if close[differs].all():  # every wrong element is explained by this contributor
                return what if bool(close.all()) else f"{what} (part)"
    return "wrong"


def _case(rank, world_size, tag, spec):
    topo = Topology(*spec["topology"])
    collective = spec["collective"]
    faulty = spec.get("faulty", 0)  # a rank, or "all": an order every rank shares
    struck = faulty in ("all", rank)
    faults = [spec["fault"]] if struck and spec.get("fault") is not None else []
    delays = spec.get("faulty_delays" if struck else "other_delays", {})
    dev = EmulatedDevice(hardware_queues=spec.get("queues"), **delays)
    alloc = shared_memory_allocator(dist.group.WORLD, tag)
    # The first rank stuck on a fault times out and announces it; the others stuck with it fail on the
    # announcement with the same error, or on their own deadline: PeerStallTimeout either way.
    options = CudaOptions(
        chunk_mib=4096 / (1 << 20),
        chunk_slots=2,
        timeout_s=TIMEOUT_S,
        sum_ctas=4,
        rail="p2p",
        sum_slice_mib=spec.get("slice_kib", 0) / 1024,
        heartbeat_s=0.2,
        peer_dead_s=30.0,
        abort_on_stall=False,
    )
    t = CudaTransport(
        topo, None, options=options, device=torch.device("cpu"), backend=dev, allocator=alloc, faults=faults
    )
    shapes = _shapes(world_size, collective)
    lay = layout_for(shapes, world_size, 2)
    same_landing = spec.get("same_landing", False)
    calls = spec.get("calls", CALLS)
    landings = [t.landing_buffers(lay, slot=0 if same_landing else call, dtype=torch.bfloat16) for call in range(calls)]
    grads = [all_grads(call, shapes, world_size, torch.bfloat16) for call in range(calls)]
    expected = []
    if collective == RS:  # reference results first: collectives cannot follow a fail-stop
        ref = ReferenceTransport(topo)
        for call in range(calls):
            expected.append(torch.empty(lay.total_shard_numel))
            ref.reduce_scatter(lay, grads[call][rank], expected[-1])
    # Inputs: fresh buffers per call, kept alive (a freed buffer's memory would be reused and blur
    # what a fault did), or, for the landing-reuse cases, the same buffers every call (FSDP2's steady
    # state: no per-call agreement, so a rank may run ahead into the next call).
    steady = [torch.empty(lay.shard_numel(p), dtype=torch.bfloat16) for p in range(lay.num_params)]
    kept = []
    dist.barrier()
    results, started = [], time.monotonic()
    try:
        for call in range(calls):
            if collective == AG:
                shards = all_shards(call, lay, torch.bfloat16)
                mine = steady if same_landing else [s.clone() for s in shards[rank]]  # what the transport reads
                if same_landing:
                    for buf, shard in zip(mine, shards[rank]):
                        buf.copy_(shard)
                kept.append(mine)
                outs = landings[call]
                for o in outs:
                    o.fill_(float("nan"))
                work = t.all_gather(lay, mine, outs)
            else:
                mine = [g.clone() for g in grads[call][rank]]
                kept.append(mine)
                out = torch.full((lay.total_shard_numel,), float("nan"))
                work = t.reduce_scatter(lay, mine, out)
            work.wait()
            if spec.get("poison_inputs") and struck:  # inputs refilled once the call says it read them
                for tensor in mine:
                    tensor.fill_(float("inf"))
            t.synchronize()
            if collective == AG:
                if spec.get("slow_consumer") and not struck:
                    time.sleep(0.3)  # this rank still reads call e's landing while peers issue call e+1
                nxt = all_shards(call + 1, lay, torch.bfloat16) if same_landing else None
                results.append(_classify_ag(lay, outs, shards, nxt))
            else:
                results.append(_classify_rs(lay, topo, out, expected[call], grads[call], rank))
        t.synchronize()
        outcome = {"error": None, "calls": results}
    except (PeerStallTimeout, PeerFailure) as exc:
        outcome = {
            "error": type(exc).__name__,
            "calls": results,
            "message": str(exc),
            "after_s": round(time.monotonic() - started, 2),
        }
    finally:
        dist.barrier()  # keep every emulated GPU running until each rank finished or failed on its own
        t.close()
        shut_down(dev, alloc)
    return outcome


def summary(outcome: dict) -> str:
    """One outcome per rank: the error it raised, or the set of non-exact results of its calls."""
    if outcome["error"]:
        return outcome["error"]
    bad = sorted({c for c in outcome["calls"] if c != "exact"})
    return " | ".join(bad) or "exact"


def run_case(spec: dict) -> list[str]:
    world = spec["topology"][0] * spec["topology"][1]
    outcomes = run_distributed(_case, world, args=(uuid.uuid4().hex[:8], spec), timeout=120)
    print("\n", [(summary(o), o["calls"], o.get("after_s")) for o in outcomes])
    return [summary(o) for o in outcomes]


EXACT, STALL = "exact", "PeerStallTimeout"
NAN0, ZERO0 = "rows of rank 0: nan", "rows of rank 0: zero"  # rank 0's rows never landed (poison, stale stage)
MISSING0 = "missing rank 0 (part)"  # the dropped copy's elements lack rank 0's rows; the rest is exact
REFILLED = "refilled (inf)"  # inputs refilled before their reads reached the peers' results
OVERWRITTEN = "wrong"  # a buffer rewritten under its reader: values of a later chunk or call
NEXT_CALL = "rows of rank 1: nan | rows of rank 1: next call's"  # read while rewritten, then lost to the fill
SLOW_PUSH, SLOW_SUM, SLOW_SCATTER = {"push_delay_s": 0.15}, {"sum_delay_s": 0.1}, {"copy_delay_s": 0.1}


def case(topology, collective, fault=None, **spec):
    return dict(topology=topology, collective=collective, fault=fault, **spec)


# name: (invariant, fault kind, spec, outcome per rank). The fault strikes rank 0 unless ``faulty`` says
# otherwise; "control" cases run the same scenario without the fault (or in the transport's own order).
GATE = {
    # I1: every contributor lands exactly once ---------------------------------------------------------------
    "I1 all-gather push dropped, 1x2": ("I1", "DropCopy", case((1, 2), AG, DropCopy(Site.AG_PUSH)), [EXACT, NAN0]),
    "I1 all-gather push dropped, 1x3": (
        "I1",
        "DropCopy",
        case((1, 3), AG, DropCopy(Site.AG_PUSH)),
        [EXACT, NAN0, EXACT],
    ),
    "I1 all-gather second lane's push dropped, 1x3": (
        "I1",
        "DropCopy",
        case((1, 3), AG, DropCopy(Site.AG_PUSH, 2)),
        [EXACT, EXACT, NAN0],
    ),
    "I1 reduce-scatter push dropped, 1x2": (
        "I1",
        "DropCopy",
        case((1, 2), RS, DropCopy(Site.RS_PUSH), calls=1),
        [EXACT, MISSING0],
    ),
    "I1 reduce-scatter push dropped, 1x3": (
        "I1",
        "DropCopy",
        case((1, 3), RS, DropCopy(Site.RS_PUSH), calls=1),
        [EXACT, MISSING0, MISSING0],
    ),
    "I1 rail all-gather put dropped, 2x1": (
        "I1",
        "DropCopy",
        case((2, 1), AG, DropCopy(Site.RAIL_PUT)),
        [EXACT, ZERO0],
    ),
    "I1 rail all-gather put dropped, 3x1": (
        "I1",
        "DropCopy",
        case((3, 1), AG, DropCopy(Site.RAIL_PUT)),
        [EXACT, EXACT, ZERO0],
    ),
    "I1 rail reduce-scatter put dropped, 2x1": (
        "I1",
        "DropCopy",
        case((2, 1), RS, DropCopy(Site.RAIL_PUT), calls=1),
        [EXACT, MISSING0],
    ),
    "I1 rail reduce-scatter put dropped, 2x2": (
        "I1",
        "DropCopy",
        case((2, 2), RS, DropCopy(Site.RAIL_PUT), calls=1),
        [EXACT, EXACT, EXACT, "missing node 0 (part)"],
    ),
    "I1 staged peer counted twice, 1x2": (
        "I1",
        "CountTwice",
        case((1, 2), RS, CountTwice()),
        ["rank 1 counted twice", EXACT],
    ),
    "I1 staged peer counted twice, 1x3": (
        "I1",
        "CountTwice",
        case((1, 3), RS, CountTwice()),
        ["rank 1 counted twice", EXACT, EXACT],
    ),
    "I1 staged peer counted twice, 2x2": (
        "I1",
        "CountTwice",
        case((2, 2), RS, CountTwice()),
        ["rank 1 counted twice", EXACT, EXACT, "rank 1 counted twice"],
    ),
    # I2: inputs stay live until the call's completion covers their reads -----------------------------------
    "I2 gradients refilled before their pushes, 1x2": (
        "I2",
        "ReleaseInputsEarly",
        case((1, 2), RS, ReleaseInputsEarly(), poison_inputs=True, faulty_delays=SLOW_PUSH),
        [EXACT, REFILLED],
    ),
    "I2 gradients refilled before their pushes, 1x3": (
        "I2",
        "ReleaseInputsEarly",
        case((1, 3), RS, ReleaseInputsEarly(), poison_inputs=True, faulty_delays=SLOW_PUSH),
        [EXACT, REFILLED, REFILLED],
    ),
    "I2 shards refilled before their pushes, 1x2": (
        "I2",
        "ReleaseInputsEarly",
        case((1, 2), AG, ReleaseInputsEarly(), poison_inputs=True, faulty_delays=SLOW_PUSH),
        [EXACT, "rows of rank 0: " + REFILLED],
    ),
    "I2 shards refilled before their pushes, 1x3": (
        "I2",
        "ReleaseInputsEarly",
        case((1, 3), AG, ReleaseInputsEarly(), poison_inputs=True, faulty_delays=SLOW_PUSH),
        [EXACT] + ["rows of rank 0: " + REFILLED] * 2,
    ),
    "I2 gradients refilled before their pushes, sliced sums, 1x2": (
        "I2",
        "ReleaseInputsEarly",
        case((1, 2), RS, ReleaseInputsEarly(), poison_inputs=True, slice_kib=1, faulty_delays={"push_delay_s": 0.03}),
        [EXACT, REFILLED],
    ),  # 8 push batches a chunk
    "I2 control: refilled after completion, reduce-scatter": (
        "I2",
        "control",
        case((1, 2), RS, poison_inputs=True, faulty_delays=SLOW_PUSH),
        [EXACT, EXACT],
    ),
    "I2 control: refilled after completion, all-gather": (
        "I2",
        "control",
        case((1, 2), AG, poison_inputs=True, faulty_delays=SLOW_PUSH),
        [EXACT, EXACT],
    ),
    # I3: staging, stage, inbox and landing reused only after their previous consumer -----------------------
    "I3 staging slot reused early, 1x2": (
        "I3",
        "ReuseStagingEarly",
        case((1, 2), RS, ReuseStagingEarly(), faulty=1, other_delays=SLOW_SUM),
        [OVERWRITTEN, EXACT],
    ),
    "I3 staging slot reused early, 1x3": (
        "I3",
        "ReuseStagingEarly",
        case((1, 3), RS, ReuseStagingEarly(), faulty=1, other_delays=SLOW_SUM),
        [OVERWRITTEN, EXACT, OVERWRITTEN],
    ),
    "I3 staging credits dropped, 1x2": (
        "I3",
        "DropStagingCredits",
        case((1, 2), RS, DropStagingCredits(1)),
        [STALL, STALL],
    ),
    "I3 staging credits dropped, 1x3": (
        "I3",
        "DropStagingCredits",
        case((1, 3), RS, DropStagingCredits(1)),
        [STALL] * 3,
    ),
    "I3 landing rewritten before its reader is done, 1x2": (
        "I3",
        "PushBeforeReady",
        case((1, 2), AG, PushBeforeReady(), faulty=1, same_landing=True, slow_consumer=True),
        [NEXT_CALL, EXACT],
    ),
    "I3 landing rewritten before its reader is done, 1x3": (
        "I3",
        "PushBeforeReady",
        case((1, 3), AG, PushBeforeReady(), faulty=1, same_landing=True, slow_consumer=True),
        [NEXT_CALL, EXACT, NEXT_CALL],
    ),
    "I3 landing rewritten before its reader is done, 2x2": (
        "I3",
        "PushBeforeReady",
        case((2, 2), AG, PushBeforeReady(), faulty=1, same_landing=True, slow_consumer=True),
        [NEXT_CALL, EXACT, EXACT, EXACT],
    ),
    "I3 rail stage reused early, 2x1": (
        "I3",
        "ReuseRailEarly",
        case((2, 1), AG, ReuseRailEarly(), other_delays=SLOW_SCATTER),
        [EXACT, "rows of rank 0: wrong"],
    ),
    "I3 rail stage reused early, 3x1": (
        "I3",
        "ReuseRailEarly",
        case((3, 1), AG, ReuseRailEarly(), other_delays=SLOW_SCATTER),
        [EXACT, EXACT, "rows of rank 0: wrong"],
    ),
    "I3 rail inbox reused early, 2x1": (
        "I3",
        "ReuseRailEarly",
        case((2, 1), RS, ReuseRailEarly(), other_delays=SLOW_SUM),
        [EXACT, OVERWRITTEN],
    ),
    "I3 rail stage credits dropped, 2x1": (
        "I3",
        "DropRailCredits",
        case((2, 1), AG, DropRailCredits(2)),
        [STALL, STALL],
    ),
    "I3 rail inbox credits dropped, 2x1": (
        "I3",
        "DropRailCredits",
        case((2, 1), RS, DropRailCredits(2)),
        [STALL, EXACT],
    ),
    "I3 rail inbox credits dropped, 3x1": (
        "I3",
        "DropRailCredits",
        case((3, 1), RS, DropRailCredits(2)),
        [STALL, STALL, EXACT],
    ),
    # I4: every wait has an earlier producer in the common order ---------------------------------------------
    "I4 completion signal skipped, 1x2": (
        "I4",
        "SkipCompletion",
        case((1, 2), AG, SkipCompletion(frozenset({2}))),
        [STALL, STALL],
    ),
    "I4 completion signal skipped, 1x3": (
        "I4",
        "SkipCompletion",
        case((1, 3), AG, SkipCompletion(frozenset({2}))),
        [STALL] * 3,
    ),
    "I4 completion signal skipped, 2x2": (
        "I4",
        "SkipCompletion",
        case((2, 2), AG, SkipCompletion(frozenset({2}))),
        [STALL] * 4,
    ),
    "I4 rail data signal skipped, all-gather 2x1": (
        "I4",
        "SkipRailSignal",
        case((2, 1), AG, SkipRailSignal(frozenset({2}))),
        [STALL, STALL],
    ),
    "I4 rail data signal skipped, reduce-scatter 2x1": (
        "I4",
        "SkipRailSignal",
        case((2, 1), RS, SkipRailSignal(frozenset({2}))),
        [STALL, STALL],
    ),
    "I4 rail data signal skipped, reduce-scatter 3x1": (
        "I4",
        "SkipRailSignal",
        case((3, 1), RS, SkipRailSignal(frozenset({2}))),
        [STALL] * 3,
    ),
    "I4 calls reordered, 1x2": ("I4", "ReorderCalls", case((1, 2), AG, ReorderCalls(2), faulty=1), [STALL, STALL]),
    "I4 calls reordered, 1x3": ("I4", "ReorderCalls", case((1, 3), AG, ReorderCalls(2), faulty=1), [STALL] * 3),
    "I4 calls reordered, 2x1": ("I4", "ReorderCalls", case((2, 1), AG, ReorderCalls(2), faulty=1), [STALL, STALL]),
    "I4 one hardware queue, pushes before sums, 1x2": (
        "I4",
        "PushesBeforeSums",
        case((1, 2), RS, PushesBeforeSums(), faulty="all", queues=1),
        [STALL, STALL],
    ),
    "I4 one hardware queue, pushes before sums, 1x3": (
        "I4",
        "PushesBeforeSums",
        case((1, 3), RS, PushesBeforeSums(), faulty="all", queues=1),
        [STALL] * 3,
    ),
    "I4 one hardware queue, pushes before sums, 2x2": (
        "I4",
        "PushesBeforeSums",
        case((2, 2), RS, PushesBeforeSums(), faulty="all", queues=1),
        [STALL] * 4,
    ),
    "I4 control: pushes before sums, a queue per stream": (
        "I4",
        "control",
        case((1, 2), RS, PushesBeforeSums(), faulty="all"),
        [EXACT, EXACT],
    ),
    "I4 control: the transport's order, one hardware queue": (
        "I4",
        "control",
        case((1, 2), RS, queues=1),
        [EXACT, EXACT],
    ),
}


@pytest.mark.parametrize("name", list(GATE))
def test_fault_gate(name):
    _, _, spec, expected = GATE[name]
    assert run_case(spec) == expected, name


def test_the_gate_covers_every_invariant_with_at_least_41_fault_cases_over_11_kinds():
    faults = {name: entry for name, entry in GATE.items() if entry[1] != "control"}
    kinds = {entry[1] for entry in faults.values()}
    assert len(faults) >= 41 and len(kinds) >= 11, (len(faults), sorted(kinds))
    assert {entry[0] for entry in faults.values()} == {"I1", "I2", "I3", "I4"}
    assert all(type(entry[2]["fault"]).__name__ == entry[1] for entry in faults.values())
