"""``python -m tide_core doctor``: what this machine offers TIDE, for bug reports and for finding out
why a group keeps stock collectives (like ``python -m torch.utils.collect_env``).

It reports torch and whether TIDE serves it, tide_core._C (present, architectures, CUDA runtime vs
driver), the GPUs with their P2P access matrix and stream memory operations, NCCL and the multicast
settings, which transports and rails can run here, and the TIDE_* settings in effect. It only
reads: nothing is installed, no process group is created. Exit code 0 whatever it finds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

import tide_core
from tide_core.config import OTHER_ENV_VARS, TIDEConfig, env_var
from tide_core.fsdp import profiles
from tide_core.runtime import native
from tide_core.transport import TRANSPORTS
from tide_core.transport.availability import cuda_gpus_visible, cuda_version_text, native_unavailable_reason
from tide_core.transport.rail import RAILS, nccl_version

#: Variables that switch NVLink multicast (NVLS) off in NCCL, torch's symmetric memory and NVSHMEM.
MULTICAST_ENV_VARS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def _torch_section() -> dict:
    internals, reason = profiles.probe()
    held_to = profiles.profile_version()
    info = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "supported": [f"{major}.{minor}" for major, minor in profiles.SUPPORTED_VERSIONS],
        "newest_tested": "{}.{}".format(*profiles.SUPPORTED_VERSIONS[-1]),
        "served": internals is not None,
        "reason": reason,
    }
    if internals is not None:
        info["how"] = "foreach_all_gather and foreach_reduce replaced; all-gather copy-out through " + (
            "FSDPParamGroup._all_gather_output_fn" if internals.profile.copy_out_hook else "foreach_all_gather_copy_out"
        )
        if held_to != profiles.torch_version():
            info["how"] += (
                f"; newer than the newest tested torch ({info['newest_tested']}), whose FSDP2 it matches "
                "exactly: served as that version, untested"
            )
    return info


def _native_section() -> dict:
    error = native.load_error()
    info: dict = {"present": error is None, "error": error, "problem": native_unavailable_reason()}
    if error is None:
        lib = native.lib()
        build = lib.build_info()
        driver = lib.driver_version()
        info.update(
            architectures=build["architectures"].split(","),
            compiler=build["compiler"],
            cuda_runtime=cuda_version_text(build["cuda_runtime"]),
            cuda_driver=cuda_version_text(driver) if driver else None,
        )
    return info


def _gpu_section(native_ok: bool) -> dict:
    if not cuda_gpus_visible():
        return {"count": 0, "devices": [], "p2p": [], "stream_memops": None, "tma": None}
    count = torch.cuda.device_count()
    devices = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
            }
        )
    p2p = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(count)] for i in range(count)]
    memops = tma = None
    if native_ok:
        lib = native.lib()
        memops = lib.stream_memops_available()
        with torch.cuda.device(0):
            tma = lib.tma_available()
    return {"count": count, "devices": devices, "p2p": p2p, "stream_memops": memops, "tma": tma}


def _transports(native_info: dict, gpus: dict, nccl) -> dict:
    """Whether each transport and rail can run on this machine, and if not, why."""
    cuda = None
    if gpus["count"] == 0:
        cuda = "no CUDA GPU is visible"
    elif native_info["problem"]:
        cuda = native_info["problem"]
    elif not gpus["stream_memops"]:
        cuda = "the CUDA driver does not provide stream memory operations (cuStreamBatchMemOp)"
    reference = None if torch.distributed.is_available() else "torch was built without torch.distributed"
    transports = {"reference": reference, "cuda": cuda}
    rails = {}
    for rail in RAILS:
        if rail == "auto":
            continue
        if cuda is not None:
            rails[rail] = f"the CUDA transport cannot run: {cuda}"
        elif rail == "p2p":
            peers = all(all(row) for row in gpus["p2p"])
            rails[rail] = None if peers else "not every pair of GPUs has P2P access (see the P2P matrix)"
        else:
            rails[rail] = None if nccl is not None else "torch has no NCCL"
    assert set(transports) == set(TRANSPORTS) - {"auto"}
    return {
        kind: {name: {"available": reason is None, "reason": reason} for name, reason in found.items()}
        for kind, found in (("transports", transports), ("rails", rails))
    }


def _sharing(environ, gpus: dict) -> dict:
    """How the CUDA transport treats ranks that share a GPU (``share_gpus``), as set here."""
    try:
        enabled = TIDEConfig.from_env(environ=environ).share_gpus
    except ValueError as exc:  # a bad TIDE_* value is the tide_env section's to show
        return {"share_gpus": None, "meaning": str(exc)}
    if enabled:
        meaning = (
            "ranks of a group that share a GPU map their arenas through CUDA IPC (gloo between them; "
            "timings are no speed-up figure); the nccl rail is refused there"
        )
    else:
        meaning = "groups whose ranks share a GPU raise (transport='cuda') or keep stock collectives ('auto')"
    if gpus["count"] == 1:
        meaning += "; one GPU here: more than one rank per node shares it (TIDE_SHARE_GPUS=1 serves them)"
    return {"share_gpus": enabled, "meaning": meaning}


def _tide_env(environ) -> dict:
    known = {env_var(name) for name in TIDEConfig.names()} | set(OTHER_ENV_VARS)
    tide = sorted((key, value) for key, value in environ.items() if key.startswith("TIDE_"))
    return {key: {"value": value, "known": key in known} for key, value in tide}


def collect(environ=None) -> dict:
    """Everything the doctor reports, as a JSON-ready dict."""
    environ = os.environ if environ is None else environ
    native_info = _native_section()
    gpus = _gpu_section(native_info["problem"] is None)
    nccl = nccl_version() if torch.distributed.is_nccl_available() else None
    return {
        "tide": {"version": tide_core.__version__, "location": os.path.dirname(tide_core.__file__)},
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": _torch_section(),
        "tide_core._C": native_info,
        "gpus": gpus,
        "nccl": {
            "version": ".".join(map(str, nccl)) if nccl else None,
            "multicast_settings": {name: environ.get(name) for name in MULTICAST_ENV_VARS},
        },
        **_transports(native_info, gpus, nccl),
        "ranks_sharing_a_gpu": _sharing(environ, gpus),
        "tide_env": _tide_env(environ),
    }


def _can(entry: dict) -> str:
    return "yes" if entry["available"] else f"no: {entry['reason']}"


def render(report: dict) -> str:
    t, c, g, n = report["torch"], report["tide_core._C"], report["gpus"], report["nccl"]
    adapter = f"serves it ({t['how']})" if t["served"] else f"stock collectives: {t['reason']}"
    lines = [
        f"TIDE {report['tide']['version']} ({report['tide']['location']})",
        f"Python {report['python']} on {report['platform']}",
        "",
        f"torch {t['version']} (CUDA {t['cuda'] or 'none: CPU build'}); TIDE was tested on {', '.join(t['supported'])}",
        f"  TIDE's FSDP2 adapter: {adapter}",
        "",
    ]
    if c["present"]:
        lines += [
            f"tide_core._C: built by nvcc {c['compiler']} for sm_{', sm_'.join(c['architectures'])}",
            f"  CUDA runtime {c['cuda_runtime']} (linked statically); "
            + (f"the driver supports CUDA {c['cuda_driver']}" if c["cuda_driver"] else "no NVIDIA driver"),
        ]
        if c["problem"]:
            lines.append(f"  problem: {c['problem']}")
    else:
        lines.append(f"tide_core._C: {c['error']}")
    lines += ["", f"GPUs: {g['count']}"]
    for d in g["devices"]:
        lines.append(f"  {d['index']}: {d['name']}, compute capability {d['capability']}, {d['memory_gib']} GiB")
    if g["count"]:
        lines.append("  P2P access (row reads column): " + ("" if g["count"] <= 16 else "(first 16)"))
        for i, row in enumerate(g["p2p"][:16]):
            lines.append(f"    {i:>2}: " + " ".join("Y" if ok else "." for ok in row[:16]))
        lines.append(f"  stream memory operations: {g['stream_memops']}; TMA sum kernels: {g['tma']}")
    lines += [
        "",
        f"NCCL: {n['version'] or 'not available'}",
        "  multicast settings: "
        + ", ".join(f"{k}={v if v is not None else '(unset)'}" for k, v in n["multicast_settings"].items()),
        "",
        "transports:",
    ]
    lines += [f"  {name}: {_can(entry)}" for name, entry in report["transports"].items()]
    lines.append("rails (multi-node groups):")
    lines += [f"  {name}: {_can(entry)}" for name, entry in report["rails"].items()]
    sharing = report["ranks_sharing_a_gpu"]
    lines.append(f"ranks sharing a GPU (share_gpus={sharing['share_gpus']}): {sharing['meaning']}")
    lines += ["", "TIDE_* settings in effect:" if report["tide_env"] else "TIDE_* settings in effect: none"]
    for key, entry in report["tide_env"].items():
        lines.append(f"  {key}={entry['value']}" + ("" if entry["known"] else "  (not a TIDE setting: ignored)"))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tide_core doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
