"""``kvfs.direct``: the public name engine configurations use; the module lives in
:mod:`kvfs.client.direct` and this name is that same module object."""

import sys

from kvfs.client import direct as _module
from kvfs.client.direct import *  # noqa: F403  (what type checkers see)

sys.modules[__name__] = _module
