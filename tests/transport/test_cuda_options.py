"""CudaOptions and TIDEConfig.cuda_options(): the settings carry over, mode maps onto the outbox, each
option's allowed values live once (in the transport's options, which the config inherits)."""

from __future__ import annotations

import dataclasses

import pytest

from tide_core.config import TIDEConfig
from tide_core.transport.cuda import CudaOptions
from tide_core.transport.cuda.options import INT_LIMITS, MAX_MIB, MAX_SECONDS


def test_mode_maps_onto_the_outbox_and_shared_fields_carry_over():
    config = TIDEConfig(
        mode="slot_reuse",
        sum_kernel="regs",
        chunk_mib=2.0,
        copy_lanes=3,
        rail="p2p",
        wave_width=2,
        timeout_s=7.0,
        abort_on_stall=False,
        heartbeat_s=0.5,
        peer_dead_s=5.0,
    )
    options = config.cuda_options()
    assert options.recycle_outbox and not TIDEConfig(mode="in_place").cuda_options().recycle_outbox
    for field in dataclasses.fields(CudaOptions):
        if field.name != "recycle_outbox":
            assert getattr(options, field.name) == getattr(config, field.name), field.name
    assert options.protocol()["options.recycle_outbox"] is True and "options.chunk_mib" in options.protocol()


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"sum_kernel": "fast"}, "sum_kernel='fast' is not supported; choose one of auto, tma, regs"),
        ({"rail": "ib"}, "rail='ib' is not supported; choose one of auto, p2p, nccl"),
        ({"rail": "nccl_rma"}, "rail='nccl_rma' is not supported; choose one of auto, p2p, nccl"),
        ({"local_copy": "dma"}, "local_copy='dma' is not supported; choose one of kernel, ce"),
        ({"copy_lanes": 0}, "copy_lanes=0 must be an integer >= 1"),
        ({"chunk_mib": 0}, "chunk_mib=0 must be > 0"),
        ({"timeout_s": 0}, "timeout_s=0 must be > 0 or None"),
        ({"heartbeat_s": 0}, "heartbeat_s=0 must be > 0"),
        ({"peer_dead_s": 1.0}, "peer_dead_s=1.0 must exceed two heartbeats"),
        # Non-finite values once passed and failed at the first call with an OverflowError.
        ({"chunk_mib": float("inf")}, "chunk_mib=inf must be a finite number <= 65536"),
        ({"sum_slice_mib": float("inf")}, "sum_slice_mib=inf must be a finite number <= 65536"),
        ({"timeout_s": float("inf")}, "timeout_s=inf must be a finite number <= 2592000"),
        ({"heartbeat_s": float("nan")}, "heartbeat_s=nan must be a finite number"),
        ({"peer_dead_s": float("inf")}, "peer_dead_s=inf must be a finite number"),
        ({"chunk_mib": 1 << 17}, "chunk_mib=131072 must be a finite number <= 65536"),
        # Integers past what tide_core._C takes (sum_ctas above INT_MAX was a pybind TypeError).
        ({"sum_ctas": 1 << 31}, f"sum_ctas={1 << 31} must be an integer >= 1 and <= 65536"),
        ({"local_copy_ctas": 1 << 17}, f"local_copy_ctas={1 << 17} must be an integer >= 1 and <= 65536"),
        ({"chunk_slots": 1 << 40}, f"chunk_slots={1 << 40} must be an integer >= 1 and <= 1024"),
        ({"copy_lanes": 65}, "copy_lanes=65 must be an integer >= 1 and <= 64"),
        ({"wave_width": 1 << 31}, f"wave_width={1 << 31} must be an integer >= 1 and <= 1024 or None"),
        ({"round_width": 1 << 31}, f"round_width={1 << 31} must be an integer >= 1 and <= 1024"),
        ({"sum_ctas": True}, "sum_ctas=True must be an integer"),
    ],
)
def test_bad_transport_options_are_rejected_by_the_options_and_the_config_alike(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        CudaOptions(**bad)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TIDEConfig(**bad)


def test_every_bound_itself_is_accepted():
    """The limits are inclusive, for the options and the config alike."""
    at_limits = dict(INT_LIMITS, chunk_mib=MAX_MIB, sum_slice_mib=MAX_MIB, timeout_s=MAX_SECONDS)
    at_limits.update(heartbeat_s=MAX_SECONDS / 4, peer_dead_s=MAX_SECONDS)
    assert CudaOptions(**at_limits).sum_ctas == INT_LIMITS["sum_ctas"]
    assert TIDEConfig(**at_limits).chunk_mib == MAX_MIB


@pytest.mark.parametrize(("name", "limit"), [("max_params", 1 << 16), ("gpus_per_node", 1024)])
def test_config_integers_have_upper_bounds(name, limit):
    assert getattr(TIDEConfig(**{name: limit}), name) == limit
    with pytest.raises(ValueError, match=f"^{name}={limit + 1} must be an integer >= 1 and <= {limit}"):
        TIDEConfig(**{name: limit + 1})
