"""LMCache's REAL engine with kvfs's storage plugin (:mod:`kvfs.client.lmcache`) on a
real kvfs mount: chunks move through :mod:`kvfs.client.direct`, and the files are the ones
LMCache's own ``local_disk`` reads and writes.

Same setup as tests/engines/test_engines.py (its helpers; the driver is
tools/engines/lmcache_plugin_driver.py, run by the engines venv's python, with this
checkout's kvfs on its path): LMCache 0.5.6 ``LMCacheEngine`` loads the plugin from
``storage_plugins``; only the GPU copy step is a stand-in. LMCache only logs a plugin
that fails to load, so the driver insists the backend is among the engine's, and
every store and retrieve is counted on both sides: ``kvfs.client.direct.stats()`` in the
engine's process, the mount's ``direct`` statistics here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfs.testing import harness
from tests.conftest import META_SIZE, KvfsMount, _expected, _finish, require_fuse
from tests.engines.test_engines import (  # noqa: F401  (_no_driver_left: an autouse fixture)
    CHUNK,
    LMCACHE_NAME,
    _no_driver_left,
    drive,
    engines_python,
    lmcache_files,
    policy_dir,
)

pytestmark = pytest.mark.slow
MiB = 1 << 20


@pytest.fixture
def mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KvfsMount]:
    """A fresh 768 MiB pool on an image file (engines venv checked first)."""
    engines_python()
    require_fuse()
    image = harness.make_image(tmp_path / "pool.img", 768 * MiB)
    m = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
    m.start("--format", "--meta-size", META_SIZE)
    try:
        yield m
    finally:
        _finish(m)


def only_direct(route: str, stats: dict[str, int], reads: int, writes: int) -> None:
    """Exactly these reads and writes on the aware ``route``, none through the mount,
    no bad checksum. On the devices route no bounce (LMCache's memory objects are
    page-aligned: zero copy). On the ring a store is one copy (LMCache's memory is
    not memory the daemon shares: the chunk goes through the thread's staging
    buffer), a retrieve none (it lands in the plugin's own shared memory objects)."""
    k = "direct" if route == "devices" else "ring"
    assert stats[f"{k}_reads"] == reads and stats[f"{k}_writes"] == writes, stats
    assert stats[f"{k}_bytes_read"] == reads * CHUNK, stats
    assert stats[f"{k}_bytes_written"] == writes * CHUNK, stats
    assert stats["fallback_reads"] == stats["fallback_writes"] == 0, stats
    bounced = 0 if route == "devices" else writes * CHUNK
    assert stats["bounced_bytes"] == bounced and stats["checksum_failures"] == 0, stats


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    ("mode", "route"), [("odirect", "devices"), ("buffered", "devices"), ("odirect", "ring")]
)
def test_lmcache_plugin_roundtrip_restart_and_local_disk_interop(
    mount: KvfsMount, mode: str, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's ``interop`` scenario, on an engine-managed directory: the plugin
    stores and retrieves bit-identical; a cut or removed file is a miss, never data;
    a restarted engine finds its chunks on disk; local_disk (``mode`` when it writes,
    the other mode when it reads) and the plugin read each other's files
    bit-identical, under the same names, with the same bytes."""
    monkeypatch.setenv("KVFS_DIRECT_ROUTE", route)  # the engine's: ring as a user would
    d = policy_dir(mount, "lmcache", "engine-managed")
    odirect = ["--odirect"] if mode == "odirect" else []
    r: dict[str, Any] = drive(
        mount, "lmcache_plugin_driver.py", "interop", "--dir", d, *odirect, timeout=360
    )

    # the plugin is the backend LMCache loaded, on LMCache's plugin interface
    assert r["plugin_class"] == "KvfsDirectBackend"
    assert "StoragePluginInterface" in r["plugin_bases"]

    # A: 3 requests of 2 chunks stored and retrieved, all of it direct
    assert r["lookup_before"] == [0, 0]
    only_direct(route, r["A_stats_store"], reads=0, writes=6)
    assert r["A_lookup"] == [512] * 3 and r["A_retrieved"] == [512] * 3
    only_direct(route, r["A_stats_retrieve"], reads=6, writes=0)
    assert r["A_landing_in_use"] == 0  # the engine freed every chunk it retrieved
    assert len(r["A_files"]) == 6 and set(r["A_files"].values()) == {CHUNK}
    assert all(LMCACHE_NAME.match(n) for n in r["A_files"]), r["A_files"]
    assert r["A_aligned"]
    # never wrong bytes: a file cut to half ends the prefix before it, also when it
    # changes between lookup and read; a removed file is a miss
    assert r["A_lookup_cut"] == 256 and r["A_retrieved_cut"] == 256
    assert r["A_short_read_served"] is False
    assert r["A_lookup_removed"] == 0 and r["A_retrieved_removed"] == 0
    assert r["A_counters"]["store_failed"] == 0

    # B: restarted, the plugin finds A's 4 chunks on disk, and a re-store writes none
    assert r["B_lookup"] == [512, 512] and r["B_retrieved"] == [512, 512]
    only_direct(route, r["B_stats"], reads=4, writes=0)
    assert len(r["B_sha"]) == 4 and all(r["A_sha"][n] == h for n, h in r["B_sha"].items())

    # C: local_disk rewrites A's chunks: the very same file names and bytes
    assert r["C_use_odirect"] is (mode == "odirect") and r["C_f_bsize"] == 4096
    assert r["C_lookup_before"] == [0, 0, 0]  # local_disk's index is in memory only
    assert r["C_retrieved"] == [512] * 3
    assert r["C_rewrote_A"]
    assert len(r["C_files"]) == 6 and set(r["C_files"].values()) == {CHUNK}
    assert {n: r["C_sha"][n] for n in r["B_sha"]} == r["B_sha"]

    # D: the plugin retrieves local_disk's new request, directly
    assert r["D_lookup"] == [512] and r["D_retrieved"] == [512]
    only_direct(route, r["D_stats"], reads=2, writes=0)

    # E: local_disk (the other mode) retrieves the plugin's files as they are
    only_direct(route, r["E_stats_store"], reads=0, writes=2)
    assert r["E_use_odirect"] is (mode != "odirect")
    assert r["E_paths_match"]
    assert r["E_lookup"] == [512] and r["E_retrieved"] == [512]
    assert r["E_untouched"]

    assert len(r["files"]) == 8 and set(r["files"].values()) == {CHUNK}
    assert all(LMCACHE_NAME.match(n) for n in r["files"])
    assert lmcache_files(d) == r["files"]
    # the mount saw the same: 8 direct commits (A 6, E 2), none abandoned
    s = mount.stats()
    assert s["direct"]["commits"] == 8 and s["direct"]["aborts"] == 0, s["direct"]
    assert s["direct"]["bytes_committed"] == 8 * CHUNK
    if route == "ring":  # the daemon moved every byte: 8 stores, 13 retrieves
        assert s["direct"]["ring"]["writes"] == 8 and s["direct"]["ring"]["refused"] == 0
    assert s["direct"]["maps"] >= 13  # a lease per direct read: A 6 (+ the cut one), B 4, D 2
    assert s["store"]["evictions"] == 0 and s["store"]["corruptions"] == 0
