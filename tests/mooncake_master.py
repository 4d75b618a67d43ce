"""A real Mooncake master on loopback for the tests (:class:`kvfs.testing.harness.MooncakeMaster`).

``mooncake_master`` comes from the ``mooncake-transfer-engine-non-cuda`` wheel (the
``cluster`` extra of kvfs, installed in the dev venv by ``make install``). It runs
with its built-in HTTP metadata server, so one process is the whole cluster's
control plane; every kvfs mount of a test is a client ("node") of it.
"""

from __future__ import annotations

import os

import pytest

from kvfs.testing.harness import LEASE_MS, free_port, master_binary, running_master
from kvfs.testing.harness import MooncakeMaster as Master

__all__ = ["LEASE_MS", "Master", "free_port", "require_mooncake", "running_master"]


def require_mooncake() -> str:
    """The master's path; fails under CI when it is missing, skips elsewhere."""
    path = master_binary()
    if path is None:
        reason = "mooncake_master missing: make install (the cluster extra)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path
