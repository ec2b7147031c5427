"""Causal-LM fine-tuning of a Llama-architecture model with Lightning + FSDP2 + TIDE.

    python examples/finetune_lightning.py                  # every GPU (CUDA transport), or 2 CPU processes
    python examples/finetune_lightning.py --compare-stock  # stock FSDP2 first, then TIDE, side by side
    python examples/finetune_lightning.py --model-path /path/to/llama  # local Hugging Face weights

With fewer GPUs than ``--devices`` (default: the GPU count, at least 2) the ranks share the GPUs:
the script starts them itself over gloo with ``TIDE_SHARE_GPUS=1`` (see ``launch_ranks_sharing_gpus``).

The only TIDE-specific line is the strategy: ``Trainer(strategy=TIDEFSDPStrategy(mode="in_place"))``
(or ``strategy="tide_fsdp"`` after ``import tide_lightning``). ``TIDE_ENABLED=0`` runs the same
strategy on stock FSDP2 collectives (its row reads "tide (off)").
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightning as L  # noqa: E402
from common import (
    HelpFormatter,
    Meter,
    add_common_args,
    batch_iterator,
    build_model,  # noqa: E402
    comparison_table,
    encode_corpus,
    launch_ranks_sharing_gpus,
    ranks_share_gpus,
    tide_is_on,
)
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from tide_core.fsdp.autoshard import shard_model  # noqa: E402
from tide_lightning import TIDEFSDPStrategy  # noqa: E402


class TokenStream(torch.utils.data.IterableDataset):
    def __init__(self, tokens, seq_len, batch_size, seed, rank, steps):
        self.args = (tokens, seq_len, batch_size)
        self.seed, self.rank, self.steps = seed, rank, steps

    def __iter__(self):
        stream = batch_iterator(*self.args, seed=self.seed, rank=self.rank)
        for _ in range(self.steps):
            yield next(stream)


class CausalLM(L.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model = None
        self.meter = None

    def configure_model(self):
        if self.model is not None:  # Lightning may call this again (validate/test)
            return
        self.model = build_model(self.args)
        bf16 = self.args.precision == "bf16"
        shard_model(
            self.model,
            self.device_mesh["data_parallel"],
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )

    def train_dataloader(self):
        tokens = encode_corpus(self.args)
        data = TokenStream(
            tokens, self.args.seq_len, self.args.batch_size, self.args.seed, self.global_rank, self.args.steps
        )
        return torch.utils.data.DataLoader(data, batch_size=None)

    def on_train_start(self):
        self.meter = Meter(self.args.seq_len * self.args.batch_size * self.trainer.world_size)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        metrics = self.meter.step(loss.item())
        self.log_dict({"loss": metrics["loss"], "tok/s": metrics["tokens_per_s"]}, prog_bar=True, batch_size=1)
        self.log("peak_mem_gib", metrics["peak_mem_gib"], batch_size=1)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.args.lr)


def run(args, strategy, name: str) -> dict:
    L.seed_everything(args.seed, verbose=False)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    # Ranks sharing GPUs were started one per "node" (launch_ranks_sharing_gpus)
    devices, nodes = (1, args.devices) if ranks_share_gpus(args) else (args.devices, 1)
    if nodes > 1 and not torch.distributed.is_initialized():
        # gloo without a bound device (Lightning would bind one): torch's DeviceMesh then builds its
        # groups with new_group, since splitting a device-bound gloo group fails on torch 2.11
        # ("cannot pickle ... _Options"). Lightning uses a process group that already exists.
        torch.distributed.init_process_group("gloo", rank=int(os.environ["NODE_RANK"]), world_size=args.devices)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=nodes,
        strategy=strategy,
        max_steps=args.steps,
        logger=CSVLogger(args.log_dir, name=name),
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        use_distributed_sampler=False,
    )
    module = CausalLM(args)
    trainer.fit(module)
    if args.save_checkpoint and name == "tide":
        trainer.save_checkpoint(args.save_checkpoint)
    handle = getattr(trainer.strategy, "tide_handle", None)
    if handle is not None and not tide_is_on(handle):
        name += " (off)"  # TIDE_ENABLED=0: the TIDE strategy on stock collectives
    summary = module.meter.summary(name, handle)
    # Free this run's model and optimizer so a following run's peak memory is its own.
    del trainer, module
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return summary


def main(argv=None) -> int:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter))
    parser.add_argument("--log-dir", default="runs/lightning", help="Lightning's CSV logs (tide/* metrics per step)")
    parser.add_argument("--save-checkpoint", default=None, help="save a (distributed) checkpoint of the TIDE run here")
    args = parser.parse_args(argv)
    shared = ranks_share_gpus(args)
    if shared and "LOCAL_RANK" not in os.environ:
        return launch_ranks_sharing_gpus(args, [os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)])
    backend = {"process_group_backend": "gloo"} if shared else {}  # NCCL refuses two ranks on one GPU
    rows = []
    if args.compare_stock:
        stock = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1, **backend)
        rows.append(run(args, stock, "stock"))
    rows.append(run(args, TIDEFSDPStrategy(mode=args.mode, transport=args.transport, **backend), "tide"))
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and os.environ.get("NODE_RANK", "0") == "0":
        print(comparison_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
