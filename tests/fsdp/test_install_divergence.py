"""Ranks that diverge at ``install``: a named error on the installing rank, never a process abort.

Before the store handshake, install's first collective was a variable-size all_gather_object and
gloo aborted the process (SIGABRT) when the other rank was inside a different collective.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.fsdp.models import loss_fn
from tests.fsdp.test_adapter import batches, build
from tests.support.dist import run_distributed

TIMEOUT_S = 3.0


def _diverge(rank, world_size, other):
    import tide_core
    from tide_core import PeerStallTimeout, RankMismatchError
    from tide_core.plan import Topology
    from tide_core.transport.reference import ReferenceTransport

    model = build()
    dist.barrier()  # both ranks diverge from here (building the model may take one of them longer)
    started = time.monotonic()
    try:
        if rank == 0:
            tide_core.install(model, transport="reference", timeout_s=TIMEOUT_S)
        elif other == "stock step":  # skipped install: stock FSDP2's first all-gather
            loss_fn(model, batches(rank, 1)[0]).backward()
        elif other == "all_reduce":
            dist.all_reduce(torch.ones(5))
        elif other == "transport":  # a different TIDE entry point
            ReferenceTransport(Topology(1, world_size), timeout_s=TIMEOUT_S)
        return {"error": None, "after_s": time.monotonic() - started}
    except (PeerStallTimeout, RankMismatchError) as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - started}
    except RuntimeError as exc:  # the stock collective of the rank that skipped install
        outcome = {"error": type(exc).__name__, "message": str(exc)[:200], "after_s": time.monotonic() - started}
    if rank == 0 and other != "transport":
        # leave the process group: the rank blocked in its stock collective then fails too
        dist.destroy_process_group()
    else:  # rank 0 hosts the store: keep it up until the other rank read it
        time.sleep(max(0.0, started + 2.0 - time.monotonic()))
    return outcome


@pytest.mark.parametrize("other", ["stock step", "all_reduce"])
def test_a_rank_that_skips_install_gets_named_not_aborted(other):
    installing, skipping = run_distributed(_diverge, 2, args=(other,), timeout=60)
    print("\n", installing, "\n", skipping)
    assert installing["error"] == "PeerStallTimeout", installing
    assert "tide_core.install: rank(s) [1] of group" in installing["message"], installing
    assert f"did not enter it within {TIMEOUT_S:g} s" in installing["message"], installing
    assert TIMEOUT_S - 0.05 <= installing["after_s"] <= TIMEOUT_S + 1.0, installing
    # the other rank is not TIDE's: its stock collective fails when rank 0 leaves, but the process
    # lives to report it (no gloo abort)
    assert skipping["error"] == "RuntimeError", skipping


def test_a_rank_in_another_tide_entry_point_gets_rank_mismatch_on_both():
    outcomes = run_distributed(_diverge, 2, args=("transport",), timeout=60)
    print("\n", outcomes)
    for o in outcomes:
        assert o["error"] == "RankMismatchError", o
        assert "'TIDE-handshake/1/tide_core.install'" in o["message"], o
        assert "'TIDE-handshake/1/ReferenceTransport(1x2)'" in o["message"], o
        assert o["after_s"] < 2.0, o
