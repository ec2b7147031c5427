"""For scripts/setup_env's lean torch: the stored torch wheel that fits this interpreter, and its
requirements split into the CUDA libraries torch loads at import and everything else.

    python scripts/torch_requirements.py WHEEL_STORE 'torch==2.12.1'

prints ``wheel PATH``, then ``req REQUIREMENT`` and ``cuda REQUIREMENT`` lines (markers evaluated
for this interpreter). triton and cuda-bindings are left out: torch does not load them at import.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

NOT_LOADED_AT_IMPORT = ("triton", "cuda-bindings")


def main(store: Path, spec: Requirement) -> int:
    supported = set(sys_tags())
    found = []
    for path in store.glob("torch-*.whl"):
        _, version, _, tags = parse_wheel_filename(path.name)
        if spec.specifier.contains(version) and tags & supported:
            found.append((version, path))
    if not found:
        print(f"torch_requirements: no {spec} wheel for this interpreter in {store}", file=sys.stderr)
        return 1
    wheel = max(found)[1]  # a local CPU build (+cpu) sorts above the plain release
    print("wheel", wheel)
    with zipfile.ZipFile(wheel) as whl:
        metadata = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        lines = whl.read(metadata).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line.removeprefix("Requires-Dist: "))
        if (req.marker is not None and not req.marker.evaluate({"extra": ""})) or req.name in NOT_LOADED_AT_IMPORT:
            continue
        req.marker = None
        print("cuda" if req.name.startswith(("nvidia-", "cuda-")) else "req", req)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Requirement(sys.argv[2])))
