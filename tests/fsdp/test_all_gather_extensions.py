"""Groups whose parameters define FSDP2 all-gather extensions (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on the local shard, as torchao's float8 all-gather does), served by TIDE.

Three extensions of the tests' own, on some weights of a small LM: two bf16 halves of each fp32
value (two inputs; the parameter is a new tensor rebuilt from them), float8_e4m3fn data with each
rank's fp32 scale (two inputs of different dtypes; dequantized into a new tensor), and an input the
parameter is a view of (as torchao's float8 weight is of its all-gathered data). Every input lands
in its own dtype; the groups mix plain parameters with extension inputs. Trained three times on two
gloo ranks (stock FSDP2, TIDE ``in_place``, TIDE ``slot_reuse``, reference transport): every group
served, losses, gradients and parameters bitwise equal to stock's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from tests.fsdp.models import TinyLM
from tests.fsdp.recording import Recorder, assert_exact, lm_steps, merged, run_scenarios

# -- the extensions --------------------------------------------------------------------------------


class _ExtensionShard(torch.Tensor):
    """A weight whose local shard defines FSDP2's all-gather extension (subclasses say what is
    gathered); every other op runs on the plain data inside."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        unwrap = lambda x: x._data  # noqa: E731
        out = func(
            *pytree.tree_map_only(_ExtensionShard, unwrap, args),
            **pytree.tree_map_only(_ExtensionShard, unwrap, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return inner_tensors["_data"]

    def _padded(self, outer_size, mesh) -> torch.Tensor:
        """The local shard with FSDP2's padding rows (zeros): uneven shards gather padded."""
        rows = math.ceil(outer_size[0] / mesh.size())
        padded = torch.zeros((rows, *outer_size[1:]), dtype=self._data.dtype, device=self._data.device)
        padded[: self._data.size(0)].copy_(self._data)
        return padded


class SplitBF16Shard(_ExtensionShard):
    """Gathers each fp32 value as two bf16 halves (hi, lo); the parameter is hi + lo, a new tensor."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        x = self._padded(outer_size, mesh)
        hi = x.to(torch.bfloat16)
        return (hi, (x - hi.float()).to(torch.bfloat16)), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        hi, lo = all_gather_outputs
        value = (hi.float() + lo.float()).to(param_dtype)
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(value[: out.size(0)])
            return None
        return value, (hi, lo, value)


class Float8Shard(_ExtensionShard):
    """Gathers float8_e4m3fn data and each rank's fp32 scale; the parameter is dequantized."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        x = self._padded(outer_size, mesh)
        scale = (448.0 / x.abs().max().clamp(min=1e-12)).reshape(1)
        return ((x * scale).to(torch.float8_e4m3fn), scale), "float8"

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        assert metadata == "float8", metadata
        data, scales = all_gather_outputs
        ranks = scales.numel()
        value = (data.float().view(ranks, -1) / scales.view(ranks, 1)).view(data.shape).to(param_dtype)
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(value[: out.size(0)])
            return None
        return value, (data, scales, value)


class AliasShard(_ExtensionShard):
    """Gathers the shard in the parameter dtype; the parameter is a view of the gathered output."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._padded(outer_size, mesh).to(mp_policy.param_dtype or self.dtype),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if out is not None:  # refreshed in place: the parameter is still a view of the output
            assert out.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
            return None
        return data, (data,)


#: Block weights -> extension. FSDP2 wants every input of an unevenly sharded parameter in its
#: padded shard size, so the float8 data with its one-element scale goes on an even weight (90 rows).
EXTENSIONS = {"wqkv": Float8Shard, "w1": SplitBF16Shard, "w2": AliasShard}


# -- the scenarios ---------------------------------------------------------------------------------


def _extended_lm(mode, rank, *, reshard=True, **mp):
    """TinyLM (odd dims: padded rows) with an extension on three weights of every block and on the
    head, one group per block plus the root, under MixedPrecisionPolicy(**mp)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    for block in model.blocks:
        for name, cls in EXTENSIONS.items():
            linear = getattr(block, name)
            linear.weight = nn.Parameter(cls(linear.weight.detach().clone()))
    model.head.weight = nn.Parameter(SplitBF16Shard(model.head.weight.detach().clone()))
    kw = {"reshard_after_forward": reshard, "mp_policy": MixedPrecisionPolicy(**mp)}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return lm_steps(model, Recorder(model, mode), rank, after_steps=_check_landings if mode else None)


def _check_landings(rec: Recorder) -> None:
    """The report names each group's extensions; every all-gather input has a landing of its own
    dtype in TIDE's arena, the aliasing parameter is a view of its landing, and (resharded after the
    step) what an extension built apart from its landings is freed, as FSDP2 frees it."""
    report = rec.handle.report()
    assert report.count("all-gather extension: AliasShard, Float8Shard, SplitBF16Shard") == 4, report
    assert "all-gather extension: SplitBF16Shard\n" in report, report
    segments = [seg for t in rec.handle.transports.values() for seg in t.arena.segments.values()]
    param_dtype = str(rec.handle.served_groups[0].fsdp_params[0].param_dtype or torch.float32)
    expected = {
        SplitBF16Shard: ["torch.bfloat16", "torch.bfloat16"],
        Float8Shard: ["torch.float8_e4m3fn", "torch.float32"],
        AliasShard: [param_dtype],
    }
    for group in rec.handle.served_groups:
        for fp in group.fsdp_params:
            outputs = fp.all_gather_outputs
            kind = type(fp._sharded_local_tensor)
            assert [str(t.dtype) for t in outputs] == expected.get(kind, [str(outputs[0].dtype)]), (kind, outputs)
            assert all(any(seg.contains(t.data_ptr(), t.nbytes) for seg in segments) for t in outputs), fp
            if kind is AliasShard:
                assert fp._unsharded_param.untyped_storage().data_ptr() == outputs[0].data_ptr(), fp
            landings = {t.data_ptr() for t in outputs}
            for inner in fp._unsharded_inner_tensors:
                storage = inner.untyped_storage()
                assert storage.data_ptr() in landings or storage.size() == 0, (fp, inner.shape)


SCENARIOS = {
    "fp32": (_extended_lm, {}),
    "bf16 policy, fp32 reduce": (_extended_lm, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}),
    "reshard_after_forward=False": (_extended_lm, {"reshard": False}),
}


@pytest.fixture(scope="module")
def two_ranks():
    from tests.support.dist import run_distributed

    return merged(run_distributed(run_scenarios, 2, args=(SCENARIOS, list(SCENARIOS)), timeout=600))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_extension_groups_served_with_stocks_results(two_ranks, name):
    for r in two_ranks[name].values():
        assert r["served"] == r["groups"] == 5 and not r["reasons"], (name, r)
    assert_exact(two_ranks, name)


# -- torchao's float8 all-gather -------------------------------------------------------------------


def torchao_missing() -> str | None:
    """Why torchao's float8 training cannot run here (None: it can)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        return f"torchao is not installed ({exc}); pip install torchao"
    return None


def _torchao_float8(mode, rank, *, precompute=False, **mp):
    """torchao's float8 training with ``enable_fsdp_float8_all_gather``: every Linear a Float8Linear
    whose weight FSDP2 all-gathers in float8 through WeightWithDynamicFloat8CastTensor's extension
    (the scale from an amax reduced over the shard group in ``fsdp_pre_all_gather``, or with
    ``precompute`` from ``precompute_float8_dynamic_scale_for_fsdp`` after each step). Dims are
    multiples of 16 (float8 matmuls); 4 steps on fresh inputs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from tests.fsdp.recording import adam, scenario_device

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(3)))
    # Every group holds an fp32 bias beside its float8 weights, so stock FSDP2 gathers bytes: gloo
    # (the CPU run) has no float8 all-gather.
    model.append(nn.Linear(64, 32))
    model.to(scenario_device())
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    kw = {"mp_policy": MixedPrecisionPolicy(**mp)}
    for block in model[:3]:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    rec = Recorder(model, mode)
    opt = adam(model)
    gen = torch.Generator().manual_seed(31 + rank)
    for step in range(4):
        x = torch.randn(32, 64, generator=gen).to(scenario_device())
        rec.backward(model(x).float().pow(2).mean())
        rec.step(opt, step % 2 == 0)
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
    if mode is not None:
        report = rec.handle.report()
        assert report.count("all-gather extension: WeightWithDynamicFloat8CastTensor") == 4, report
        segments = [seg for t in rec.handle.transports.values() for seg in t.arena.segments.values()]
        for group in rec.handle.served_groups:
            for fp in group.fsdp_params:
                if fp.sharded_param.dim() == 2:  # a Float8Linear weight: its float8 data lands in the arena
                    (landing,) = fp.all_gather_outputs
                    assert landing.dtype == torch.float8_e4m3fn, landing.dtype
                    assert any(seg.contains(landing.data_ptr(), landing.nbytes) for seg in segments)
    return rec.finish()


