"""``python -m tide_core doctor [--json]``: what this machine offers TIDE (tide_core.doctor)."""

from __future__ import annotations

import sys

USAGE = "usage: python -m tide_core doctor [--json]"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "doctor":
        print(USAGE, file=sys.stderr)
        return 2
    from tide_core.doctor import main as doctor

    return doctor(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
