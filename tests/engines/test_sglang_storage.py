"""SGLang's REAL HiCache storage code with kvfs's backend (:mod:`kvfs.client.sglang`,
public as ``kvfs.sglang_storage``) on a real kvfs mount: pages move through
:mod:`kvfs.client.direct`, and the files are the ones SGLang's own ``HiCacheFile``
reads and writes.

Same setup as tests/engines/test_engines.py (its helpers; the driver is
tools/engines/sglang_hicache_driver.py, run by the engines venv's python, with this
checkout's kvfs on its path): SGLang 0.5.23 builds the backend as it builds every
dynamic backend, ``StorageBackendFactory.create_backend("dynamic", ...)`` from
``module_path`` / ``class_name`` in the extra config; only the host pool's pages are
stand-ins (CPU tensors). Every store and read is counted in the engine's process
(``kvfs.direct.stats()``) and every direct store by the mount.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfs.testing import harness
from tests.conftest import META_SIZE, KvfsMount, _expected, _finish, require_fuse
from tests.engines.test_engines import (  # noqa: F401  (_no_driver_left: an autouse fixture)
    LLAMA3_8B,
    _no_driver_left,
    drive,
    engines_python,
    policy_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
MiB = 1 << 20
PAGE = LLAMA3_8B.bytes_per_token() * 64  # SGLang's 64-token page: 8 MiB
PAGE_NAME = re.compile(r"^[0-9a-f]{64}_meta-llama-Meta-Llama-3-8B_0_1\.bin$")
DRIVER = "sglang_hicache_driver.py"


@pytest.fixture
def pool(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """make(size) -> a fresh kvfs pool of ``size`` bytes on an image file (the
    engines venv checked first, so a missing venv costs no mount)."""
    engines_python()
    require_fuse()
    mounts: list[KvfsMount] = []

    def make(size: int) -> KvfsMount:
        image = harness.make_image(tmp_path / "pool.img", size)
        m = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
        mounts.append(m)
        m.start("--format", "--meta-size", META_SIZE)
        return m

    try:
        yield make
    finally:
        for m in mounts:
            _finish(m)


def moved(stats: dict[str, int], reads: int, writes: int) -> None:
    """Exactly these reads and writes of whole pages, all through kvfs.direct's own
    routes (the devices, or the daemon's ring where the devices are not open to the
    process), none through the mount's FUSE path, no bad checksum."""
    got_reads = stats["direct_reads"] + stats.get("ring_reads", 0)
    got_writes = stats["direct_writes"] + stats.get("ring_writes", 0)
    read = stats["direct_bytes_read"] + stats.get("ring_bytes_read", 0)
    written = stats["direct_bytes_written"] + stats.get("ring_bytes_written", 0)
    assert (got_reads, got_writes) == (reads, writes), stats
    assert (read, written) == (reads * PAGE, writes * PAGE), stats
    assert stats["fallback_reads"] == stats["fallback_writes"] == 0, stats
    assert stats["checksum_failures"] == 0, stats


def test_kvfs_storage_is_interchangeable_with_hicache_file(pool: Any) -> None:
    """The driver's ``interop`` scenario (6 pages): KvfsStorage, loaded by SGLang's
    factory, stores and reads bit-identical through kvfs.direct; HiCacheFile stores
    the same pages under the same names with the same bytes; each reads the other's
    directory; a removed or never stored page is a clean miss; a file shorter or
    longer than its page is a failure, never data."""
    mount = pool(512 * MiB)
    d = policy_dir(mount, "sglang", "kvfs-managed")
    n = 6
    r: dict[str, Any] = drive(mount, DRIVER, "interop", "--dir", d, "--pages", n, timeout=600)

    # SGLang built kvfs's class from the dynamic config: a HiCacheFile, on HiCacheFile's directory
    assert r["class"] == "kvfs.client.sglang.KvfsStorage"
    assert r["mro"][:3] == ["KvfsStorage", "_Storage", "HiCacheFile"]
    assert "HiCacheStorage" in r["mro"]
    assert r["file_path"] == str(d / "kvfs")

    # one batch_set of n pages: n durable direct writes; HiCacheFile's lookups see them
    assert r["exists_before"] == 0 and r["set"] is True
    moved(r["stats_set"], reads=0, writes=n)
    assert r["exists"] == n and r["batch_exists"] == n and r["batch_exists_v2"] == n
    assert r["got"] == [True] * n and r["get_one"] == "ok"
    moved(r["stats_get"], reads=n + 1, writes=0)
    assert r["reset"] is True  # pages here already are not written again
    moved(r["stats_reset"], reads=0, writes=0)

    # HiCacheFile's files of the same pages: the very same names and bytes
    assert all(r["file_set"])
    assert r["names_kvfs"] == r["names_file"] and len(r["names_kvfs"]) == n
    assert all(PAGE_NAME.match(x) for x in r["names_kvfs"]), r["names_kvfs"]
    assert r["same_bytes"] is True and r["sizes"] == [PAGE] and r["suffix"] is True
    # either reads the other's directory bit-identical, kvfs's directly
    assert r["kvfs_reads_file_dir"] == [True] * n
    moved(r["stats_kvfs_reads_file_dir"], reads=n, writes=0)
    assert r["file_reads_kvfs_dir"] == [True] * n
    # a directory both wrote: a restarted KvfsStorage (metadata cache) finds every page
    assert r["restart_cached"] == n + 2 and r["restart_got"] == [True] * (n + 2)

    # misses and failures: never bytes
    assert r["removed_exists"] is False and r["removed_batch_exists"] == 0
    assert r["removed_get"] == "miss" and r["never_stored_get"] == "miss"
    assert r["damaged_batch_get"] == [None, None, None, True]  # removed, short, long, whole
    assert r["short_get"] == "raised PageNotServed" and r["long_get"] == "raised PageNotServed"
    assert r["counters"]["failed"] == 4 and r["counters"]["hits"] == 1
    assert r["tmp_leftovers"] == []

    # the mount saw the same: the n pages KvfsStorage stored, each one direct commit
    s = mount.stats()
    assert s["direct"]["commits"] == n and s["direct"]["aborts"] == 0, s["direct"]
    assert s["direct"]["bytes_committed"] == n * PAGE
    assert s["store"]["evictions"] == 0 and s["store"]["corruptions"] == 0


