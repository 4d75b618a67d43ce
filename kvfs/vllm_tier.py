"""``kvfs.vllm_tier``: the public name vLLM configurations use
(``{"type": "KvfsTier", "module_path": "kvfs.vllm_tier"}``); the module lives in
:mod:`kvfs.client.vllm` and this name is that same module object."""

import sys

from kvfs.client import vllm as _module
from kvfs.client.vllm import *  # noqa: F403  (what type checkers see)

sys.modules[__name__] = _module
