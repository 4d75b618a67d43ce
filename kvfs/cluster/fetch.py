"""Fetch on miss (``docs/cluster.md``): a lookup of a name that is not local asks the
cluster. Existence checks of concurrent lookups go out as one batch; misses are
remembered for ``negative`` seconds; a hit is read, verified against the checksum it
was published with, written to a local file under a temporary name and renamed into
place, so a reader sees the whole file or nothing."""

from __future__ import annotations

import collections
import logging
import os
import stat
import time

import trio

from kvfs.cluster.client import ClusterError
from kvfs.cluster.config import ClusterConfig
from kvfs.cluster.link import Link
from kvfs.cluster.statistics import ClusterStatistics
from kvfs.common.errors import Exists, KvfsError
from kvfs.common.timing import Histogram
from kvfs.format.clustervalue import KIND_DIR, KIND_FILE, Header, unpack_header
from kvfs.format.records import FLAG_WRITING
from kvfs.store.facade import Store
from kvfs.store.posix import Caller

log = logging.getLogger(__name__)

FETCH_PREFIX = b".kvfs-fetch."
"""Temporary names of files being fetched (renamed into place once whole)."""
RENAME_NOREPLACE = 1
"""renameat2(2)'s flag (linux/fs.h), as :meth:`Store.rename` takes it: the fetched
file never replaces a name made here meanwhile."""


