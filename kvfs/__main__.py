"""``python -m kvfs``."""

import sys

from kvfs.cli import main

sys.exit(main())
