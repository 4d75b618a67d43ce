"""The cluster tier over one store: it subscribes to the store's events
(:mod:`kvfs.store.hooks`) and keeps the cluster in step with the files closed,
renamed, unlinked and evicted here (``docs/cluster.md``).

- **Publish**: a file closed (or renamed into place) in a kvfs-managed directory is
  queued and sent by background workers; the queue is bounded and a full queue drops
  the file with a counter, so close and the write path never wait. ``publish=on-evict``
  sends a file only when local eviction takes it (the cluster as a victim cache).
- **Fetch on miss**: the store asks it about a name that is not local
  (:mod:`kvfs.cluster.fetch`).
- **Delete**: an unlink (or a rename away) by a user removes the key in the cluster
  too; local eviction does not.
- **Failure**: every call has a deadline (:mod:`kvfs.cluster.link`); while the link
  is down lookups answer from local data only and publishes are dropped (counted).

Ops of one path run in order, one at a time; different paths in parallel. Everything
runs on the trio thread, like the store; it calls only the store's public methods.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import trio

from kvfs.cluster.client import (
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    Client,
    ClusterError,
    MooncakeClient,
)
from kvfs.cluster.config import ClusterConfig
from kvfs.cluster.fetch import FETCH_PREFIX, Fetcher
from kvfs.cluster.link import Link
from kvfs.cluster.statistics import ClusterStatistics
from kvfs.common.errors import KvfsError
from kvfs.common.timing import Histogram
from kvfs.format.clustervalue import KIND_DIR, KIND_FILE, pack_header, unpack_header
from kvfs.format.records import FLAG_QUARANTINED, FLAG_WRITING
from kvfs.store.facade import Store
from kvfs.store.types import FileView

log = logging.getLogger(__name__)


@dataclass
class _Op:
    kind: str  # "publish" | "delete"
    ino: int = 0
    mtime: int = 0
    pinned: bool = False  # on-evict: the file is GONE, held open until it is sent


class Cluster:
    """One node's view of the cluster tier, over one store; subscribe it to the store
    (``store.subscribe(Cluster(store, cfg))``) before the store runs."""

    name = "cluster"
    """The key of its statistics in ``kvfs stats`` and of its metrics."""

    def __init__(
        self,
        store: Store,
        cfg: ClusterConfig,
        connect: Callable[[ClusterConfig], Client] = MooncakeClient,
    ) -> None:
        self.store, self.cfg = store, cfg
        self.stats = ClusterStatistics(master=cfg.master, publish_mode=cfg.publish)
        self.link = Link(cfg, connect, self.stats, on_down=lambda: self.fetcher.forget_misses())
        self.fetcher = Fetcher(store, cfg, self.link, self.stats)
        self.publish_latency = Histogram()
        self._pending: collections.OrderedDict[bytes, collections.deque[_Op]] = (
            collections.OrderedDict()
        )
        self._busy: dict[bytes, collections.deque[_Op]] = {}
        self._depth = 0
        self._work = trio.lowlevel.ParkingLot()
        self._dirs_sent: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._nursery: trio.Nursery | None = None
        self._pinned = 0

    @property
    def up(self) -> bool:
        """Whether the cluster answers (else: local data only)."""
        return self.link.up

    # ------------------------------------------------------------------ lifecycle
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.link.run_prober)
            for _ in range(self.cfg.workers):
                nursery.start_soon(self._worker)
            task_status.started()
            await trio.sleep_forever()

    def stop(self) -> None:
        """Unmount: no more calls, publishes or reconnects; calls in flight are
        abandoned when the store's nursery is cancelled. Returns at once, whatever the
        cluster does; the client is left as it is (see :data:`kvfs.cluster.client._KEPT`)."""
        self.link.stop()

    def statistics(self) -> ClusterStatistics:
        s = self.stats
        s.state = "up" if self.up else ("connecting" if s.reconnects == 0 else "down")
        s.publish_queue = self._depth
        fetch = self.fetcher.latency
        s.fetch_seconds = {"count": fetch.count, "sum": fetch.sum}
        s.publish_seconds = {
            "count": self.publish_latency.count,
            "sum": self.publish_latency.sum,
        }
        return s

    def report(self) -> dict[str, Any]:
        return asdict(self.statistics())

    def histograms(self) -> dict[str, Histogram]:
        return {"fetch": self.fetcher.latency, "publish": self.publish_latency}

    @property
    def negative_timeout(self) -> float:
        """How long the kernel may cache a miss: a name may appear in the cluster."""
        return self.cfg.negative

    async def missed(self, parent: int, name: bytes) -> None:
        """A name not here: the cluster's copy, made local (:mod:`kvfs.cluster.fetch`)."""
        await self.fetcher.missed(parent, name)

    # ------------------------------------------------------------------ hooks (sync)
    def closed(self, inode: FileView) -> None:
        """A handle that wrote ``inode`` was closed and the file is committed."""
        if self.cfg.publish == "on-close":
            self._queue_publish(inode)

    def renamed(
        self, inode: FileView, old_parent: int, old: bytes, old_dir_path: bytes | None
    ) -> None:
        """``inode`` was renamed from ``old`` in ``old_parent`` (its old directory's
        path taken before the rename)."""
        if inode.ino in self.fetcher.fetching or old.startswith(FETCH_PREFIX):
            return
        if old_dir_path is not None and not inode.is_dir and self.store.managed(old_parent):
            self._queue_delete(old_dir_path + b"/" + old if old_dir_path else old)
        if not inode.is_dir and self.cfg.publish == "on-close":
            self._queue_publish(inode)

    def unlinked(self, dir_path: bytes | None, name: bytes, parent: int) -> None:
        """A user removed the file ``name`` from ``parent`` (its path taken before)."""
        if dir_path is None or name.startswith(FETCH_PREFIX) or not self.store.managed(parent):
            return
        self._queue_delete(dir_path + b"/" + name if dir_path else name)

    def evicted(self, inode: FileView) -> None:
        """Local eviction takes ``inode`` (before its names go): in ``on-evict`` mode it
        is held open until sent, if the queue has room."""
        if self.cfg.publish != "on-evict" or not self.up or inode.ino in self.fetcher.fetching:
            return
        path = self.store.path_of(inode.ino)
        if path is None or not self.store.managed(inode.parent):
            return
        if self._depth >= self.cfg.queue or self._pinned >= 2 * self.cfg.workers:
            self.stats.publish_dropped += 1  # evicted for room: only a few held back
            return
        self._pinned += 1
        self.store.hold(inode.ino)  # released by the worker: its units stay until then
        self._enqueue(path, _Op("publish", inode.ino, inode.mtime_ns, pinned=True))

    # ------------------------------------------------------------------ the queue
    def _queue_publish(self, inode: FileView) -> None:
        if inode.ino in self.fetcher.fetching or inode.is_dir or not self.up:
            if not self.up:
                self.stats.publish_dropped += 1
            return
        if not self.store.managed(inode.parent) or inode.name.startswith(FETCH_PREFIX):
            return
        path = self.store.path_of(inode.ino)
        if path is None:
            return
        q = self._busy.get(path) or self._pending.get(path)
        if q and q[-1].kind == "publish" and q[-1].ino == inode.ino:
            q[-1].mtime = inode.mtime_ns
            return  # already waiting: it reads the file when its turn comes
        if self._depth >= self.cfg.queue:
            self.stats.publish_dropped += 1
            return
        self._enqueue(path, _Op("publish", inode.ino, inode.mtime_ns))

    def _queue_delete(self, path: bytes) -> None:
        if not self.up:
            self.stats.delete_failed += 1
            return
        if self._depth >= self.cfg.queue:
            self.stats.delete_failed += 1
            return
        self._enqueue(path, _Op("delete"))

    def _enqueue(self, path: bytes, op: _Op) -> None:
        """Ops of one path run in order, one at a time; different paths in parallel."""
        q = self._busy.get(path)
        if q is None:
            q = self._pending.get(path)
            if q is None:
                q = self._pending[path] = collections.deque()
        q.append(op)
        self._depth += 1
        self._work.unpark()

    async def _worker(self) -> None:
        while True:
            if not self._pending:
                await self._work.park()
                continue
            path, q = self._pending.popitem(last=False)
            self._busy[path] = q
            try:
                while q:
                    op = q.popleft()
                    try:
                        if op.kind == "publish":
                            await self._publish(path, op)
                        else:
                            await self._delete(path)
                    except ClusterError:
                        if op.kind == "publish":
                            self.stats.publish_failed += 1
                        else:
                            self.stats.delete_failed += 1
                    finally:
                        self._depth -= 1  # counted until done: queued or being sent
                        if op.pinned:
                            self._pinned -= 1
                            self.store.let_go(op.ino)
            finally:
                del self._busy[path]

    async def _publish(self, path: bytes, op: _Op) -> None:
        store = self.store
        inode = store.find_inode(op.ino)
        if inode is None or not self._publishable(inode, path, op):
            self.stats.publish_skipped += 1
            return
        t0 = time.monotonic()
        version = (inode.size, inode.mtime_ns)
        if not op.pinned:
            store.hold(inode.ino)  # not evicted while read (and not counted as a use)
        try:
            data = await store.read_file(inode.ino)
        except KvfsError as e:
            self.stats.publish_skipped += 1
            log.debug("cluster: %r not published: %s", path, e)
            return
        finally:
            if not op.pinned:
                self.store.let_go(inode.ino)
        if store.find_inode(op.ino) is not inode or (inode.size, inode.mtime_ns) != version:
            self.stats.publish_skipped += 1  # changed while read: its next close sends it
            return
        if not self._publishable(inode, path, op):
            self.stats.publish_skipped += 1
            return
        await self._send_dirs(path)
        part = self.cfg.part
        pieces = [data[i : i + part] for i in range(0, len(data), part)]  # none if empty
        header = pack_header(
            KIND_FILE, len(pieces), inode.mode, inode.uid, inode.gid, len(data), version[1], data
        )
        client = self.link.client
        if client is None:
            raise ClusterError("cluster down")
        budget = self.cfg.timeout + self.cfg.fetch_timeout
        for i, piece in enumerate(pieces):  # the parts first: a header names whole files
            key = self.cfg.key(f"p{i}", path)
            rc = self.link.check(
                await self.link.call(functools.partial(client.put, key, piece), budget), "put"
            )
            if rc != 0:
                self.stats.publish_failed += 1
                return
        fkey = self.cfg.key("f", path)
        rc = self.link.check(await self.link.call(lambda: client.put(fkey, header), budget), "put")
        if rc != 0:
            self.stats.publish_failed += 1
            return
        self.stats.published += 1
        self.stats.bytes_published += len(data)
        self.publish_latency.observe(time.monotonic() - t0)

    def _publishable(self, inode: FileView, path: bytes, op: _Op) -> bool:
        if self.store.has_missing_data(inode.ino):
            return False
        if op.pinned:  # evicted: GONE, no name any more, held open by the queue
            return not inode.flags & (FLAG_QUARANTINED | FLAG_WRITING)
        if not self.store.sendable(inode) or self.store.path_of(inode.ino) != path:
            return False  # changing, renamed (its new name is queued) or removed
        st = self.store.file_state(inode.ino)
        return st is None or not st.dirty

    async def _send_dirs(self, path: bytes) -> None:
        """Directory markers for every ancestor of ``path`` (once per directory per
        mount), so a node that lacks the directories can make them on lookup."""
        client = self.link.client
        ancestors = self.store.directories_on(path)  # resolved in one walk, before any await
        for d, inode in ancestors:
            if d in self._dirs_sent or client is None:
                continue
            header = pack_header(KIND_DIR, 0, inode.mode, inode.uid, inode.gid, 0, 0, b"")
            key = self.cfg.key("d", d)
            rc = self.link.check(
                await self.link.call(functools.partial(client.put, key, header), self.cfg.timeout),
                "put",
            )
            if rc == 0:
                self._dirs_sent[d] = None
                while len(self._dirs_sent) > 1 << 16:
                    self._dirs_sent.popitem(last=False)

    async def _delete(self, path: bytes) -> None:
        """Remove ``path``'s header, then its parts. Mooncake refuses to remove an object
        under a lease (one read or written less than a lease ago): retried until the
        lease ends, at most ``fetch_timeout`` seconds."""
        client = self.link.client
        if client is None:
            raise ClusterError("cluster down")
        fkey = self.cfg.key("f", path)
        header = unpack_header(await self.fetcher.get(fkey, self.cfg.timeout))
        keys = [fkey] + [self.cfg.key(f"p{i}", path) for i in range(header.parts if header else 0)]
        deadline = trio.current_time() + self.cfg.fetch_timeout
        removed = False
        for key in keys:
            delay = 0.05
            while True:
                rc = self.link.check(
                    await self.link.call(functools.partial(client.remove, key), self.cfg.timeout),
                    "remove",
                )
                if rc == 0:
                    removed = True
                    break
                if rc != OBJECT_HAS_LEASE or trio.current_time() + delay > deadline:
                    break
                await trio.sleep(delay)
                delay = min(1.0, delay * 2)
            if rc not in (0, OBJECT_NOT_FOUND):
                self.stats.delete_failed += 1
                return
        if removed:
            self.stats.deleted += 1
