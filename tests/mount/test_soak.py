"""The soak (``tools/soak.py``), short: about 75 s of the engines' write patterns, verified
readers, deletes and quota eviction on a small pool, two kill -9 of the daemon with a
remount and the durable ledger checked after each, then a clean unmount and fsck; ring
clients (the daemon moving their bytes) killed every few seconds beside it.

Any wrong, short, stale or zero-filled read, lost durable file, unexpected error or
hang fails it (the soak's exit code). Runs under its own subprocess so that a hang
(the soak exits 3 after tearing everything down) cannot take pytest with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_fuse

SOAK = Path(__file__).resolve().parents[2] / "tools" / "soak.py"
SHORT = [
    "--seconds", "75",
    "--kill-interval", "22:30",
    "--image-size", "256M",
    "--meta-size", "8M",
    "--pool-quota", "64M",
    "--pool-names", "80",
    "--durable-names", "30",
    "--pool-max", "4M",
    "--durable-max", "1M",
    "--writers", "2",
    "--readers", "2",
    "--deadline", "120",  # per operation: generous on a loaded 2-core machine
]  # fmt: skip


@pytest.mark.timeout(900)
def test_short_soak_finds_no_wrong_byte(tmp_path: Path) -> None:
    require_fuse()
    out = tmp_path / "soak.json"
    r = subprocess.run(
        [sys.executable, str(SOAK), *SHORT, "--workdir", str(tmp_path / "w"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=840,
    )
    report = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, f"the soak exited {r.returncode}:\n{report}"
    s = json.loads(out.read_text())
    assert s["failures"] == 0, report
    # it did what it is for: crashes, recovery checks, eviction, verified bytes
    assert s["kills"] >= 1 and s["recovery_checks"] == s["kills"] + 1, report
    assert s["durable_verified_after_recovery"] > 0, report
    assert s["evictions"].get("quota:pool", 0) > 0, report
    assert s["bytes_verified"] > 0 and s["fsck"].startswith("exit 0"), report
    racing = sum(n for k, n in s["ops"].items() if ":racing:" in k and k.endswith("whole"))
    stable = sum(n for k, n in s["ops"].items() if k.endswith(":stable:exact"))
    assert racing > 0 and stable > 0, report
    # the aware ring: its clients killed mid-request, their files checked, the odd
    # workers' direct operations through it
    assert s["ring_client_kills"] >= 10 and s["ring_files_checked"] > 0, report
    ring_ops = sum(n for k, n in s["ops"].items() if k.startswith("direct-"))
    assert ring_ops > 0, report
