"""A plain Accelerate training loop on Hugging Face models, with a tracker (TIDE only reports).

    tide-accelerate launch --config_file examples/accelerate/tide.yaml -m tests.accelerate.any_model_app ARCHS OUT_DIR

ARCHS: comma-separated gpt2 | llama | qwen2 (tiny random-init configs, no download), trained one
after the other by one Accelerator. Each process writes OUT_DIR/rank<R>.json with, per arch, what
TIDE served, the dtypes FSDP2 used, the losses and a digest of the final parameter shards; the
tracker writes every logged value to OUT_DIR/tracker.jsonl (main process).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

STEPS = 3


class JsonLinesTracker(GeneralTracker):
    """Every ``accelerator.log`` call as one JSON line."""

    name = "jsonlines"
    requires_logging_directory = False

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    @property
    def tracker(self):
        return self.path

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=64, vocab_size=97))
    llama_like = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**llama_like))
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(**llama_like))
    raise SystemExit(f"unknown arch {arch!r}")


def digest(model: torch.nn.Module) -> str:
    """This rank's parameter shards, bit for bit."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().to_local().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train(accelerator: Accelerator, arch: str, fsdp_settings: dict) -> dict:
    from tide_core.fsdp import accessors
    from tide_core.fsdp.adapter import get_handle

    # prepare() writes the model's wrap classes (_no_split_modules) into the FSDP plugin: each model
    # starts from the launch's settings, as in a launch of its own.
    accelerator.state.fsdp_plugin.__dict__.update(copy.deepcopy(fsdp_settings))
    model = build(arch)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    first_linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    forward_dtypes = []
    first_linear.register_forward_hook(lambda m, args, out: forward_dtypes.append(str(m.weight.dtype)))
    batch = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(accelerator.process_index))
    losses = []
    for _ in range(STEPS):  # the same batch each step: the loss must fall
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    handle = get_handle(model)
    # fully_shard swaps each sharded module's class for a subclass (FSDPGPT2Block): look at the bases.
    blocks = [
        name for name, m in model.named_modules() if any(c.__name__ in model._no_split_modules for c in type(m).__mro__)
    ]
    result = {
        "served": [g.name for g in handle.served_groups],
        "groups": [e.name for e in handle.entries],
        "switched_off": all(e.reason == "TIDE is switched off (enabled=False)" for e in handle.entries),
        "blocks": blocks,
        "stats": handle.stats(),
        "losses": losses,
        "digest": digest(model),
        "forward_param": forward_dtypes[0],
        "reduce": sorted({str(accessors.reduce_dtype(pg)) for _, pg, _ in accessors.fsdp_param_groups(model)}),
    }
    del model, optimizer
    accelerator.free_memory()
    return result


def main(archs: str, out_dir: str) -> None:
    accelerator = Accelerator(log_with=[JsonLinesTracker(os.path.join(out_dir, "tracker.jsonl"))])
    accelerator.init_trackers("any-model")
    fsdp_settings = copy.deepcopy(accelerator.state.fsdp_plugin.__dict__)
    result = {
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "archs": {arch: train(accelerator, arch, fsdp_settings) for arch in archs.split(",")},
    }
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see test_accelerate.py's module end: CPU processes sometimes abort in interpreter shutdown
