"""``kvfs.sglang_storage``: the public name engine configurations use; the module lives in
:mod:`kvfs.client.sglang` and this name is that same module object."""

import sys

from kvfs.client import sglang as _module
from kvfs.client.sglang import *  # noqa: F403  (what type checkers see)

sys.modules[__name__] = _module
