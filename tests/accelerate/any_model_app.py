"""A plain Accelerate training loop on a non-Llama Hugging Face model, with a tracker (TIDE only reports).

    tide-accelerate launch --config_file examples/accelerate/tide.yaml -m tests.accelerate.any_model_app ARCH OUT_DIR

ARCH: gpt2 | qwen2 (tiny random-init configs). Each process writes OUT_DIR/rank<R>.json with what TIDE
served and its loss; the tracker writes every logged value to OUT_DIR/tracker.jsonl (main process).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker


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
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(
            Qwen2Config(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=97,
                max_position_embeddings=64,
                tie_word_embeddings=False,
            )
        )
    raise SystemExit(f"unknown arch {arch!r}")


def main(arch: str, out_dir: str, steps: int = 3) -> None:
    from tide_core.fsdp.adapter import get_handle

    accelerator = Accelerator(log_with=[JsonLinesTracker(os.path.join(out_dir, "tracker.jsonl"))])
    accelerator.init_trackers("any-model")
    model = build(arch)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batch = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(accelerator.process_index))
    losses = []
    for _ in range(steps):  # the same batch each step: the loss must fall
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
        "blocks": blocks,
        "stats": handle.stats(),
        "losses": losses,
        "distributed_type": accelerator.distributed_type.value,
    }
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see test_accelerate.py's module end: CPU processes sometimes abort in interpreter shutdown
