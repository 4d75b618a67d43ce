"""The cluster tier on real processes: a real ``mooncake_master`` on loopback
(tests/mooncake.py) and two kvfs mounts on separate pools, two "nodes" of one cluster.

A file closed on node A is published; a lookup on node B of a name B lacks fetches it,
verifies it and makes it an ordinary local file. Checked byte for byte, with concurrent
readers, with tampered values in the cluster, across a killed and restarted master.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfs.cluster.client import TCP_ANNOUNCE_ENV
from kvfs.testing import harness
from tests.conftest import (
    META_SIZE,
    KvfsMount,
    _expected,
    _finish,
    eviction_settled,
    pattern,
    require_fuse,
)
from tests.mooncake_master import Master, require_mooncake

MiB = 1 << 20
KNOBS = "&segment=128M&buffer=64M"
Node = Callable[..., KvfsMount]
KVFS = [sys.executable, "-m", "kvfs"]


def wait_for(what: Callable[[], Any], timeout: float = 30.0, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(step)


def cluster(mount: KvfsMount) -> dict[str, Any]:
    stats: dict[str, Any] = mount.stats()["cluster"]
    return stats


def up(mount: KvfsMount) -> bool:
    return bool(cluster(mount)["state"] == "up")


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    require_mooncake()
    m = Master(tmp_path / "master.log")
    m.start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def node(tmp_path: Path, request: pytest.FixtureRequest, master: Master) -> Iterator[Node]:
    """node(name, *extra, knobs=...) -> a kvfs mount of its own 1 GiB pool, a client of
    ``master``, already connected."""
    require_fuse()
    mounts: list[KvfsMount] = []

    def make(
        name: str, *extra: str, knobs: str = KNOBS, connected: bool = True, size: int = 1 << 30
    ) -> KvfsMount:
        d = tmp_path / name
        d.mkdir()
        image = harness.make_image(d / "pool.img", size)
        url = ("--cluster", master.url + knobs)
        m = KvfsMount(d / "mnt", [str(image)], d / "kvfs.log", _expected(request), url)
        mounts.append(m)
        m.start("--format", "--meta-size", META_SIZE, *extra)
        if connected:
            wait_for(lambda: up(m))
        return m

    try:
        yield make
    finally:
        for m in mounts:
            _finish(m)


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def published(mount: KvfsMount, n: int) -> None:
    try:
        wait_for(lambda: (c := cluster(mount))["published"] >= n and not c["publish_queue"])
    except AssertionError:
        raise AssertionError(f"{n} files not published: {cluster(mount)}") from None


def test_a_file_closed_on_one_node_is_a_hit_on_the_other(node: Node) -> None:
    """Files of many sizes in nested directories, read on B by 8 threads at once (the
    same names concurrently: one fetch each), bit-identical; B's copies are local files
    that outlive a remount of B."""
    a, b = node("a"), node("b")
    sizes = [0, 1, 4095, 4097, MiB, 3 * MiB + 5, 8 * MiB]
    files = {
        f"vllm/m_r0/{i:03x}/{i % 7:02x}_g0/{i:064x}.bin": pattern(i, n) for i, n in enumerate(sizes)
    }
    for rel, data in files.items():
        write(a.path / rel, data)
    published(a, len(files))

    def read(rel: str) -> bool:
        with open(b.path / rel, "rb") as f:
            return f.read() == files[rel]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(read, [rel for rel in files for _ in range(4)]))
    assert all(results)
    c = cluster(b)
    assert c["hits"] >= len(files)
    assert c["bytes_fetched"] == sum(sizes)  # each file once, however many readers
    assert c["checksum_failures"] == 0 and b.stats()["store"]["corruptions"] == 0
    listing = sorted(p.name for p in (b.path / "vllm/m_r0/000").rglob("*.bin"))
    assert listing == [f"{0:064x}.bin"]
    assert not [p for p in b.path.rglob(".kvfs-fetch.*")]  # no temporary left behind
    b.remount()
    wait_for(lambda: up(b))
    for rel, data in files.items():
        assert (b.path / rel).read_bytes() == data
    assert cluster(b)["hits"] == 0  # local now: the cluster was not asked again


def test_a_file_larger_than_a_part_travels_in_parts(node: Node) -> None:
    a, b = node("a", knobs="&segment=64M&buffer=8M&part=1M"), node("b")
    data = pattern("parts", 5 * MiB + 12345)
    write(a.path / "d" / "big.bin", data)
    published(a, 1)
    assert (b.path / "d" / "big.bin").read_bytes() == data


def test_rename_into_place_publishes_the_final_name_only(node: Node) -> None:
    """vLLM and SGLang write a temporary name and rename it: B finds the final name,
    never the temporary one; a replaced name is republished with its new bytes."""
    a, b = node("a"), node("b")
    tmp, dest = a.path / "sg" / "k_1.bin.tmp.1.2.x", a.path / "sg" / "k_1.bin"
    write(tmp, pattern(1, MiB))
    os.replace(tmp, dest)
    published(a, 1)
    assert (b.path / "sg" / "k_1.bin").read_bytes() == pattern(1, MiB)
    assert not (b.path / "sg" / tmp.name).exists()


def test_unlink_removes_the_name_in_the_cluster(node: Node) -> None:
    a, b = node("a"), node("b")
    write(a.path / "v" / "gone.bin", pattern(2, 2 * MiB))
    write(a.path / "v" / "kept.bin", pattern(3, 2 * MiB))
    published(a, 2)
    (a.path / "v" / "gone.bin").unlink()
    wait_for(lambda: cluster(a)["deleted"] >= 1)  # past the master's lease
    assert not (b.path / "v" / "gone.bin").exists()
    assert (b.path / "v" / "kept.bin").read_bytes() == pattern(3, 2 * MiB)


def raw_client(master: Master) -> Any:
    """A Mooncake client in the test process (to tamper with what kvfs stored)."""
    from mooncake.store import MooncakeDistributedStore

    os.environ.setdefault(TCP_ANNOUNCE_ENV, "127.0.0.1")  # announced on loopback too
    s = MooncakeDistributedStore()
    metadata = f"http://127.0.0.1:{master.http_port}/metadata"
    rc = s.setup("127.0.0.1", metadata, 0, 64 * MiB, "tcp", "", f"127.0.0.1:{master.rpc_port}")
    assert rc == 0
    return s


def test_values_that_do_not_verify_are_misses_never_bytes(node: Node, master: Master) -> None:
    """A part changed in the cluster, a part missing, another file's header over these
    bytes, a value that is no kvfs header: each is a clean ENOENT on B, never a file."""
    a, b = node("a"), node("b")
    names = ["flip", "nopart", "other", "junk"]
    for i, n in enumerate(names):
        write(a.path / "t" / f"{n}.bin", pattern(i, 2 * MiB))
    published(a, len(names))
    s = raw_client(master)  # open until B has looked: the values may live in its segment
    try:
        flipped = bytearray(s.get("kvfs/p0/t/flip.bin"))
        flipped[12345] ^= 1
        assert s.upsert("kvfs/p0/t/flip.bin", bytes(flipped)) == 0
        wait_for(lambda: s.remove("kvfs/p0/t/nopart.bin") == 0)
        header = s.get("kvfs/f/t/flip.bin")
        assert s.upsert("kvfs/f/t/other.bin", header) == 0  # flip's header, other bytes
        assert s.upsert("kvfs/f/t/junk.bin", b"x" * len(header)) == 0
        for n in names:
            with pytest.raises(FileNotFoundError):
                os.stat(b.path / "t" / f"{n}.bin")
    finally:
        s.close()
    c = cluster(b)
    assert c["hits"] == 1  # the directory t, nothing else
    assert c["checksum_failures"] == 2 and c["fetch_failed"] == 4
    assert sorted(os.listdir(b.path / "t")) == []


def tcp_sockets(pid: int) -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, Any]]:
    """(state, local address, remote address) of each TCP socket process ``pid`` holds
    (/proc/PID/fd and /proc/PID/net/tcp{,6}; state "0A" is LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    out.append((cols[3], _address(cols[1]), _address(cols[2])))
    return out


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's HEX:PORT (each 32-bit word in host order) -> the address."""
    raw = bytes.fromhex(text.split(":")[0])
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(packed)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def test_nodes_talk_and_announce_on_loopback_only(node: Node, master: Master) -> None:
    """With the tier up and a file fetched across nodes, every TCP connection of each
    daemon is loopback to loopback, and each node's transfer engine announces a
    loopback address to its peers (Mooncake took the first non-loopback interface's
    address before). Listeners are loopback or the wildcard: Mooncake 0.3 binds its
    transfer engine's two listeners to INADDR_ANY / in6addr_any with no setting to
    change it (docs/cluster.md)."""
    a, b = node("a"), node("b")
    write(a.path / "l" / "f.bin", pattern("loop", 2 * MiB))
    published(a, 1)
    assert (b.path / "l" / "f.bin").read_bytes() == pattern("loop", 2 * MiB)
    for m in (a, b):
        assert m.proc is not None
        sockets = tcp_sockets(m.proc.pid)
        remote = {r for state, _, r in sockets if state != "0A"}
        assert remote and all(r.is_loopback for r in remote), sockets
        assert all(loc.is_loopback for state, loc, _ in sockets if state != "0A"), sockets
        listening = [loc for state, loc, _ in sockets if state == "0A"]
        assert all(loc.is_loopback or loc.is_unspecified for loc in listening), sockets
    assert a.stop() == 0
    announced = re.findall(r"RPC using .*, listening on (\S+):\d+", a.stderr[-1])
    assert announced and all(ipaddress.ip_address(h).is_loopback for h in announced), announced


@pytest.mark.expect_errors(r"mooncake|Mooncake")
def test_unmount_with_the_master_dead_exits_and_keeps_local_files(
    node: Node, master: Master
) -> None:
    """Master killed, the tier known down: an unmount still ends the daemon (exit 0,
    polled with a generous deadline) without a word more to the dead master (its
    client is never torn down: that teardown held the daemon 13 s and more), and a
    remount with no master serves every local file byte for byte."""
    a = node("a")
    files = {f"v/{i:02d}.bin": pattern(("dead", i), MiB + 17 * i) for i in range(6)}
    for rel, data in files.items():
        write(a.path / rel, data)
    published(a, len(files))
    master.kill()
    with pytest.raises(FileNotFoundError):
        os.stat(a.path / "v" / "absent.bin")  # the tier notices: a call misses its deadline
    wait_for(lambda: cluster(a)["state"] == "down")
    proc = a.proc
    assert proc is not None
    harness.unmount(a.path)
    wait_for(lambda: proc.poll() is not None, timeout=30)
    assert a.stop() == 0, a.stderr[-1:]
    assert "unmount segment" not in a.stderr[-1]  # Mooncake's teardown never ran
    a.start()  # the same --cluster URL, its master still dead
    for rel, data in files.items():
        assert (a.path / rel).read_bytes() == data
    assert cluster(a)["state"] != "up"


@pytest.mark.expect_errors(r"mooncake|Mooncake")
def test_master_killed_then_back(node: Node, master: Master) -> None:
    """Master killed: both nodes serve local data, misses answer within the deadline
    (then at once), writes go on (their publishes dropped and counted), nothing hangs.
    Master back on the same address: both reconnect, sharing resumes."""
    a, b = node("a"), node("b")
    write(a.path / "v" / "before.bin", pattern(10, 4 * MiB))
    published(a, 1)
    assert (b.path / "v" / "before.bin").read_bytes() == pattern(10, 4 * MiB)
    master.kill()
    times = []
    for i in range(20):
        t0 = time.monotonic()
        with pytest.raises(FileNotFoundError):
            os.stat(b.path / "v" / f"missing{i}.bin")
        times.append(time.monotonic() - t0)
    assert max(times) < 3.0, times  # the first waits out a 1 s deadline at most
    assert sorted(times)[len(times) // 2] < 0.2, times  # then the tier is known down
    write(a.path / "v" / "during.bin", pattern(11, MiB))  # the write path never waits
    assert (a.path / "v" / "during.bin").read_bytes() == pattern(11, MiB)
    assert (b.path / "v" / "before.bin").read_bytes() == pattern(10, 4 * MiB)
    wait_for(lambda: cluster(a)["state"] == "down" and cluster(b)["state"] == "down")
    assert cluster(b)["skipped_down"] >= 1
    master.start()
    wait_for(lambda: up(a) and up(b), timeout=60)
    write(a.path / "v" / "after.bin", pattern(12, 4 * MiB))
    published(a, 2)
    assert (b.path / "v" / "after.bin").read_bytes() == pattern(12, 4 * MiB)


def test_mount_with_no_master_yet_serves_locally_then_connects(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    require_fuse()
    require_mooncake()
    m = Master(tmp_path / "master.log")
    image = harness.make_image(tmp_path / "pool.img", 1 << 30)
    mount = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
    try:
        mount.start("--format", "--meta-size", META_SIZE, "--cluster", m.url + KNOBS)
        t0 = time.monotonic()
        with pytest.raises(FileNotFoundError):
            os.stat(mount.path / "nothing")
        assert time.monotonic() - t0 < 1.0
        write(mount.path / "local.bin", pattern(5, MiB))
        assert cluster(mount)["state"] != "up"
        m.start()
        wait_for(lambda: up(mount), timeout=60)
        assert (mount.path / "local.bin").read_bytes() == pattern(5, MiB)
    finally:
        try:
            _finish(mount)
        finally:
            m.stop()


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://127.0.0.1:1?metadata=x", "expected mooncake://"),
        ("mooncake://127.0.0.1:50051", "needs ?metadata=URL"),
        ("mooncake://127.0.0.1?metadata=http://x/metadata", "needs HOST:PORT"),
        ("mooncake://h:1?metadata=m&publish=sometimes", "publish must be one of"),
        ("mooncake://h:1?metadata=m&segment=lots", "segment="),
        ("mooncake://h:1?metadata=m&colour=blue", "unknown knob 'colour'"),
    ],
)
def test_bad_cluster_url_is_one_line(tmp_path: Path, url: str, message: str) -> None:
    (tmp_path / "mnt").mkdir()
    mnt, img = str(tmp_path / "mnt"), str(tmp_path / "img")
    r = subprocess.run(
        [*KVFS, "mount", mnt, img, "--format", "--create", "64M", "--cluster", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert not (tmp_path / "img").exists()  # nothing was made: the URL is checked first


def test_stats_show_the_cluster(node: Node) -> None:
    a = node("a")
    write(a.path / "x" / "f.bin", pattern(9, MiB))
    published(a, 1)
    out = subprocess.run(
        [sys.executable, "-m", "kvfs", "stats", str(a.path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("cluster"))
    assert "up" in line and "1 published" in line
    raw = json.loads(os.getxattr(a.path, "user.kvfs.stats"))["cluster"]
    assert raw["bytes_published"] == MiB and raw["publish_queue"] == 0


def test_publish_on_evict_sends_what_local_eviction_takes(node: Node) -> None:
    """publish=on-evict (the cluster as a victim cache): nothing is sent at close; the
    files node A's eviction takes are sent before their space is reused, and node B
    fetches them bit-identical. A file still local on A was never sent."""
    a = node("a", "--fresh-grace", "0", knobs=KNOBS + "&publish=on-evict", size=128 * MiB)
    b = node("b")
    names = [f"e/{i:03d}.bin" for i in range(48)]  # 192 MiB through a 128 MiB pool
    for i, rel in enumerate(names):
        write(a.path / rel, pattern(("evict", i), 4 * MiB))
    wait_for(lambda: a.stats()["store"]["evictions"] > 0)
    # the round the last write started may still be evicting (and publishing): the
    # listing and the counters below must see all of it
    eviction_settled(a.stats)
    wait_for(lambda: not cluster(a)["publish_queue"])
    c = cluster(a)
    local = set(os.listdir(a.path / "e"))  # a listing: a lookup on A would fetch back
    evicted = [rel for rel in names if rel.split("/")[1] not in local]
    assert evicted and c["published"] >= 1
    assert c["published"] + c["publish_dropped"] >= len(evicted)
    hits = 0
    for i, rel in enumerate(names):
        if rel in evicted:
            try:
                data = (b.path / rel).read_bytes()
            except FileNotFoundError:
                continue  # dropped: more victims at once than the queue holds back
            assert data == pattern(("evict", i), 4 * MiB)
            hits += 1
        else:
            assert not (b.path / rel).exists()  # still local on A: never published
    assert hits == c["published"]


def test_prometheus_scrape_has_the_cluster_tier(node: Node) -> None:
    from tests.mount.test_metrics import free_port, one, scrape

    port = free_port()
    a = node("a", "--metrics", f"127.0.0.1:{port}")
    b = node("b")
    write(a.path / "m" / "f.bin", pattern("scrape", 2 * MiB))
    published(a, 1)
    assert (b.path / "m" / "f.bin").read_bytes() == pattern("scrape", 2 * MiB)
    with pytest.raises(FileNotFoundError):
        os.stat(b.path / "m" / "absent.bin")
    m = scrape(port)
    assert one(m, "kvfs_cluster_up") == 1
    assert one(m, "kvfs_cluster_published_total") == 1
    assert one(m, "kvfs_cluster_bytes_published_total") == 2 * MiB
    assert one(m, "kvfs_cluster_publish_queue") == 0
    assert one(m, "kvfs_cluster_publish_duration_seconds_count") == 1
    assert one(m, "kvfs_cluster_hits_total") == 0  # A fetched nothing
