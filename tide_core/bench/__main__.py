"""``python -m tide_core.bench``: see tide_core.bench.cli (workers must live in an importable module)."""

import sys

from tide_core.bench.cli import main

sys.exit(main())
