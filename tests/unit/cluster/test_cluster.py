"""The cluster tier's logic without Mooncake: two stores on memory devices share an
in-process stand-in of the Mooncake client (a dict behind a lock, with the real
client's return codes), so batching, ordering, deadlines and verification are checked
deterministically. tests/mount/test_cluster.py runs the same paths on a real master."""

from __future__ import annotations

import os
import stat
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest
import trio

from kvfs.cluster import client as mc
from kvfs.cluster.config import ClusterConfig, parse_url
from kvfs.cluster.fetch import FETCH_PREFIX
from kvfs.cluster.tier import Cluster
from kvfs.common.errors import UserError
from kvfs.format import clustervalue as cv
from kvfs.index.namespace import ROOT_INO
from kvfs.store.facade import Store, StoreConfig
from kvfs.store.posix import Caller
from tests.unit.store.test_store import memory_pool, wait_until

CFG = StoreConfig(cache_bytes=4 << 20, commit_interval=0.005, io_timeout=10.0)
FILE = stat.S_IFREG | 0o644
ME = Caller(os.getuid(), os.getgid(), os.getpid())


class FakeMooncake:
    """The shared cluster: one dict; clients see it through :class:`FakeClient`."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int]] = []
        self.hang = threading.Event()  # set: every call blocks until released
        self.release = threading.Event()
        self.down = False

    def client(self, cfg: ClusterConfig) -> FakeClient:
        return FakeClient(self)


class FakeClient:
    def __init__(self, m: FakeMooncake) -> None:
        self.m = m

    def _enter(self, name: str, n: int = 1) -> bool:
        self.m.calls.append((name, n))
        if self.m.hang.is_set():
            self.m.release.wait()
        return not self.m.down

    def exist(self, keys: Sequence[str]) -> list[int]:
        if not self._enter("exist", len(keys)):
            return [-900] * len(keys)
        with self.m.lock:
            return [int(k in self.m.objects) for k in keys]

    def get(self, key: str) -> bytes:
        if not self._enter("get"):
            return b""
        with self.m.lock:
            return self.m.objects.get(key, b"")

    def put(self, key: str, value: bytes) -> int:
        if not self._enter("put"):
            return -900
        if not value:
            return -600  # as Mooncake: no empty objects
        with self.m.lock:
            self.m.objects[key] = bytes(value)
        return 0

    def remove(self, key: str) -> int:
        if not self._enter("remove"):
            return -900
        with self.m.lock:
            return 0 if self.m.objects.pop(key, None) is not None else mc.OBJECT_NOT_FOUND

    def health(self) -> int:
        return -900 if not self._enter("health") or self.m.hang.is_set() else 0

    def close(self) -> None:
        pass


TIERS: weakref.WeakKeyDictionary[Store, Cluster] = weakref.WeakKeyDictionary()
"""Each node's tier (subscribed to its store)."""
URL = "mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata&timeout=0.3&retry=0.05"


@asynccontextmanager
async def node(m: FakeMooncake, url: str = URL) -> AsyncIterator[Store]:
    store = Store(memory_pool(size=64 << 20), CFG)
    store.load()
    cluster = TIERS[store] = Cluster(store, parse_url(url), connect=m.client)
    store.subscribe(cluster)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await wait_until(lambda: cluster.up)
        yield store
        nursery.cancel_scope.cancel()


async def write_file(store: Store, parent: int, name: bytes, data: bytes) -> int:
    inode = await store.create(parent, name, FILE, ME)
    fh = await store.open(inode.ino, os.O_WRONLY, ME)
    await store.write(fh, 0, data)
    await store.flush(fh)
    await store.release(fh)
    return inode.ino


async def read_file(store: Store, parent: int, name: bytes) -> bytes | None:
    inode = store.lookup(parent, name)
    if inode is None:
        inode = await store.missed(parent, name)  # as the FUSE adapter's lookup
    if inode is None:
        return None
    fh = await store.open(inode.ino, os.O_RDONLY, ME)
    try:
        return bytes(await store.read(fh, 0, inode.size + 1))
    finally:
        await store.release(fh)


def tier(store: Store) -> Cluster:
    return TIERS[store]


async def drained(store: Store) -> None:
    await wait_until(lambda: tier(store).statistics().publish_queue == 0)


def test_url_knobs_and_defaults() -> None:
    c = parse_url("mooncake://m:50051?metadata=http://m:8080/metadata&buffer=64M&queue=9")
    assert (c.master, c.metadata, c.buffer, c.part, c.queue) == (
        "m:50051",
        "http://m:8080/metadata",
        64 << 20,
        16 << 20,
        9,
    )
    assert c.publish == "on-close"
    for bad in ("mooncake://m:1?metadata=x&part=1G", "mooncake://m:1?metadata=x&timeout=0"):
        with pytest.raises(UserError):
            parse_url(bad)


def test_header_covers_every_byte_and_its_own_fields() -> None:
    data = os.urandom(10000)
    raw = cv.pack_header(cv.KIND_FILE, 1, 0o644, 1, 2, len(data), 7, data)
    h = cv.unpack_header(raw)
    assert h is not None and h.verify(data)
    last = bytes([data[-1] ^ 0xFF])  # another last byte (urandom may end in the one put back)
    assert not h.verify(data[:-1]) and not h.verify(data[:-1] + last)
    for i in range(8, len(raw) - 8):  # any field changed: no longer this file's header
        changed = bytearray(raw)
        changed[i] ^= 1
        other = cv.unpack_header(bytes(changed))
        assert other is None or not other.verify(data)
    assert cv.unpack_header(b"x" * len(raw)) is None


