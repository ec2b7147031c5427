"""Run PyTorch's own FSDP2 tests against TIDE: stock, then TIDE in_place, then slot_reuse.

    python scripts/upstream_fsdp_tests.py PYTORCH_CHECKOUT [--file test_fully_shard_training.py]
        [-k EXPR] [--modes stock,in_place,slot_reuse] [--out table.md] [--cpu-bodies NAME ...]
        [--world-size N] [--cuda-to-cpu [--sub OLD NEW ...]]

PYTORCH_CHECKOUT is a PyTorch source tree at the tag of the installed torch (this script fetches
nothing). For each mode it writes a wrapper module in a temporary folder that subclasses every
test class of the upstream file under the same name, so the ranks FSDPTest spawns import the
wrapper, and with it the patch below. torch 2.13's ``FSDPTest._run`` skips every CPU run
(``torch.accelerator.device_count() < world_size``); the wrappers use ``FSDPTestMixin._run``, the
same steps with the CPU exemption. In the TIDE modes,
``FSDPState._lazy_init`` (run by each root's first forward, on every rank) is wrapped to call
``tide_core.install(root, mode=..., transport="reference")`` right after FSDP2's own lazy init,
i.e. before the first all-gather. Every install appends its served-group count and fallback
reasons to a log, so the table says, per test, whether TIDE served groups or fell back, and why.

``--cpu-bodies CLASS.METHOD:SUBTESTS`` also runs the body of a GPU-only upstream test on CPU,
as a ``run_subtests`` over the given JSON dict of subtest values (``_test_*`` method bodies; a
value ``"py:EXPR"`` is evaluated in the upstream module, e.g. a container type), or, with
``SUBTESTS`` = ``unwrap``, the test method itself without its skip decorators;
``CLASS.test_NAME@_BODY:SUBTESTS`` runs body ``_BODY`` under a test name of its own. ``--world-size``
sets every test class's rank count (on CPU the upstream ones count devices: 0 or 1);
``--cuda-to-cpu`` imports a copy of the file whose hard-coded CUDA devices are replaced
(``CUDA_TO_CPU``, plus each ``--sub OLD NEW``); the upstream file itself is never changed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

PATCH = """
import json, os, sys
import torch.distributed.tensor.debug as _tensor_debug
sys.modules.setdefault("torch.distributed._tensor.debug", _tensor_debug)  # alias gone in torch 2.13
from torch.distributed.fsdp._fully_shard import _fsdp_state

_MODE = os.environ["UPSTREAM_FSDP_MODE"]
_LOG = os.environ["UPSTREAM_FSDP_LOG"]
_lazy_init = _fsdp_state.FSDPState._lazy_init


def _lazy_init_then_install(self, *args, **kwargs):
    out = _lazy_init(self, *args, **kwargs)
    if self._is_root and not getattr(self, "_tide_installed", False):
        import torch.distributed as dist
        import tide_core

        self._tide_installed = True
        handle = tide_core.install(self._modules[0], mode=_MODE, transport="reference")
        record = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0],
                  "rank": dist.get_rank(), "served": len(handle.served_groups),
                  "reasons": sorted({e.reason for e in handle.fallback_groups})}
        with open(_LOG, "a") as f:
            f.write(json.dumps(record) + "\\n")
    return out


if _MODE != "stock":
    _fsdp_state.FSDPState._lazy_init = _lazy_init_then_install
