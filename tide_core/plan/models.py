"""Parameter shapes of public model configs, grouped the way FSDP2 wraps them (one group per block).

Sources: the models' published config.json files (hidden sizes, head counts, vocabularies) and
their reference implementations' parameter layouts. MoE experts are grouped 3-D weights
(experts x out x in), as torchtitan and transformers store them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tide_core.errors import PlanError


@dataclass(frozen=True)
class GroupShapes:
    name: str
    count: int
    params: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [shape for _, shape in self.params]


@dataclass(frozen=True)
class ModelShapes:
    name: str
    groups: tuple[GroupShapes, ...]

    @property
    def num_params(self) -> int:
        total = 0
        for g in self.groups:
            for _, shape in g.params:
                n = 1
                for d in shape:
                    n *= d
                total += n * g.count
        return total


def _attention(hidden: int, heads: int, kv_heads: int, head_dim: int) -> tuple:
    return (
        ("attention_norm", (hidden,)),
        ("wq", (heads * head_dim, hidden)),
        ("wk", (kv_heads * head_dim, hidden)),
        ("wv", (kv_heads * head_dim, hidden)),
        ("wo", (hidden, heads * head_dim)),
    )


def _lm(name: str, block: GroupShapes, hidden: int, vocab: int) -> ModelShapes:
    return ModelShapes(
        name,
        (
            GroupShapes("embed", 1, (("tok_embeddings", (vocab, hidden)),)),
            block,
            GroupShapes("final", 1, (("norm", (hidden,)), ("output", (vocab, hidden)))),
        ),
    )


def llama(
    name: str, *, hidden: int, intermediate: int, heads: int, kv_heads: int, layers: int, vocab: int
) -> ModelShapes:
    block = GroupShapes(
        "block",
        layers,
        _attention(hidden, heads, kv_heads, hidden // heads)
        + (
            ("ffn_norm", (hidden,)),
            ("w1", (intermediate, hidden)),
            ("w3", (intermediate, hidden)),
            ("w2", (hidden, intermediate)),
        ),
    )
    return _lm(name, block, hidden, vocab)


def qwen3_moe(
    name: str,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    moe_intermediate: int,
    experts: int,
    vocab: int,
) -> ModelShapes:
    block = GroupShapes(
        "block",
        layers,
        _attention(hidden, heads, kv_heads, head_dim)
        + (
            ("q_norm", (head_dim,)),
            ("k_norm", (head_dim,)),
            ("ffn_norm", (hidden,)),
            ("router", (experts, hidden)),
            ("experts.w1", (experts, moe_intermediate, hidden)),
            ("experts.w3", (experts, moe_intermediate, hidden)),
            ("experts.w2", (experts, hidden, moe_intermediate)),
        ),
    )
    return _lm(name, block, hidden, vocab)


def wan_dit(
    name: str,
    *,
    dim: int,
    ffn_dim: int,
    layers: int,
    text_dim: int,
    freq_dim: int,
    in_dim: int,
    out_dim: int,
    patch: tuple[int, int, int],
) -> ModelShapes:
    def attn(prefix: str):
        out = []
        for proj in ("q", "k", "v", "o"):
            out += [(f"{prefix}.{proj}.weight", (dim, dim)), (f"{prefix}.{proj}.bias", (dim,))]
        return out + [(f"{prefix}.norm_q.weight", (dim,)), (f"{prefix}.norm_k.weight", (dim,))]

    block = GroupShapes(
        "block",
        layers,
        tuple(
            attn("self_attn")
            + attn("cross_attn")
            + [
                ("norm3.weight", (dim,)),
                ("norm3.bias", (dim,)),
                ("ffn.0.weight", (ffn_dim, dim)),
                ("ffn.0.bias", (ffn_dim,)),
                ("ffn.2.weight", (dim, ffn_dim)),
                ("ffn.2.bias", (dim,)),
                ("modulation", (1, 6, dim)),
            ]
        ),
    )
    patch_elems = patch[0] * patch[1] * patch[2]
    root = GroupShapes(
        "root",
        1,
        (
            ("patch_embedding.weight", (dim, in_dim, *patch)),
            ("patch_embedding.bias", (dim,)),
            ("text_embedding.0.weight", (dim, text_dim)),
            ("text_embedding.0.bias", (dim,)),
            ("text_embedding.2.weight", (dim, dim)),
            ("text_embedding.2.bias", (dim,)),
            ("time_embedding.0.weight", (dim, freq_dim)),
            ("time_embedding.0.bias", (dim,)),
            ("time_embedding.2.weight", (dim, dim)),
            ("time_embedding.2.bias", (dim,)),
            ("time_projection.1.weight", (6 * dim, dim)),
            ("time_projection.1.bias", (6 * dim,)),
            ("head.head.weight", (out_dim * patch_elems, dim)),
            ("head.head.bias", (out_dim * patch_elems,)),
            ("head.modulation", (1, 2, dim)),
        ),
    )
    return ModelShapes(name, (root, block))


MODELS: dict[str, ModelShapes] = {
    "llama3.1-8b": llama(
        "Llama-3.1-8B", hidden=4096, intermediate=14336, heads=32, kv_heads=8, layers=32, vocab=128256
    ),
    "llama3.1-70b": llama(
        "Llama-3.1-70B", hidden=8192, intermediate=28672, heads=64, kv_heads=8, layers=80, vocab=128256
    ),
    "llama3.1-405b": llama(
        "Llama-3.1-405B", hidden=16384, intermediate=53248, heads=128, kv_heads=8, layers=126, vocab=128256
    ),
    "qwen3-30b-a3b": qwen3_moe(
        "Qwen3-30B-A3B",
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        moe_intermediate=768,
        experts=128,
        vocab=151936,
    ),
    "wan2.2-a14b": wan_dit(
        "Wan2.2-T2V-A14B (one expert)",
        dim=5120,
        ffn_dim=13824,
        layers=40,
        text_dim=4096,
        freq_dim=256,
        in_dim=16,
        out_dim=16,
        patch=(1, 2, 2),
    ),
}
ALIASES = {
    "llama3-8b": "llama3.1-8b",
    "llama-3.1-8b": "llama3.1-8b",
    "llama3-70b": "llama3.1-70b",
    "llama-3.1-70b": "llama3.1-70b",
    "llama3-405b": "llama3.1-405b",
    "llama-3.1-405b": "llama3.1-405b",
    "qwen3-30b": "qwen3-30b-a3b",
    "wan2.2": "wan2.2-a14b",
    "wan2.2-14b": "wan2.2-a14b",
}


def get_model(name: str) -> ModelShapes:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise PlanError(f"model={name!r} is unknown; choose one of {sorted(MODELS) + sorted(ALIASES)}")
    return MODELS[key]


def load_shapes_file(path: str | Path) -> ModelShapes:
    """JSON: either a list of shapes (one group) or
    {"name": ..., "groups": [{"name": ..., "count": n, "shapes": [[D, ...], ...]}, ...]}."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"shapes file {str(path)!r} cannot be read as JSON: {exc}") from exc
    if isinstance(data, list):
        data = {"name": path.stem, "groups": [{"name": "group", "count": 1, "shapes": data}]}
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list) or not data["groups"]:
        raise PlanError(f"shapes file {str(path)!r} needs a non-empty 'groups' list or a list of shapes")
    groups = []
    for i, g in enumerate(data["groups"]):
        shapes = g.get("shapes")
        if not isinstance(shapes, list) or not shapes:
            raise PlanError(f"shapes file {str(path)!r}: groups[{i}] needs a non-empty 'shapes' list")
        count = g.get("count", 1)
        if not isinstance(count, int) or count < 1:
            raise PlanError(f"shapes file {str(path)!r}: groups[{i}].count={count!r} must be an integer >= 1")
        params = tuple(
            (f"p{j}", tuple(int(d) for d in ([s] if isinstance(s, int) else s))) for j, s in enumerate(shapes)
        )
        groups.append(GroupShapes(str(g.get("name", f"group{i}")), count, params))
    return ModelShapes(str(data.get("name", path.stem)), tuple(groups))