def test_kvfs_storage_roundtrip_restart_and_sglang_evictor(pool: Any) -> None:
    """HiCacheFile's own scenarios with KvfsStorage (tests/engines/test_engines.py
    runs them with HiCacheFile): 8 pages stored, found, read bit-identical, a
    restart with the metadata cache finds them, a vanished page is a miss; then
    SGLang's LRUFileEvictor (max_size 3 pages), which KvfsStorage keeps, unlinks its
    oldest files on kvfs."""
    mount = pool(512 * MiB)
    d = policy_dir(mount, "sglang", "kvfs-managed")
    r = drive(mount, DRIVER, "roundtrip", "--backend", "kvfs", "--dir", d, "--pages", 8)
    assert r["exists_before"] == 0 and all(r["set"]) and r["exists"] == 8
    assert r["batch_exists_v2_pages"] == 8
    assert r["got"] == [True] * 8 and r["reset"] == [True]
    assert r["n_files"] == 8 and r["sizes"] == [PAGE] and r["tmp_leftovers"] == []
    assert PAGE_NAME.match(r["example"])
    assert r["cached_after_restart"] == 8 and r["got_after_restart"] == [True] * 8
    assert r["vanished_exists"] is False and r["vanished_get"] is None
    d2 = policy_dir(mount, "sglang-lru", "engine-managed")
    e = drive(mount, DRIVER, "evict", "--backend", "kvfs", "--dir", d2, "--pages", 6, "--keep", 3)
    assert all(e["set"]) and e["exists"] == [False] * 3 + [True] * 3
    assert e["n_files"] == 3 and e["got_newest"] == [True] * 3
    assert e["set_after_restart"] == [True] and e["n_files_after_restart"] == 3
    s = mount.stats()
    assert s["store"]["evictions"] == 0 and s["store"]["corruptions"] == 0
    assert s["direct"]["commits"] == 8 + 6 + 1 and s["direct"]["aborts"] == 0


def test_kvfs_storage_under_pressure_kvfs_evicts(pool: Any) -> None:
    """No SGLang evictor: 40 pages (320 MiB) in batches of 8 into a 256 MiB pool,
    kvfs-managed. Every batch_set succeeds (a direct write's reservation evicts as
    a write does); scandir agrees with exists(); every surviving page reads back
    identical or is a clean miss."""
    mount = pool(256 * MiB)
    d = policy_dir(mount, "sglang", "kvfs-managed")
    r = drive(
        mount, DRIVER, "pressure", "--backend", "kvfs", "--dir", d, "--pages", 40, timeout=600
    )
    assert r["set_ok"] == r["set_batches"], "a KvfsStorage batch_set failed on kvfs"
    assert 0 < r["present"] < 40
    assert r["scandir_matches_exists"]
    assert r["got_corrupt"] == 0 and r["got_ok"] + r["got_miss"] == r["present"]
    assert r["got_ok"] >= r["present"] - 4
    # the grace protects at most a 64th of the pool (issue 30), and always the
    # writer's newest file; older fresh pages go in the policy's order
    assert r["newest_present"] >= 1
    s = mount.stats()
    assert s["store"]["evictions"] > 0 and s["store"]["corruptions"] == 0
    assert s["direct"]["commits"] == 40 and s["direct"]["aborts"] == 0
