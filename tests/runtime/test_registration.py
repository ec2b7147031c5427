"""NCCL registration of the arena's MemPool: every rank or none (CPU, a stand-in backend over gloo),
and on a GPU (marked `cuda`): registered, undone on release, collectives on registered buffers exact."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed


class _Pool:
    id = (7, 7)


class _StandInNCCL:
    """ProcessGroupNCCL's registration calls, failing on ``failing_rank``."""

    def __init__(self, rank, failing_rank):
        self.rank, self.failing_rank, self.calls = rank, failing_rank, []

    def register_mem_pool(self, pool):
        self.calls.append("register")
        if self.rank == self.failing_rank:
            raise RuntimeError("ncclCommRegister failed: invalid usage")

    def deregister_mem_pool(self, pool):
        self.calls.append("deregister")


def _all_or_none(rank, world_size, failing_rank, pool_less_rank):
    from unittest import mock

    from tide_core.runtime.registration import _registered, register_pool

    group = dist.group.WORLD
    backend = _StandInNCCL(rank, failing_rank)
    pool = None if rank == pool_less_rank else _Pool()
    with (
        mock.patch.object(dist, "get_backend", return_value="nccl"),
        mock.patch.object(type(group), "_get_backend", return_value=backend),
    ):
        result = register_pool(group, pool, torch.device("cpu"), "test", timeout_s=30)
        registered = result.registered
        result.release()
    return registered, result.reason, backend.calls, dict(_registered)


@pytest.mark.parametrize(
    "failing_rank,pool_less_rank,registered,reason,calls",
    [
        (None, None, True, "arena MemPool registered with NCCL on the 3-rank group", ["register", "deregister"]),
        (2, None, False, "not registered: registration failed on rank(s) [2]", ["register", "deregister"]),
        (None, 1, False, "not registered: the arena of rank(s) [1] is not in a torch MemPool", []),
    ],
)
def test_registration_is_on_every_rank_or_none(failing_rank, pool_less_rank, registered, reason, calls):
    results = run_distributed(_all_or_none, 3, timeout=120, args=(failing_rank, pool_less_rank))
    for rank, (done, text, made, left) in enumerate(results):
        assert done == registered and text.startswith(reason), (rank, text)
        assert left == {}, (rank, left)  # nothing stays counted as registered
        if rank == failing_rank:
            assert made == ["register"] and "invalid usage" in text  # it failed itself: nothing to undo
        else:
            assert made == calls, (rank, made)


def _register_and_reduce(rank, world_size):
    from tide_core.runtime.registration import _registered, register_pool
    from tide_core.runtime.symmetric import SymmetricAllocator

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = dist.new_group(list(range(world_size)))
    allocate = SymmetricAllocator(group, device)
    if allocate.pool is None:
        return None  # this torch has no symmetric MemPool
    base, _ = allocate("registered", 1 << 20)
    first = register_pool(group, allocate.pool, device, "test", timeout_s=60)
    second = register_pool(group, allocate.pool, device, "test", timeout_s=60)  # a second transport
    assert first.registered and second.registered, (first.reason, second.reason)
    key = (group.group_name, allocate.pool.id)
    assert _registered[key] == 2
    later, _ = allocate("later", 4 << 20)  # grown after registration: torch's hooks register it
    values = torch.randn(later.numel() // 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    x = later.view(torch.float32)
    x.copy_(values)
    dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), values.to(torch.float32))  # one rank: the sum is itself, bit for bit
    second.release()
    assert _registered[key] == 1  # the first transport still uses it
    first.release()
    first.release()  # idempotent
    assert key not in _registered
    again = register_pool(group, allocate.pool, device, "test", timeout_s=60)
    assert again.registered
    again.release()
    return base.data_ptr(), later.data_ptr()


@pytest.mark.cuda
def test_arena_pool_registers_with_nccl_and_releases(tmp_path):
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "REG", "NCCL_DEBUG_FILE": str(tmp_path / "nccl.%p.log")}
    (pointers,) = run_distributed(_register_and_reduce, 1, backend="nccl", timeout=120, env=env)
    if pointers is None:
        pytest.skip("this torch has no symmetric MemPool")
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("nccl.*.log"))
    # NCCL's own record of each ncclCommRegister: "register comm <comm> buffer <address> size <bytes>"
    registered = [
        (int(m[1], 16), int(m[2])) for m in re.finditer(r"register comm \S+ buffer (0x[0-9a-f]+) size (\d+)", logs)
    ]
    print("\nNCCL registered (address, bytes):", [(hex(a), n) for a, n in registered])
    for ptr in pointers:  # the first segment at registration, the later one through torch's hook; both again
        assert sum(a <= ptr < a + n for a, n in registered) == 2, (hex(ptr), registered)
