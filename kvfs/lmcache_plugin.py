"""``kvfs.lmcache_plugin``: the public name engine configurations use; the module lives in
:mod:`kvfs.client.lmcache` and this name is that same module object."""

import sys

from kvfs.client import lmcache as _module
from kvfs.client.lmcache import *  # noqa: F403  (what type checkers see)

sys.modules[__name__] = _module