"""


def wrapper_source(test_dir: Path, module: str, cpu_bodies: list[str], world_size: int | None = None) -> str:
    lines = [
        "import sys, unittest",
        f"sys.path.insert(0, {str(test_dir)!r})",
        PATCH,
        f"import {module} as upstream",
        "from torch.testing._internal.common_fsdp import FSDPTest, FSDPTestMixin",
        "for _name, _cls in list(vars(upstream).items()):",
        "    if (isinstance(_cls, type) and issubclass(_cls, unittest.TestCase)\n"
        "            and _cls.__module__ == upstream.__name__):",
        "        _extra = {'__module__': __name__}",
        "        if issubclass(_cls, FSDPTest):  # torch 2.13's FSDPTest._run skips CPU runs; the mixin's does not",
        "            _extra['_run'] = FSDPTestMixin.__dict__['_run']",
        (
            f"        _extra['world_size'] = property(lambda self: {world_size})  # --world-size"
            if world_size
            else "        pass"
        ),
        "        globals()[_name] = type(_name, (_cls,), _extra)",
        "del _name, _cls, _extra  # not test classes of their own",
    ]
    for spec in cpu_bodies:
        target, subtests = spec.split(":", 1)
        cls, method = target.split(".")
        method, _, body = method.partition("@")  # CLASS.test_NAME@_BODY: a test name of one's own over a named body
        body = body or method.replace("test_", "_test_", 1)
        if subtests == "unwrap":  # the test method itself, without its skip decorators
            lines += [
                f"def _cpu_{method}(self):",
                "    import inspect",
                f"    return inspect.unwrap(getattr(upstream.{cls}, {method!r}))(self)",
                f"setattr(globals()[{cls!r}], 'test_cpu_body_{method[5:]}', _cpu_{method})",
            ]
            continue
        lines += [
            f"def _cpu_{method}(self, _body={body!r}, _subtests={subtests!r}):",
            "    import json",
            "    _values = {k: [eval(v[3:], vars(upstream)) if isinstance(v, str) and v.startswith('py:') else v"
            " for v in vs] for k, vs in json.loads(_subtests).items()}  # 'py:EXPR': a Python value such as a type",
            "    self.run_subtests(_values, getattr(self, _body))",
            f"setattr(globals()[{cls!r}], 'test_cpu_body_{method[5:]}', _cpu_{method})",
        ]
    return "\n".join(lines) + "\n"


CUDA_TO_CPU = [
    ('"cuda"', '"cpu"'),
    (".cuda()", ".cpu()"),
    ("torch.cuda.device_count()", "2"),
    ("device_ids=[self.rank]", "device_ids=None"),
]  # DDP on CPU modules takes no device_ids


def run_mode(
    mode: str,
    test_file: Path,
    k: str | None,
    cpu_bodies: list[str],
    workdir: Path,
    world_size: int | None = None,
    cuda_to_cpu: bool = False,
    subs: list | None = None,
) -> dict:
    module = test_file.stem
    test_dir = test_file.parent
    if cuda_to_cpu:  # import a copy of the upstream file with its hard-coded CUDA device strings on CPU
        test_dir = workdir / "cpu_src"
        test_dir.mkdir(exist_ok=True)
        source = test_file.read_text()
        for old, new in CUDA_TO_CPU + [tuple(x) for x in (subs or [])]:  # --sub OLD NEW: extra replacements
            source = source.replace(old, new)
        (test_dir / test_file.name).write_text(source)
    wrapper = workdir / f"tide_upstream_{mode}_{module}.py"
    wrapper.write_text(wrapper_source(test_dir, module, cpu_bodies, world_size))
    log = workdir / f"{mode}.installs.jsonl"
    log.write_text("")
    xml = workdir / f"{mode}.xml"
    env = dict(os.environ, UPSTREAM_FSDP_MODE=mode, UPSTREAM_FSDP_LOG=str(log))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(wrapper), f"--junitxml={xml}"]
    if k:
        cmd += ["-k", k]
    subprocess.run(cmd, cwd=workdir, env=env, check=False)
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname').split('.')[-1]}.{case.get('name')}"
        status = "pass"
        for child in case:
            if child.tag in ("failure", "error"):
                message = (child.get("message") or child.text or "").strip().splitlines()
                if message and message[0].startswith("RuntimeError: Process"):  # a rank's exception: its own line
                    inner = [
                        m
                        for m in (child.text or "").splitlines()
                        if re.match(r"E?\s*[\w.]*(Error|Exception)\b:", m) and "exited with error code" not in m
                    ]
                    inner = [re.sub(r"^E\s+", "", m) for m in inner]
                    message = [inner[0].strip()] if inner else message
                status = "fail: " + (message[0][:160] if message else child.tag)
            elif child.tag == "skipped":
                status = "skip: " + (child.get("message") or "")[:80]
        outcomes[name] = status
    installs: dict = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        test = record["test"].split("::")
        key = f"{test[-2]}.{test[-1]}" if len(test) >= 2 else record["test"]
        entry = installs.setdefault(key, {"served": 0, "installs": 0, "reasons": set()})
        entry["served"] += record["served"]
        entry["installs"] += 1
        entry["reasons"].update(record["reasons"])
    return {"outcomes": outcomes, "installs": installs}


def cell(mode: str, name: str, results: dict) -> str:
    status = results[mode]["outcomes"].get(name, "not run")
    if mode == "stock" or not status.startswith("pass"):
        return status
    info = results[mode]["installs"].get(name)
    if info is None:
        return "pass (no FSDP2 root installed)"
    if info["served"] == 0:
        reasons = "; ".join(sorted(info["reasons"]))
        return f"fallback: {reasons}" if reasons else "pass (the model has no parameter group)"
    fallback = f"; some groups fall back: {'; '.join(sorted(info['reasons']))}" if info["reasons"] else ""
    return f"pass (TIDE served {info['served']} group(s) over {info['installs']} rank-installs{fallback})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pytorch", type=Path, help="PyTorch source checkout at the installed torch's tag")
    parser.add_argument("--file", default="test_fully_shard_training.py")
    parser.add_argument("-k", default=None, help="pytest -k selection")
    parser.add_argument("--modes", default="stock,in_place,slot_reuse")
    parser.add_argument("--cpu-bodies", nargs="*", default=[], help="CLASS.test_METHOD:JSON_SUBTESTS")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="override every test class's world_size (CPU: device_count() is 0 or 1)",
    )
    parser.add_argument(
        "--cuda-to-cpu",
        action="store_true",
        help='import a copy of the file with "cuda" -> "cpu", .cuda() -> .cpu(), '
        "torch.cuda.device_count() -> 2, device_ids=[self.rank] -> device_ids=None",
    )
    parser.add_argument(
        "--sub",
        nargs=2,
        action="append",
        default=[],
        metavar=("OLD", "NEW"),
        help="with --cuda-to-cpu: one more source replacement (repeatable)",
    )
    args = parser.parse_args()
    test_file = args.pytorch / "test" / "distributed" / "_composable" / "fsdp" / args.file
    if not test_file.is_file():
        sys.exit(f"{test_file} does not exist: pass the root of a PyTorch checkout")
    modes = args.modes.split(",")
    results = {}
    with tempfile.TemporaryDirectory(prefix="tide_upstream_") as tmp:
        for mode in modes:
            results[mode] = run_mode(
                mode, test_file, args.k, args.cpu_bodies, Path(tmp), args.world_size, args.cuda_to_cpu, args.sub
            )
    names = sorted({n for r in results.values() for n in r["outcomes"]})
    table = [f"| test ({args.file}) | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    table += [f"| {n} | " + " | ".join(cell(m, n, results).replace("|", "/") for m in modes) + " |" for n in names]
    text = "\n".join(table)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
