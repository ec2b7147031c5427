"""The setups fine-tuning users run by default, each served by TIDE with stock FSDP2's results.

Every setup is trained three times on the same gloo ranks (stock FSDP2, TIDE ``in_place``, TIDE
``slot_reuse``, reference transport) and must have every FSDP2 group served, with losses,
gradients (values and dtypes) and parameters bitwise equal to stock's: shard groups of two ranks
sum ``a + b`` either way, and TIDE rounds its fp32 sum once to a bf16/fp16 reduce dtype, as stock's
reduce does. The ``... (reduce hook)`` setups also record the dtype of every reduce output
through FSDP2's all-reduce hook, which receives it in stock and in TIDE. With more ranks a
low-precision reduce rounds once in TIDE and once per ring step in stock: close, not equal, and
``exact_stock_sums=True`` keeps those groups on stock collectives.

scripts/test runs this file on the oldest and the newest supported torch; docs/fsdp-semantics.md
states the same matrix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.fsdp.models import RMSNorm, TinyLM
from tests.fsdp.recording import Recorder, assert_exact, lm_steps, merged, run_scenarios, scenario_device
from tide_core.fsdp.profiles import torch_version

# -- model builders --------------------------------------------------------------------------------


def _shard(model: nn.Module, blocks, *, mesh=None, reshard=True, **mp) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"reshard_after_forward": reshard, "mp_policy": MixedPrecisionPolicy(**mp)}
    if mesh is not None:
        kw["mesh"] = mesh
    model.to(scenario_device())
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _record_reduce_dtypes(model: nn.Module, rec: Recorder) -> None:
    """FSDP2 hands every reduce output (in the reduce dtype) to the all-reduce hook."""
    from torch.distributed.fsdp import FSDPModule

    seen = rec.notes.setdefault("reduce dtypes", [])
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(lambda grad: seen.append(str(grad.dtype)))


def _tiny_lm(
    mode,
    rank,
    *,
    model_dtype=torch.float32,
    frozen_fp32_norms=False,
    frozen_int_param=False,
    checkpoint=False,
    compile_blocks=None,
    reshard=True,
    reduce_hook=False,
    mesh_shape=None,
    options=None,
    **mp,
):
    """TinyLM (odd dims: padded rows, unaligned shard sizes) in ``model_dtype``, one group per block
    plus the root, under MixedPrecisionPolicy(**mp)."""
    torch.manual_seed(0)
    model = TinyLM().to(model_dtype)
    if frozen_fp32_norms:  # bf16 weights with frozen fp32 norms: every group mixes dtypes
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.float().weight.requires_grad_(False)
    if frozen_int_param:  # an integer parameter (a step count, a table of indices) beside bf16 weights
        for block in model.blocks:
            block.register_parameter("steps", nn.Parameter(torch.arange(7), requires_grad=False))
    blocks = list(model.blocks)
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        blocks = [checkpoint_wrapper(b) for b in blocks]
        model.blocks = nn.ModuleList(blocks)
    if compile_blocks == "before fully_shard":
        for block in blocks:
            block.compile(backend="aot_eager")
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    _shard(model, blocks, mesh=mesh, reshard=reshard, **mp)
    if compile_blocks == "after fully_shard":
        for block in blocks:
            block.compile(backend="aot_eager")
    rec = Recorder(model, mode, **(options or {}))
    if reduce_hook:
        _record_reduce_dtypes(model, rec)
    return lm_steps(model, rec, rank)


def _hf_tokens(rank: int, n: int, vocab: int):
    gen = torch.Generator().manual_seed(77 + rank)
    return [torch.randint(0, vocab, (2, 11), generator=gen) for _ in range(n)]


def _hf_steps(model, rec: Recorder, rank: int, vocab: int, steps: int = 3):
    from tests.fsdp.recording import adam

    opt = adam(model)
    for step, tokens in enumerate(_hf_tokens(rank, steps, vocab)):
        tokens = tokens.to(scenario_device())
        rec.backward(model(input_ids=tokens, labels=tokens).loss)
        rec.step(opt, step % 2 == 0)
    return rec.finish()


def _hf_model(arch: str, dtype: torch.dtype):
    """A random-init Hugging Face model built the way ``from_pretrained(torch_dtype=...)`` builds
    one (``_from_config``), with odd sizes."""
    import transformers

    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=67,
            hidden_size=40,
            intermediate_size=50,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(vocab_size=67, n_embd=40, n_layer=2, n_head=4, n_positions=32)
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    return cls._from_config(config, torch_dtype=dtype), config.vocab_size


def _hf(mode, rank, *, arch="llama", dtype=torch.bfloat16, lora=False, gradient_checkpointing=False, **mp):
    """A Hugging Face model (optionally LoRA through peft, optionally HF gradient checkpointing), one
    group per decoder layer (its ``_no_split_modules``) plus the root."""
    from tide_core.fsdp.autoshard import find_blocks

    model, vocab = _hf_model(arch, dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:  # peft keeps the base frozen and makes fp32 adapters (autocast_adapter_dtype)
        import peft

        torch.manual_seed(1)
        target = ["q_proj", "v_proj"] if arch == "llama" else ["c_attn"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=target))
        for name, p in model.named_parameters():  # peft starts B at zero: move off it
            if "lora_B" in name:
                nn.init.normal_(p, std=0.02)
    _shard(model, find_blocks(model), **mp)
    return _hf_steps(model, Recorder(model, mode), rank, vocab)


def _no_trainable_root(mode, rank):
    """LoRA on a bf16 base: the root group (embedding, final norm, head) has no trainable parameter."""
    return _hf(mode, rank, lora=True)


BF16_POLICY = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
ACCELERATE_BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16, "output_dtype": torch.bfloat16}

SETUPS = {
    "fp32": (_tiny_lm, {}),
    "bf16 model (model.to(bf16))": (_tiny_lm, {"model_dtype": torch.bfloat16}),
    "bf16 policy, fp32 reduce": (_tiny_lm, BF16_POLICY),
    "bf16 policy, no reduce dtype": (_tiny_lm, {"param_dtype": torch.bfloat16}),
    "Accelerate's bf16 policy (bf16 reduce)": (_tiny_lm, ACCELERATE_BF16),
    "bf16 weights, frozen fp32 norms": (_tiny_lm, {"model_dtype": torch.bfloat16, "frozen_fp32_norms": True}),
    "bf16 policy, a frozen int64 parameter in each block": (_tiny_lm, {"frozen_int_param": True, **BF16_POLICY}),
    "activation checkpointing (torch), bf16 model": (_tiny_lm, {"model_dtype": torch.bfloat16, "checkpoint": True}),
    "torch.compile per block before fully_shard, bf16 policy": (
        _tiny_lm,
        {"compile_blocks": "before fully_shard", **BF16_POLICY},
    ),
    "torch.compile per block after fully_shard, bf16 model": (
        _tiny_lm,
        {"compile_blocks": "after fully_shard", "model_dtype": torch.bfloat16},
    ),
    "reshard_after_forward=False, bf16 model": (_tiny_lm, {"reshard": False, "model_dtype": torch.bfloat16}),
    "bf16 model (reduce hook)": (_tiny_lm, {"model_dtype": torch.bfloat16, "reduce_hook": True}),
    "Accelerate's bf16 policy (reduce hook)": (_tiny_lm, {"reduce_hook": True, **ACCELERATE_BF16}),
    "bf16 policy, fp32 reduce (reduce hook)": (_tiny_lm, {"reduce_hook": True, **BF16_POLICY}),
    "fp16 reduce (reduce hook)": (_tiny_lm, {"reduce_hook": True, "reduce_dtype": torch.float16}),
    "bf16 weights, frozen fp32 norms (reduce hook)": (
        _tiny_lm,
        {"model_dtype": torch.bfloat16, "frozen_fp32_norms": True, "reduce_hook": True},
    ),
    "Llama in bf16 (from_pretrained torch_dtype)": (_hf, {}),
    "GPT-2 in bf16 (from_pretrained torch_dtype)": (_hf, {"arch": "gpt2"}),
    "Llama, bf16 policy, HF gradient checkpointing": (
        _hf,
        {"dtype": torch.float32, "gradient_checkpointing": True, **BF16_POLICY},
    ),
    "LoRA (peft) on a bf16 Llama": (_no_trainable_root, {}),
    "LoRA (peft) on an fp32 Llama": (_hf, {"dtype": torch.float32, "lora": True}),
    "LoRA (peft) on a bf16 GPT-2": (_hf, {"arch": "gpt2", "lora": True}),
    "HSDP 2 x 2, bf16 model": (_tiny_lm, {"model_dtype": torch.bfloat16, "mesh_shape": (2, 2)}),
    "HSDP 2 x 2, Accelerate's bf16 policy": (_tiny_lm, {"mesh_shape": (2, 2), **ACCELERATE_BF16}),
    "bf16 model, 4 ranks": (_tiny_lm, {"model_dtype": torch.bfloat16}),
    "bf16 model, 4 ranks, exact_stock_sums": (
        _tiny_lm,
        {"model_dtype": torch.bfloat16, "options": {"exact_stock_sums": True}},
    ),
}
ON_4_RANKS = [
    "HSDP 2 x 2, bf16 model",
    "HSDP 2 x 2, Accelerate's bf16 policy",
    "bf16 model, 4 ranks",
    "bf16 model, 4 ranks, exact_stock_sums",
]
#: torch 2.11's FSDP2 cannot shard an integer parameter (it makes every sharded parameter require
#: gradients), so stock has no result to compare with there.
NEEDS_TORCH_2_12 = {"bf16 policy, a frozen int64 parameter in each block"}
TWO_RANK_SETUPS = [name for name in SETUPS if name not in ON_4_RANKS]
ON_2_RANKS = [name for name in TWO_RANK_SETUPS if torch_version() >= (2, 12) or name not in NEEDS_TORCH_2_12]


@pytest.fixture(scope="module")
def two_ranks():
    from tests.support.dist import run_distributed

    return merged(run_distributed(run_scenarios, 2, args=(SETUPS, ON_2_RANKS), timeout=900))


@pytest.fixture(scope="module")
def four_ranks():
    from tests.support.dist import run_distributed

    return merged(run_distributed(run_scenarios, 4, args=(SETUPS, ON_4_RANKS), timeout=600))


@pytest.mark.parametrize("name", TWO_RANK_SETUPS)
def test_every_group_served_with_stocks_results(two_ranks, name):
    if name not in ON_2_RANKS:
        pytest.skip(f"stock FSDP2 cannot run this setup on torch {torch.__version__}")
    result = two_ranks[name]
    for r in result.values():
        assert r["served"] == r["groups"] and not r["reasons"], (name, r)
    assert_exact(two_ranks, name)


REDUCE_HOOK_SETUPS = {  # setup -> the dtype FSDP2 reduces its gradients in
    "bf16 model (reduce hook)": "torch.bfloat16",
    "Accelerate's bf16 policy (reduce hook)": "torch.bfloat16",
    "bf16 policy, fp32 reduce (reduce hook)": "torch.float32",
    "fp16 reduce (reduce hook)": "torch.float16",
    "bf16 weights, frozen fp32 norms (reduce hook)": "torch.bfloat16",  # the trainable weights' dtype
}


@pytest.mark.parametrize("name", list(REDUCE_HOOK_SETUPS))
def test_every_reduce_has_stocks_dtype(two_ranks, name):
    for r in two_ranks[name].values():  # notes_match: the same list as stock's
        seen = r["notes"]["reduce dtypes"]
        assert r["notes_match"] and len(seen) == r["reduce_scatters"] > 0, (name, r)
        assert set(seen) == {REDUCE_HOOK_SETUPS[name]}, (name, seen)


def test_lora_root_without_trainable_parameters_is_served_all_gather_only(two_ranks):
    r = two_ranks["LoRA (peft) on a bf16 Llama"]["in_place"]
    assert r["served"] == r["groups"] == 3, r


@pytest.mark.parametrize("name", ["HSDP 2 x 2, bf16 model", "HSDP 2 x 2, Accelerate's bf16 policy"])
def test_hsdp_with_two_rank_shard_groups_is_exact(four_ranks, name):
    for r in four_ranks[name].values():
        assert r["served"] == r["groups"], (name, r)
    assert_exact(four_ranks, name)


def test_low_precision_reduce_over_four_ranks_rounds_once(four_ranks):
    # Stock rounds to bf16 at every step of gloo's ring, TIDE once: close, not equal.
    for r in four_ranks["bf16 model, 4 ranks"].values():
        assert r["served"] == r["groups"] and r["dtypes_match"], r
        assert 0 < r["grad"] < 2e-2 and r["param"] < 5e-2, r
    for r in four_ranks["bf16 model, 4 ranks, exact_stock_sums"].values():
        assert r["served"] == 0 and r["loss"] == r["grad"] == r["param"] == 0.0, r
        assert all("exact_stock_sums=True" in why and "over 4 ranks" in why for why in r["reasons"].values()), r


def _table(argv=None) -> str:
    """The matrix as a markdown table: ``python -m tests.fsdp.test_served_matrix [--out FILE]``."""
    import argparse

    import torch

    from tests.support.dist import run_distributed

    parser = argparse.ArgumentParser(description="The served matrix, stock FSDP2 vs TIDE, as a table")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = {2: merged(run_distributed(run_scenarios, 2, args=(SETUPS, ON_2_RANKS), timeout=1800))}
    results[4] = merged(run_distributed(run_scenarios, 4, args=(SETUPS, ON_4_RANKS), timeout=1800))
    lines = [
        f"torch {torch.__version__}, gloo, reference transport; `python -m tests.fsdp.test_served_matrix`",
        "",
        "| setup | ranks | mode | served | max loss diff | max grad diff | max param diff | dtypes as stock's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ranks, names in ((2, ON_2_RANKS), (4, ON_4_RANKS)):
        for name in names:
            for mode, r in results[ranks][name].items():
                lines.append(
                    f"| {name} | {ranks} | {mode} | {r['served']}/{r['groups']} | {r['loss']:.3g} | {r['grad']:.3g} "
                    f"| {r['param']:.3g} | {'yes' if r['dtypes_match'] and r['notes_match'] else 'no'} |"
                )
    table = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return table


if __name__ == "__main__":
    print(_table())