class _Batch:
    """Existence checks waiting for one ``batch_is_exist``."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.done = trio.Event()
        self.result: list[int] | None = None


class Fetcher:
    """The lookups of one node's tier that go to the cluster."""

    def __init__(
        self, store: Store, cfg: ClusterConfig, link: Link, stats: ClusterStatistics
    ) -> None:
        self.store, self.cfg, self.link, self.stats = store, cfg, link, stats
        self.latency = Histogram()
        self._fetch_limiter = trio.CapacityLimiter(cfg.workers)
        self._negative: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._inflight: dict[tuple[int, bytes], trio.Event] = {}
        self._batch: _Batch | None = None
        self.fetching: set[int] = set()
        """Inodes kvfs is writing from the cluster: never published back."""
        self._seq = 0

    def forget_misses(self) -> None:
        """The link went down: what the cluster lacked may be there once it is back."""
        self._negative.clear()

    async def missed(self, parent: int, name: bytes) -> None:
        """A local miss of ``name`` in ``parent``: what the cluster has under its path,
        made local, if it answers in time (the store then looks again)."""
        if name.startswith(FETCH_PREFIX) or name in (b".", b".."):
            return
        if not self.link.up:
            self.stats.skipped_down += 1
            return
        if not self.store.managed(parent):
            return
        dir_path = self.store.path_of(parent)
        if dir_path is None:
            return
        path = dir_path + b"/" + name if dir_path else name
        expiry = self._negative.get(path)
        now = time.monotonic()
        if expiry is not None:
            if expiry > now:
                self.stats.negative_hits += 1
                return
            del self._negative[path]
        key = (parent, name)
        waiting = self._inflight.get(key)
        if waiting is not None:
            await waiting.wait()
            return
        event = self._inflight[key] = trio.Event()
        try:
            found = await self._fetch(parent, name, path)
        finally:
            del self._inflight[key]
            event.set()
        if not found:
            self._negative[path] = time.monotonic() + self.cfg.negative
            while len(self._negative) > 1 << 17:
                self._negative.popitem(last=False)

    async def _exists(self, keys: list[str]) -> list[int]:
        """Existence of ``keys``, in one batch with the other lookups that arrive
        before the batch leaves (a lookup storm becomes a few round trips)."""
        batch = self._batch
        if batch is None:
            batch = self._batch = _Batch()
            start = len(batch.keys)
            batch.keys += keys
            await trio.lowlevel.checkpoint()  # let the lookups already queued join
            self._batch = None
            client = self.link.client
            try:
                if client is None:
                    raise ClusterError("cluster down")
                found = await self.link.call(lambda: client.exist(batch.keys), self.cfg.timeout)
                if len(found) != len(batch.keys):
                    raise ClusterError("batch_is_exist answered the wrong count")
                if found and min(found) < 0:
                    self.link.check(min(found), "batch_is_exist")
                batch.result = found
            except ClusterError:
                batch.result = None
            finally:
                batch.done.set()
        else:
            start = len(batch.keys)
            batch.keys += keys
            await batch.done.wait()
        if batch.result is None:
            raise ClusterError("existence check failed")
        return batch.result[start : start + len(keys)]

    async def _fetch(self, parent: int, name: bytes, path: bytes) -> bool:
        """True when the cluster had ``path`` (now local, or created locally meanwhile)."""
        t0 = time.monotonic()
        try:
            fkey, dkey = self.cfg.key("f", path), self.cfg.key("d", path)
            is_file, is_dir = await self._exists([fkey, dkey])
            if not (is_file or is_dir):
                self.stats.misses += 1
                return False
            async with self._fetch_limiter:
                if is_file:
                    ok = await self._fetch_file(parent, name, path, fkey)
                else:
                    ok = await self._fetch_dir(parent, name, dkey)
        except ClusterError:
            self.stats.fetch_failed += 1
            return False
        except KvfsError as e:  # no room here, metadata full...: a miss
            log.info("cluster: %r not made local: %s", path, e)
            self.stats.fetch_failed += 1
            return False
        if ok:
            self.stats.hits += 1
            self.latency.observe(time.monotonic() - t0)
        else:
            self.stats.fetch_failed += 1
        return ok

    async def get(self, key: str, deadline: float) -> bytes:
        client = self.link.client
        if client is None:
            raise ClusterError("cluster down")
        return await self.link.call(lambda: client.get(key), deadline)

    async def _fetch_file(self, parent: int, name: bytes, path: bytes, fkey: str) -> bool:
        header = unpack_header(await self.get(fkey, self.cfg.timeout))
        if header is None or header.kind != KIND_FILE:
            return False
        deadline = trio.current_time() + self.cfg.fetch_timeout
        pieces = []
        for i in range(header.parts):
            left = deadline - trio.current_time()
            if left <= 0:
                return False
            piece = await self.get(self.cfg.key(f"p{i}", path), left)
            if not piece:  # gone (evicted by Mooncake, deleted) or unreachable
                return False
            pieces.append(piece)
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)  # one part: no copy
        del pieces
        ok = header.verify(data)
        if not ok:
            self.stats.checksum_failures += 1
            log.warning("cluster: %r did not verify against its checksum; not used", path)
            return False
        if self.store.lookup(parent, name) is not None:
            return True  # made here meanwhile: the local file wins
        await self._materialize(parent, name, header, data)
        self.stats.bytes_fetched += len(data)
        return True

    async def _fetch_dir(self, parent: int, name: bytes, dkey: str) -> bool:
        header = unpack_header(await self.get(dkey, self.cfg.timeout))
        if header is None or header.kind != KIND_DIR:
            return False
        if self.store.lookup(parent, name) is not None:
            return True
        mode = stat.S_IFDIR | stat.S_IMODE(header.mode)
        try:
            await self.store.make(parent, name, mode, Caller(header.uid, header.gid, os.getpid()))
        except Exists:
            pass
        except KvfsError as e:
            log.info("cluster: directory %r not made locally: %s", name, e)
            return False
        return True

    async def _materialize(self, parent: int, name: bytes, header: Header, data: bytes) -> None:
        """Write ``data`` as a local file under a temporary name, commit it, and rename
        it into place unless the name appeared meanwhile."""
        store = self.store
        self._seq += 1
        tmp = FETCH_PREFIX + f"{os.getpid()}.{self._seq}".encode()
        caller = Caller(header.uid, header.gid, os.getpid())
        inode = await store.create(parent, tmp, stat.S_IFREG | stat.S_IMODE(header.mode), caller)
        self.fetching.add(inode.ino)
        try:
            fh = await store.open(inode.ino, os.O_WRONLY, caller)
            try:
                if data:
                    await store.write(fh, 0, data)  # one call: copied once, into units
                await store.flush(fh)
            finally:
                await store.release(fh)
            if store.find_inode(inode.ino) is not inode or inode.flags & FLAG_WRITING:
                raise ClusterError("the fetched file could not be committed")
            try:
                store.rename(parent, tmp, parent, name, RENAME_NOREPLACE)
            except Exists:
                store.unlink(parent, tmp)
        except BaseException:
            if store.lookup(parent, tmp) is not None:
                store.unlink(parent, tmp)
            raise
        finally:
            self.fetching.discard(inode.ino)
