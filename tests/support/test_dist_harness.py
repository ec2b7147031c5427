import time

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import DistributedTestError, run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()


def _hang(rank, world_size):
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(120)


def test_runs_on_every_rank():
    assert run_distributed(_sum_ranks, 3) == [6.0, 6.0, 6.0]


def test_reports_the_failing_ranks_traceback():
    with pytest.raises(DistributedTestError, match="rank 1 failed") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=30)
    assert "planted failure on rank 1" in str(info.value)


def test_times_out_instead_of_hanging():
    with pytest.raises(DistributedTestError, match="did not finish within 5 s"):
        run_distributed(_hang, 2, timeout=5)
