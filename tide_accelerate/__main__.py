"""``python -m tide_accelerate launch ...``: the same as the ``tide-accelerate`` command."""

import sys

from tide_accelerate.launch import main

sys.exit(main())