async def test_a_file_closed_on_a_is_fetched_whole_by_b() -> None:
    m = FakeMooncake()
    async with node(m) as a, node(m) as b:
        d = await a.make(ROOT_INO, b"kv", stat.S_IFDIR | 0o755, ME)
        data = os.urandom(300_000)
        await write_file(a, d.ino, b"c.bin", data)
        await write_file(a, d.ino, b"empty.bin", b"")
        await drained(a)
        assert tier(a).stats.published == 2
        kv = await b.missed(ROOT_INO, b"kv")  # the directory, from its marker
        assert kv is not None and kv.is_dir
        assert await read_file(b, kv.ino, b"c.bin") == data
        assert await read_file(b, kv.ino, b"empty.bin") == b""
        assert tier(b).stats.hits == 3 and tier(b).stats.bytes_fetched == len(data)
        assert not [n for n in b.directory(kv.ino) if n.startswith(FETCH_PREFIX)]


async def test_a_lookup_storm_is_a_few_batched_round_trips() -> None:
    m = FakeMooncake()
    async with node(m) as b:
        d = await b.make(ROOT_INO, b"kv", stat.S_IFDIR | 0o755, ME)
        m.calls.clear()
        results: list[object] = []

        async def look(i: int) -> None:
            results.append(await b.missed(d.ino, b"%d.bin" % i))

        async with trio.open_nursery() as n:
            for i in range(200):
                n.start_soon(look, i)
        exists = [k for name, k in m.calls if name == "exist"]
        assert results == [None] * 200
        assert sum(exists) == 400 and len(exists) <= 4, exists  # file + dir key each
        m.calls.clear()
        assert await b.missed(d.ino, b"7.bin") is None
        assert m.calls == [] and tier(b).stats.negative_hits == 1  # a remembered miss


async def test_concurrent_lookups_of_one_name_fetch_it_once() -> None:
    m = FakeMooncake()
    async with node(m) as a, node(m) as b:
        data = os.urandom(1 << 20)
        await write_file(a, ROOT_INO, b"one.bin", data)
        await drained(a)
        m.calls.clear()
        got: list[bytes | None] = []

        async def reader() -> None:
            got.append(await read_file(b, ROOT_INO, b"one.bin"))

        async with trio.open_nursery() as n:
            for _ in range(10):
                n.start_soon(reader)
        assert got == [data] * 10
        assert [c for c in m.calls if c[0] == "get"] == [("get", 1), ("get", 1)]  # header, part


async def test_a_hung_cluster_costs_one_deadline_then_nothing() -> None:
    m = FakeMooncake()
    async with node(m) as b:
        m.hang.set()
        with trio.fail_after(2):
            assert await b.missed(ROOT_INO, b"x") is None  # waits out 0.3 s
        assert not tier(b).up and tier(b).stats.failures == 1
        with trio.fail_after(0.05):
            assert await b.missed(ROOT_INO, b"y") is None  # known down: not asked
        assert tier(b).stats.skipped_down == 1
        await write_file(b, ROOT_INO, b"local.bin", b"z" * 5000)  # writes never wait
        assert tier(b).stats.publish_dropped == 1
        m.hang.clear()
        m.release.set()
        await wait_until(lambda: tier(b).up)  # the prober reconnected


async def test_delete_then_recreate_keeps_their_order() -> None:
    """unlink + a new file of the same name: the cluster ends with the new bytes (the
    ops of one path run in order, however many workers)."""
    m = FakeMooncake()
    async with node(m) as a, node(m) as b:
        for round_ in range(5):
            await write_file(a, ROOT_INO, b"f.bin", b"%d" % round_ * 1000)
            a.unlink(ROOT_INO, b"f.bin")
        await write_file(a, ROOT_INO, b"f.bin", b"final" * 1000)
        await drained(a)
        assert await read_file(b, ROOT_INO, b"f.bin") == b"final" * 1000


async def test_rename_moves_the_key_and_tampering_is_a_miss() -> None:
    m = FakeMooncake()
    async with node(m) as a, node(m) as b:
        await write_file(a, ROOT_INO, b"t.tmp", b"r" * 70000)
        a.rename(ROOT_INO, b"t.tmp", ROOT_INO, b"t.bin", 0)
        await write_file(a, ROOT_INO, b"u.bin", b"u" * 70000)
        await drained(a)
        assert not any(k.endswith("/t.tmp") for k in m.objects)
        with m.lock:
            part = bytearray(m.objects["kvfs/p0/u.bin"])
            part[5] ^= 0x40
            m.objects["kvfs/p0/u.bin"] = bytes(part)
        assert await read_file(b, ROOT_INO, b"t.bin") == b"r" * 70000
        assert await read_file(b, ROOT_INO, b"u.bin") is None
        assert tier(b).stats.checksum_failures == 1 and b.lookup(ROOT_INO, b"u.bin") is None


async def test_a_file_rewritten_while_queued_is_sent_as_it_is_at_its_turn() -> None:
    """The publish reads the file when its turn comes; a version changed under the
    read is skipped (its own close queues it again): never a mix of two versions."""
    m = FakeMooncake()
    async with node(m) as a, node(m) as b:
        await write_file(a, ROOT_INO, b"v.bin", b"1" * 200_000)
        ino = a.lookup(ROOT_INO, b"v.bin")
        assert ino is not None
        fh = await a.open(ino.ino, os.O_WRONLY | os.O_TRUNC, ME)
        await a.write(fh, 0, b"2" * 150_000)
        await a.flush(fh)
        await a.release(fh)
        await drained(a)
        got = await read_file(b, ROOT_INO, b"v.bin")
        assert got == b"2" * 150_000