TORCHAO_SCENARIOS = {
    "torchao float8, fp32": (_torchao_float8, {}),
    "torchao float8, precomputed scales": (_torchao_float8, {"precompute": True}),
    "torchao float8, bf16 policy, fp32 reduce": (
        _torchao_float8,
        {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    ),
}


def test_torchao_float8_all_gather_served_with_stocks_results():
    """Where torchao is installed: its float8 training on the CPU (float8 matmuls emulated)."""
    if why := torchao_missing():
        pytest.skip(why)
    from tests.support.dist import run_distributed

    result = merged(run_distributed(run_scenarios, 2, args=(TORCHAO_SCENARIOS, list(TORCHAO_SCENARIOS)), timeout=600))
    for name in TORCHAO_SCENARIOS:
        for r in result[name].values():
            assert r["served"] == r["groups"] == 4 and not r["reasons"], (name, r)
        assert_exact(result, name)


# -- what stays on stock collectives ---------------------------------------------------------------


class ComplexShard(_ExtensionShard):
    """Gathers complex64 (a dtype TIDE does not move)."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._padded(outer_size, mesh).to(torch.complex64),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        raise AssertionError("never gathered here")


class UnreadyShard(_ExtensionShard):
    """An extension that cannot run yet at install."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        raise RuntimeError("scales not loaded")

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        raise AssertionError("never gathered here")


def _install_reasons(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    import tide_core

    torch.manual_seed(0)
    model = TinyLM(layers=3)
    for block, cls in zip(model.blocks, (ComplexShard, UnreadyShard, Float8Shard)):
        block.wqkv.weight = nn.Parameter(cls(block.wqkv.weight.detach().clone()))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    handle = tide_core.install(model, transport="reference")
    reasons = {e.name: e.reason for e in handle.entries}
    tide_core.uninstall(model)
    return reasons


def test_extensions_tide_cannot_plan_fall_back_with_a_reason():
    from tests.support.dist import run_distributed

    reasons = run_distributed(_install_reasons, 2, timeout=120)[0]
    assert reasons["blocks.0"] == (
        "parameter blocks.0.wqkv.weight: all-gather extension with unsupported dtype torch.complex64"
    ), reasons
    assert reasons["blocks.1"].startswith(
        "parameter blocks.1.wqkv.weight: fsdp_pre_all_gather failed at install: RuntimeError: scales not loaded"
    ), reasons
    assert reasons["blocks.2"] is None and reasons["<root>"] is None, reasons
