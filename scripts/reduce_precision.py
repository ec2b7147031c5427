"""Error of a bf16/fp16 gradient reduce against an fp64 sum: stock FSDP2's reduce-scatter and TIDE's.

    python scripts/reduce_precision.py [--ranks 2,4,8] [--numel 262144] [--out table.md]

For each rank count, reduce dtype and gradient magnitude, every rank draws fresh random gradients
(normal, times the magnitude, already in the reduce dtype as FSDP2's copy-in leaves them) and both
reduces run on the same gloo ranks:

* stock: what ``foreach_reduce`` does, with FSDP2's own divide factors
  (``_get_gradient_divide_factors``: AVG for bf16, pre/post-divide for fp16), a reduce-scatter in the
  reduce dtype (gloo rounds at every step of its algorithm);
* TIDE: the reference transport's reduce-scatter (fp32 sums in TIDE's association order, the same
  divide folded the way the adapter folds it), rounded once to the reduce dtype.

Both are compared with the fp64 mean of the same values: the share of elements equal to the fp64
result rounded once to the reduce dtype (the best any reduce in that dtype can do), the largest
error in units in the last place of that dtype at the element's largest addend (a sum that cancels
to near zero is judged at the scale its roundings happened at), and the RMS error relative to the RMS of the
result; and the share of elements where stock's and TIDE's results are equal. Prints a markdown
table (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MAGNITUDES = {"bf16": (1e-6, 1.0, 1e4), "fp16": (1e-3, 1.0, 1e2)}


def _ulp(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each reference value (fp64; subnormals: the smallest spacing)."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    exponent = torch.floor(torch.log2(reference.abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(exponent - mantissa_bits)


def _errors(result: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> dict:
    best = reference.to(dtype)
    error = (result.double() - reference).abs()
    return {
        "exact": (result == best).double().mean().item(),
        "max_ulp": (error / _ulp(scale, dtype)).max().item(),
        "rel_rms": (error.square().mean().sqrt() / reference.square().mean().sqrt()).item(),
    }


def _stock(grad: torch.Tensor, group) -> torch.Tensor:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _div_if_needed, _get_gradient_divide_factors

    pre, post, op, _ = _get_gradient_divide_factors(group, None, grad.dtype, "cpu", None, False)
    flat = grad.reshape(-1).clone()
    out = torch.empty(flat.numel() // group.size(), dtype=grad.dtype)
    _div_if_needed(flat, pre)
    dist.reduce_scatter_tensor(out, flat, op=op, group=group)
    _div_if_needed(out, post)
    return out


def _tide(grad: torch.Tensor, transport, layout) -> torch.Tensor:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    group = transport.groups.group
    pre, post, op, _ = _get_gradient_divide_factors(group, None, grad.dtype, "cpu", None, False)
    # As the adapter does: the pre-divide on the gradient in its dtype, AVG folded into alpha, the
    # post-divide after the single rounding.
    source = grad / pre if pre not in (None, 1) else grad
    alpha = 1.0 / group.size() if op == dist.ReduceOp.AVG else 1.0
    out = torch.empty(layout.total_shard_numel, dtype=torch.float32)
    transport.reduce_scatter(layout, [source], out, alpha=alpha)
    result = out.to(grad.dtype)
    if post not in (None, 1):
        result.div_(post)
    return result


def _worker(rank: int, world_size: int, port: int, numel: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    from tide_core.plan import GroupLayout, Topology
    from tide_core.transport.reference import ReferenceTransport

    rows = numel // 64
    layout = GroupLayout.from_shapes([(rows, 64)], world_size=world_size)
    transport = ReferenceTransport(Topology.from_world_size(world_size, world_size), validate=False)
    shard = layout.shard_numel(0)
    for name, dtype in DTYPES.items():
        for magnitude in MAGNITUDES[name]:
            gen = torch.Generator().manual_seed(1000 * world_size + 7 * rank + int(magnitude * 1e6) % 997)
            grad = (torch.randn(rows, 64, generator=gen, dtype=torch.float64) * magnitude).to(dtype)
            everyone = [torch.empty_like(grad) for _ in range(world_size)]
            dist.all_gather(everyone, grad)
            mine = torch.stack([g.double().reshape(-1)[rank * shard : (rank + 1) * shard] for g in everyone])
            reference = mine.sum(0) / world_size
            scale = mine.abs().amax(0) / world_size  # the largest addend: where the roundings happen
            row = {"ranks": world_size, "dtype": name, "magnitude": magnitude}
            stock, tide = _stock(grad, dist.group.WORLD), _tide(grad, transport, layout)
            row["stock"], row["tide"] = (_errors(r, reference, scale, dtype) for r in (stock, tide))
            row["same"] = (stock == tide).double().mean().item()
            gathered = [None] * world_size
            dist.all_gather_object(gathered, row)
            if rank == 0:
                queue.put(gathered)
    transport.close()
    dist.destroy_process_group()


def _merge(rows: list[dict]) -> dict:
    """Over ranks: the mean exact share and relative RMS, the largest ulp error."""
    out = {k: rows[0][k] for k in ("ranks", "dtype", "magnitude")}
    out["same"] = sum(r["same"] for r in rows) / len(rows)
    for system in ("stock", "tide"):
        out[system] = {
            "exact": sum(r[system]["exact"] for r in rows) / len(rows),
            "max_ulp": max(r[system]["max_ulp"] for r in rows),
            "rel_rms": sum(r[system]["rel_rms"] for r in rows) / len(rows),
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--numel", type=int, default=1 << 18, help="gradient elements per rank")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    lines = [
        f"# Low-precision reduce: error against an fp64 sum ({datetime.date.today().isoformat()})",
        "",
        f"Machine: {platform.machine()} CPU, {os.cpu_count()} cores; torch {torch.__version__}, gloo. Command:"
        f" `python scripts/reduce_precision.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"({args.numel} gradient elements per rank, normal random times the magnitude, fresh per rank and case).",
        "",
        "exact: share of elements equal to the fp64 mean rounded once to the reduce dtype; max ulp: largest error",
        "in units in the last place of the reduce dtype at the element's largest addend / N; rel. RMS: RMS error /",
        "RMS of the mean; stock = TIDE: share of elements where both results are equal.",
        "",
        "| ranks | dtype | magnitude | stock exact | TIDE exact | stock max ulp | TIDE max ulp "
        "| stock rel. RMS | TIDE rel. RMS | stock = TIDE |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for world_size in (int(r) for r in args.ranks.split(",")):
        queue = ctx.SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [
            ctx.Process(target=_worker, args=(rank, world_size, port, args.numel, queue)) for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        results = [queue.get() for _ in range(sum(len(m) for m in MAGNITUDES.values()))]
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"a rank of the {world_size}-rank run exited with {p.exitcode}")
        for rows in results:
            r = _merge(rows)
            s, t = r["stock"], r["tide"]
            lines.append(
                f"| {r['ranks']} | {r['dtype']} | {r['magnitude']:g} | {s['exact']:.4f} | {t['exact']:.4f} "
                f"| {s['max_ulp']:.2f} | {t['max_ulp']:.2f} | {s['rel_rms']:.2e} | {t['rel_rms']:.2e} "
                f"| {r['same']:.4f} |"
            )
        print("\n".join(lines[-len(results) :]), flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
