"""Run a training script with TIDE enabled, unchanged:

    accelerate launch --config_file fsdp2.yaml [options] -m tide_accelerate.run train.py [args]
    accelerate launch --config_file fsdp2.yaml [options] -m tide_accelerate.run -m package.train [args]

``tide-accelerate launch`` builds this command for you. TIDE's settings come from the ``TIDE_*``
environment variables (``accelerate launch`` passes them on to every process).
"""

from __future__ import annotations

import os
import runpy
import sys

from tide_accelerate.plugin import enable

USAGE = "usage: python -m tide_accelerate.run (script.py | -m module) [args ...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_module = argv[:1] == ["-m"]
    if as_module:
        argv = argv[1:]
    if not argv:
        sys.exit(USAGE)
    enable()
    target = argv[0]
    sys.argv = argv
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # What `python train.py` would put first on the path (here it is the launch directory).
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
