"""Peak attribution from a synthetic allocator snapshot shaped like torch.cuda.memory._snapshot()."""

from tide_core.bench import memory_detail as md
from tide_core.bench.report_train import peak_tables
from tide_core.bench.train import train_step

MiB = 1 << 20
PHASES = md.step_phases(train_step)
LINE = {phase: line for line, phase in PHASES.items()}


def frame(path, name, line=1):
    return {"filename": f"/site-packages/{path}", "name": name, "line": line}


def step(phase):
    return frame("tide_core/bench/train.py", "train_step", LINE[phase])


ARENA = [
    frame("tide_core/runtime/symmetric.py", "allocate"),
    frame("tide_core/runtime/arena.py", "segment"),
    frame("tide_core/transport/cuda.py", "all_gather"),
]
OPTIMIZER = [frame("torch/optim/adamw.py", "_init_group"), step("optimizer")]
FORWARD = [
    frame("torch/nn/modules/linear.py", "forward"),
    frame("tide_core/bench/models.py", "forward"),
    step("forward"),
]
LOSS = [frame("torch/nn/functional.py", "cross_entropy"), step("loss")]
REDUCE = [
    frame("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "allocate"),
    frame("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_reduce"),
]


def event(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


def block(addr, size, frames, state="active_allocated"):
    return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": frames}


def snapshot():
    """Resident before the history: arena (1 MiB), optimizer state (2 MiB), X (freed before the
    peak) and Y (freed after it). The peak is the autograd-thread allocation (no stack)."""
    trace = [
        event("alloc", 0xA000, 4096, FORWARD),
        event("free_requested", 0x100, 1000),  # X: counted as 1024 by the allocator
        event("segment_alloc", 0xB000, 2 * MiB),
        event("alloc", 0xB000, 8192, LOSS),
        event("alloc", 0xC000, 2048),
        event("free_requested", 0xA000, 4096, FORWARD),
        event("free_completed", 0xA000, 4096, FORWARD),
        event("free_requested", 0x200, 512, REDUCE),  # Y
        event("alloc", 0xD000, 100, FORWARD),
    ]
    segments = [
        {"device": 0, "blocks": [block(0x1000, MiB, ARENA), block(0x1000 + MiB, MiB, [], "inactive")]},
        {"device": 0, "blocks": [block(0x4000, 2 * MiB, OPTIMIZER), block(0xD000, 512, FORWARD)]},
        {"device": 1, "blocks": [block(0x9000, 64 * MiB, [])]},  # another device's memory is not ours
    ]
    return {"segments": segments, "device_traces": [trace, []]}


RESIDENT = MiB + 2 * MiB + 1024 + 512


def test_step_phases_name_every_phase_of_train_step():
    assert set(PHASES.values()) == {"forward", "loss", "backward", "optimizer"}


def test_peak_is_replayed_and_attributed():
    d = md.peak_attribution(snapshot(), RESIDENT, PHASES)
    assert d["peak_bytes"] == RESIDENT - 1024 + 4096 + 8192 + 2048
    assert d["phase"] == "backward"
    assert d["categories"] == {
        "optimizer": 2 * MiB,
        "TIDE arena": MiB,
        "loss (logits.float, cross entropy)": 8192,
        "activations (model forward)": 4096,
        md.NO_STACK_MEASURED: 2048,
        "FSDP2 foreach_reduce": 512,
    }
    assert sum(d["categories"].values()) == d["peak_bytes"]
    assert d["resident_at_peak"] == MiB + 2 * MiB + 512
    assert [b["bytes"] for b in d["top_blocks"]] == [2 * MiB, MiB, 8192, 4096, 2048, 512]
    arena = d["top_blocks"][1]
    assert arena["resident"] and arena["where"].startswith("symmetric.py:1 allocate < arena.py:1 segment")
    assert not d["history_full"] and d["events"] == 9


def test_resident_bytes_without_a_record_are_the_residual():
    d = md.peak_attribution(snapshot(), RESIDENT + 4096, PHASES)
    assert d["categories"][md.RESIDENT_RESIDUAL] == 4096
    assert sum(d["categories"].values()) == d["peak_bytes"]


def test_peak_before_any_allocation():
    d = md.peak_attribution({"segments": [], "device_traces": [[event("free_requested", 0x100, 512)]]}, 512, PHASES)
    assert d["peak_bytes"] == 512 and d["phase"] == "before the measured steps"
    assert d["categories"] == {md.NO_STACK_RESIDENT: 512}  # live at the start, freed later
    assert d["top_blocks"] == [
        {"bytes": 512, "category": md.NO_STACK_RESIDENT, "resident": True, "where": "(no Python stack)"}
    ]


def test_peak_table_compares_systems_per_tokens_point():
    detail = md.peak_attribution(snapshot(), RESIDENT, PHASES)
    memory = {
        "stock": {"4096": {"peak_allocated": detail["peak_bytes"] + MiB, "peak_reserved": 0, "detail": detail}},
        "in_place": {"4096": {"peak_allocated": detail["peak_bytes"], "peak_reserved": 0, "detail": detail}},
        "slot_reuse": None,
    }
    text = "\n".join(peak_tables(memory))
    assert "Where the peak is, 4096 tokens/GPU" in text
    assert "| category | stock | in_place |" in text and "| peak phase | backward | backward |" in text
    assert "| max_memory_allocated - replayed (MiB) | 1 | 0 |" in text
    assert (
        "| in_place | 1 | TIDE arena | yes | symmetric.py:1 allocate < arena.py:1 segment < cuda.py:1 all_gather |"
        in text
    )
    assert peak_tables({"stock": {"4096": {"peak_allocated": 0, "peak_reserved": 0}}}) == []
