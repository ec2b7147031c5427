"""CudaOptions and TIDEConfig.cuda_options(): the settings carry over, mode maps onto the outbox, each
option's allowed values live once (in the transport's options, which the config inherits)."""

from __future__ import annotations

import dataclasses

import pytest

from tide_core.config import TIDEConfig
from tide_core.transport.cuda import CudaOptions


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
    ],
)
def test_bad_transport_options_are_rejected_by_the_options_and_the_config_alike(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        CudaOptions(**bad)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TIDEConfig(**bad)
