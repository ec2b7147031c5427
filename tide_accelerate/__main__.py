"""``python -m tide_accelerate launch ...``: the same as the ``tide-accelerate`` command."""

import sys

from tide_accelerate import main

sys.exit(main())
