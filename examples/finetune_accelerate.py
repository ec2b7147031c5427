"""Causal-LM fine-tuning of a Llama-architecture model with Hugging Face Accelerate + FSDP2 + TIDE.

    tide-accelerate launch --config_file examples/accelerate/tide.yaml examples/finetune_accelerate.py
    tide-accelerate launch --config_file examples/accelerate/tide.yaml examples/finetune_accelerate.py --compare-stock
    accelerate launch --config_file my_fsdp2.yaml examples/finetune_accelerate.py   # stock FSDP2 (GPUs)

This is a plain Accelerate script: under ``tide-accelerate launch`` the runner serves the model that
``accelerator.prepare`` shards with TIDE; under a plain ``accelerate launch`` it trains with stock
FSDP2. ``--compare-stock`` (or an explicit ``--mode``/``--transport``) enables TIDE here too, so it
works under either launcher. The launch config's fsdp_config decides wrapping and resharding; this
script fixes FSDP2 and the precision (``--precision``: bf16 on GPUs, fp32 on CPU, by default).
``--devices`` does not apply: the launch's num_processes decides.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, InitProcessGroupKwargs
from torch.distributed.fsdp import MixedPrecisionPolicy
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    HelpFormatter,
    Meter,
    add_common_args,
    batch_iterator,
    build_model,  # noqa: E402
    comparison_table,
    encode_corpus,
    launched_ranks_share_gpus,
    tide_is_on,
)

import tide_accelerate  # noqa: E402
from tide_core.fsdp.adapter import get_handle  # noqa: E402


def make_accelerator(args) -> Accelerator:
    bf16 = args.precision == "bf16"
    # bf16 parameters with an fp32 gradient reduction (Accelerate's own bf16 policy reduces in bf16).
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
        if bf16
        else None
    )
    # Fields not given here fall back to the launch config's fsdp_config (FSDP_* variables).
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=policy)
    # More processes than GPUs (a one-GPU machine): the ranks share them over gloo (NCCL refuses two
    # ranks on one GPU), and TIDE maps their arenas through CUDA IPC.
    handlers = [InitProcessGroupKwargs(backend="gloo")] if launched_ranks_share_gpus() else []
    accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no", fsdp_plugin=plugin, kwargs_handlers=handlers)
    if not accelerator.is_fsdp2:
        raise SystemExit(
            f"this example needs FSDP2, but Accelerate chose {accelerator.distributed_type} on "
            f"{accelerator.num_processes} process(es): launch it with several processes (on a CPU-only "
            "machine through tide-accelerate launch, since Accelerate alone never runs FSDP on CPU)"
        )
    return accelerator


def train(args, accelerator: Accelerator, tokens: torch.Tensor, *, stock: bool) -> dict:
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    with tide_accelerate.disabled() if stock else contextlib.nullcontext():
        model, optimizer = accelerator.prepare(model, optimizer)
    # The install printed TIDE's report on the main process; tide: enabled: false installs it off.
    name = "TIDE" if tide_is_on(get_handle(model)) else "stock FSDP2"

    meter = Meter(args.seq_len * args.batch_size * accelerator.num_processes)
    batches = batch_iterator(tokens, args.seq_len, args.batch_size, seed=args.seed, rank=accelerator.process_index)
    model.train()
    progress = tqdm(range(1, args.steps + 1), desc=name, disable=not accelerator.is_local_main_process)
    for step in progress:
        batch = next(batches).to(accelerator.device)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        metrics = meter.step(accelerator.reduce(loss.detach(), reduction="mean").item())
        progress.set_postfix(loss=f"{metrics['loss']:.4f}", tokens_per_s=f"{metrics['tokens_per_s']:.0f}")
        if accelerator.is_main_process and (step % args.log_every == 0 or step == args.steps):
            progress.write(
                f"{name} step {step}/{args.steps}: loss {metrics['loss']:.6f}, "
                f"{metrics['tokens_per_s']:.0f} tokens/s, peak memory {metrics['peak_mem_gib']:.2f} GiB"
            )
    return meter.summary(name, get_handle(model))


def main(argv=None) -> int:
    parser = add_common_args(
        argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter), tide_from_launch=True
    )
    parser.add_argument("--log-every", type=int, default=10, help="print loss, tokens/s and memory every N steps")
    args = parser.parse_args(argv)
    launched_ranks_share_gpus()  # sets TIDE_SHARE_GPUS before TIDE's settings are read below

    # Before the Accelerator exists, so that it also applies on CPU-only machines.
    if args.compare_stock or args.mode or args.transport:
        tide_accelerate.enable(tide_accelerate.TIDEPlugin(mode=args.mode, transport=args.transport))
    accelerator = make_accelerator(args)
    tokens = encode_corpus(args)
    accelerator.print(
        f"Accelerate {accelerator.distributed_type.value} (FSDP2) on {accelerator.num_processes} "
        f"{accelerator.device.type} process(es), mixed precision {accelerator.mixed_precision}, "
        f"model {args.model_path or args.model}, {args.steps} steps of "
        f"{args.batch_size}x{args.seq_len} tokens per process"
    )
    rows = []
    for stock in [True, False] if args.compare_stock else [False]:
        rows.append(train(args, accelerator, tokens, stock=stock))
        accelerator.free_memory()  # the next run starts from an empty device
    accelerator.print(comparison_table(rows))
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
