"""Pure planning math for TIDE: layouts, schedules, Latin squares, memory, sizing, simulation.

Imports neither torch.distributed nor CUDA; it is the single source of truth for offsets,
descriptor lists, waves and memory bounds.
"""

from tide_core.errors import PlanError
from tide_core.plan.allgather import (
    AllGatherPlan,
    LocalPush,
    RailTransfer,
    StageCopy,
    allgather_plan,
    allgather_schedule,
    balance_lanes,
    num_rounds,
)
from tide_core.plan.layout import GroupLayout, gathered_shape
from tide_core.plan.memory import backward_live_bytes, memory_bounds, single_node_staging_bytes
from tide_core.plan.reducescatter import (
    Chunk,
    LatinSquarePlan,
    Level1Copy,
    Level1Step,
    Segment,
    chunk_pieces,
    chunk_segments,
    contributor_index,
    inbox_gpu,
    latin_square_plan,
    level1_copies,
    level1_order,
    level1_owner,
    level1_steps,
    split_copies,
    split_launches,
)
from tide_core.plan.solver import (
    Calibration,
    MultinodeEstimate,
    SolverResult,
    estimate_all_gather,
    estimate_reduce_scatter,
    solve,
)
from tide_core.plan.topology import Topology

__all__ = [
    "PlanError",
    "GroupLayout",
    "gathered_shape",
    "Topology",
    "RailTransfer",
    "LocalPush",
    "StageCopy",
    "AllGatherPlan",
    "allgather_schedule",
    "allgather_plan",
    "num_rounds",
    "balance_lanes",
    "LatinSquarePlan",
    "latin_square_plan",
    "contributor_index",
    "inbox_gpu",
    "level1_owner",
    "level1_order",
    "level1_copies",
    "chunk_segments",
    "chunk_pieces",
    "split_copies",
    "split_launches",
    "level1_steps",
    "Level1Step",
    "Chunk",
    "Segment",
    "Level1Copy",
    "memory_bounds",
    "backward_live_bytes",
    "single_node_staging_bytes",
    "Calibration",
    "SolverResult",
    "solve",
    "MultinodeEstimate",
    "estimate_all_gather",
    "estimate_reduce_scatter",
]
