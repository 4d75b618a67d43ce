"""The cluster tier: Mooncake Store below the node-local pool (``docs/cluster.md``).

A mount started with ``--cluster mooncake://HOST:PORT?metadata=URL`` is a client of a
Mooncake Store master. Keys are paths inside the mount, so nodes that mount the same
layout share names; kvfs adds no protocol of its own between nodes.

- **Publish**: a file closed (or renamed into place) in a kvfs-managed directory is
  queued and sent by background workers; the queue is bounded and a full queue drops
  the file with a counter, so close and the write path never wait. ``publish=on-evict``
  sends a file only when local eviction takes it (the cluster as a victim cache).
- **Fetch on miss**: a lookup of a name that is not local asks the cluster (existence
  checks of concurrent lookups go out as one batch; misses are remembered for
  ``negative`` seconds). A hit is read, verified against the checksum it was published
  with, written to a local file under a temporary name and renamed into place, so a
  reader sees the whole file or nothing; the lookup then answers it as any file.
- **Delete**: an unlink (or a rename away) by a user removes the key in the cluster
  too; local eviction does not.
- **Failure**: every call has a deadline. A failed or late call marks the cluster
  down: lookups answer from local data only and publishes are dropped (counted) until
  a probe reconnects, every ``retry`` seconds.

The Mooncake client is blocking C++; its calls run in worker threads that a deadline
abandons. Everything else runs on the trio thread, like the store. The client is never
closed nor destroyed: see :data:`_KEPT` (an unmount never waits on the cluster).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import math
import os
import socket
import stat
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio

from kvfs.common import sizes
from kvfs.common.errors import Exists, KvfsError, UserError
from kvfs.common.timing import Histogram
from kvfs.evict.evictor import KVFS_MANAGED
from kvfs.format.clustervalue import KIND_DIR, KIND_FILE, Header, pack_header, unpack_header
from kvfs.format.records import FLAG_QUARANTINED, FLAG_WRITING
from kvfs.index.namespace import RENAME_NOREPLACE, ROOT_INO, Inode
from kvfs.store.posix import Caller

if TYPE_CHECKING:
    from kvfs.store.facade import Store

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEME = "mooncake"
PUBLISH_MODES = ("on-close", "on-evict")
FETCH_PREFIX = b".kvfs-fetch."
"""Temporary names of files being fetched (renamed into place once whole)."""


TCP_ANNOUNCE_ENV = "MC_TCP_BIND_ADDRESS"
"""Mooncake's transfer engine (0.3.x, its "new RPC mapping") announces this address to
peers; only the address, its listeners bind the wildcard whatever it says."""

# Mooncake's error codes (mooncake-store/include/types.h) that kvfs reads
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
_TRANSPORT_ERRORS = range(-999, -899)  # RPC_FAIL and its kin: the master is unreachable


_KEPT: list[Any] = []
"""Every Mooncake store set up in this process, referenced until the process ends.
Its ``close()``, its destructor and the teardown it registers with ``atexit`` all
unregister the node at the master and join the client's heartbeat thread while
holding the interpreter lock: with the master dead that froze the daemon for 13 s
(the thread retries the master) after its unmount. So kvfs never closes it: the
mount command ends the process with ``os._exit`` once the unmount is done (see
:func:`clients_made`), and the master drops the node's segment when the client's
lease there ends (its ``client_ttl``)."""


def clients_made() -> bool:
    """Whether a Mooncake client was set up here: the process must then end with
    ``os._exit`` (after flushing what it writes), never through the interpreter's
    exit, which would destroy the client (see :data:`_KEPT`)."""
    return bool(_KEPT)


class ClusterError(KvfsError):
    """A cluster call failed or missed its deadline (the tier goes down)."""

    errno = errno.EIO


# ---------------------------------------------------------------------- configuration
@dataclass
class ClusterConfig:
    """``--cluster mooncake://HOST:PORT?metadata=URL&knob=value...``"""

    master: str
    metadata: str
    segment: int = 512 << 20
    """Memory this node lends to the store (Mooncake's global segment)."""
    buffer: int = 128 << 20
    """The client's transfer buffer: an object (a part of a file) must fit in it."""
    part: int = 0
    """Largest object a file is cut into (default: a quarter of ``buffer``)."""
    publish: str = "on-close"
    timeout: float = 1.0
    """Deadline of a metadata call (existence, header, delete), seconds."""
    fetch_timeout: float = 10.0
    """Deadline of fetching one file's bytes, seconds."""
    negative: float = 2.0
    """Seconds a cluster miss is trusted (kvfs's own cache and the kernel's entry)."""
    retry: float = 1.0
    """Seconds between reconnection attempts while the cluster is down."""
    queue: int = 256
    """Publishes and deletes waiting at most; more are dropped (counted)."""
    workers: int = 4
    namespace: str = "kvfs"
    protocol: str = "tcp"
    device: str = ""
    local: str = ""
    """This node's address for the transfer engine (default: the one that reaches the
    master): its name in the cluster and the address it announces to peers."""

    def __post_init__(self) -> None:
        if not self.part:
            self.part = max(1 << 20, self.buffer // 4)
        if self.part > self.buffer:
            raise UserError(f"--cluster: part={self.part} is larger than buffer={self.buffer}")
        if self.publish not in PUBLISH_MODES:
            raise UserError(f"--cluster: publish must be one of {', '.join(PUBLISH_MODES)}")
        for name in ("timeout", "fetch_timeout", "negative", "retry"):
            if getattr(self, name) <= 0:
                raise UserError(f"--cluster: {name} must be positive")
        if self.queue < 1 or self.workers < 1:
            raise UserError("--cluster: queue and workers must be at least 1")


_SIZES = {"segment", "buffer", "part"}
_SECONDS = {"timeout", "fetch_timeout", "negative", "retry"}
_INTS = {"queue", "workers"}
_STRINGS = {"metadata", "publish", "namespace", "protocol", "device", "local"}


def parse_url(url: str) -> ClusterConfig:
    """``mooncake://HOST:PORT?metadata=URL[&knob=value...]`` -> the config (UserError
    with one line for anything else)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != SCHEME or not parts.netloc:
        raise UserError(f"--cluster {url!r}: expected {SCHEME}://MASTER_HOST:PORT?metadata=URL")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise UserError(f"--cluster {url!r}: the master needs HOST:PORT")
    values: dict[str, Any] = {}
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        key = key.replace("-", "_")
        try:
            if key in _SIZES:
                values[key] = sizes.parse_size(value)
            elif key in _SECONDS:
                values[key] = _seconds(value)
            elif key in _INTS:
                values[key] = int(value)
            elif key in _STRINGS:
                values[key] = value
            else:
                known = ", ".join(sorted(_SIZES | _SECONDS | _INTS | _STRINGS))
                raise UserError(f"--cluster: unknown knob {key!r} (known: {known})")
        except (ValueError, sizes.SizeError) as e:
            raise UserError(f"--cluster: {key}={value!r}: {e}") from None
    if not values.get("metadata"):
        raise UserError(f"--cluster {url!r}: needs ?metadata=URL (the metadata server)")
    return ClusterConfig(master=f"{parts.hostname}:{port}", **values)


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("not a positive number of seconds")
    return value


def check_client() -> None:
    """UserError (one line) when the Mooncake client cannot be imported here."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"--cluster needs the Mooncake client ({e}): pip install 'kvfs[cluster]' "
            "and apt-get install libibverbs1 librdmacm1 libnuma1"
        ) from None


def local_address(master: str) -> str:
    """The address of this host that routes to the master (no packet is sent)."""
    host = master.rsplit(":", 1)[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            addr: str = s.getsockname()[0]
            return addr
    except OSError:
        return "127.0.0.1"


# ---------------------------------------------------------------------- the client
class Client(Protocol):
    """What kvfs needs of a Mooncake Store client (blocking calls; rc < 0 = error)."""

    def exist(self, keys: Sequence[str]) -> list[int]: ...
    def get(self, key: str) -> bytes: ...
    def put(self, key: str, value: bytes) -> int: ...
    def remove(self, key: str) -> int: ...
    def health(self) -> int: ...


class MooncakeClient:
    """``mooncake.store.MooncakeDistributedStore``, set up for one node."""

    def __init__(self, cfg: ClusterConfig) -> None:
        from mooncake.store import (
            MooncakeDistributedStore,
        )

        # setup can hold the GIL while it retries an absent master (a daemon froze for
        # 90 s once): only once the master's port answers
        host, _, port = cfg.master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=cfg.timeout).close()
        except OSError as e:
            raise ClusterError(f"master {cfg.master}: {e}") from None
        local = cfg.local or local_address(cfg.master)
        # the transfer engine announces its RPC address from this variable, else from
        # the first interface that is not loopback, whatever local_hostname says
        os.environ.setdefault(TCP_ANNOUNCE_ENV, local)
        self._s = MooncakeDistributedStore()
        rc = self._s.setup(
            local, cfg.metadata, cfg.segment, cfg.buffer, cfg.protocol, cfg.device, cfg.master
        )
        if rc != 0:
            raise ClusterError(f"Mooncake setup with master {cfg.master} failed ({rc})")
        _KEPT.append(self._s)  # before anything can drop it (an abandoned connect)

    def exist(self, keys: Sequence[str]) -> list[int]:
        return list(self._s.batch_is_exist(list(keys)))

    def get(self, key: str) -> bytes:
        value: bytes = self._s.get(key)
        return value

    def put(self, key: str, value: bytes) -> int:
        rc: int = self._s.upsert(key, value)
        return rc

    def remove(self, key: str) -> int:
        rc: int = self._s.remove(key)
        return rc

    def health(self) -> int:
        rc: int = self._s.health_check()
        return rc


# ---------------------------------------------------------------------- statistics
@dataclass
class ClusterStatistics:
    state: str = "connecting"
    master: str = ""
    publish_mode: str = ""
    hits: int = 0
    """Lookups answered by fetching a file (or directory) from the cluster."""
    misses: int = 0
    """Lookups the cluster was asked and did not have."""
    negative_hits: int = 0
    """Lookups answered from the cache of recent cluster misses."""
    skipped_down: int = 0
    """Local misses not asked because the cluster was down."""
    fetch_failed: int = 0
    """Fetches that failed: unreachable, late, or bytes that did not verify."""
    checksum_failures: int = 0
    bytes_fetched: int = 0
    published: int = 0
    bytes_published: int = 0
    publish_dropped: int = 0
    publish_skipped: int = 0
    """Queued files that changed, went or could not be read before their turn."""
    publish_failed: int = 0
    publish_queue: int = 0
    """Publishes and deletes queued or being sent."""
    deleted: int = 0
    delete_failed: int = 0
    failures: int = 0
    """Times the cluster went down."""
    reconnects: int = 0
    fetch_seconds: dict[str, Any] = field(default_factory=dict)
    publish_seconds: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Op:
    kind: str  # "publish" | "delete"
    ino: int = 0
    mtime: int = 0
    pinned: bool = False  # on-evict: the file is GONE, held open until it is sent


class _Batch:
    """Existence checks waiting for one ``batch_is_exist``."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.done = trio.Event()
        self.result: list[int] | None = None


# ---------------------------------------------------------------------- the tier
class Cluster:
    """One node's view of the cluster tier, over one store."""

    def __init__(
        self,
        store: Store,
        cfg: ClusterConfig,
        connect: Callable[[ClusterConfig], Client] = MooncakeClient,
    ) -> None:
        self.store, self.cfg, self._connect = store, cfg, connect
        self.client: Client | None = None
        self.up = False
        self.stats = ClusterStatistics(master=cfg.master, publish_mode=cfg.publish)
        self.fetch_latency = Histogram()
        self.publish_latency = Histogram()
        self._limiter = trio.CapacityLimiter(2 * cfg.workers + 4)
        self._fetch_limiter = trio.CapacityLimiter(cfg.workers)
        self._negative: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._inflight: dict[tuple[int, bytes], trio.Event] = {}
        self._batch: _Batch | None = None
        self._pending: collections.OrderedDict[bytes, collections.deque[_Op]] = (
            collections.OrderedDict()
        )
        self._busy: dict[bytes, collections.deque[_Op]] = {}
        self._depth = 0
        self._work = trio.lowlevel.ParkingLot()
        self._wake_prober = trio.Event()
        self._fetching: set[int] = set()
        """Inodes kvfs is writing from the cluster: never published back."""
        self._dirs_sent: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._seq = 0
        self._pinned = 0

    # ------------------------------------------------------------------ lifecycle
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._prober)
            for _ in range(self.cfg.workers):
                nursery.start_soon(self._worker)
            task_status.started()
            await trio.sleep_forever()

    def stop(self) -> None:
        """Unmount: no more calls, publishes or reconnects; calls in flight are
        abandoned when the store's nursery is cancelled. Returns at once, whatever the
        cluster does; the client is left as it is (see :data:`_KEPT`)."""
        self._closing = True
        self.up = False
        self.client = None

    def statistics(self) -> ClusterStatistics:
        s = self.stats
        s.state = "up" if self.up else ("connecting" if s.reconnects == 0 else "down")
        s.publish_queue = self._depth
        s.fetch_seconds = {"count": self.fetch_latency.count, "sum": self.fetch_latency.sum}
        s.publish_seconds = {
            "count": self.publish_latency.count,
            "sum": self.publish_latency.sum,
        }
        return s

    @property
    def negative_timeout(self) -> float:
        """How long the kernel may cache a miss: a name may appear in the cluster."""
        return self.cfg.negative

    # ------------------------------------------------------------------ remote calls
    async def _call(self, fn: Callable[[], T], deadline: float) -> T:
        """A client call in a worker thread; a late or failed transport marks the tier
        down (ClusterError)."""
        if not self.up or self.client is None:
            raise ClusterError("cluster down")
        with trio.move_on_after(deadline):
            try:
                return await trio.to_thread.run_sync(
                    fn, limiter=self._limiter, abandon_on_cancel=True
                )
            except Exception as e:  # the binding raised: treat as a transport failure
                self._down(f"{type(e).__name__}: {e}")
                raise ClusterError(str(e)) from None
        self._down(f"a call missed its {deadline:g} s deadline")
        raise ClusterError("deadline")

    def _check(self, rc: int, what: str) -> int:
        if rc in _TRANSPORT_ERRORS:
            self._down(f"{what}: error {rc}")
            raise ClusterError(f"{what}: {rc}")
        return rc

    def _down(self, reason: str) -> None:
        if self.up:
            self.up = False
            self.stats.failures += 1
            log.warning(
                "cluster %s unreachable (%s): serving local data only, retrying every %g s",
                self.cfg.master,
                reason,
                self.cfg.retry,
            )
            self._negative.clear()
            self._wake_prober.set()

    async def _prober(self) -> None:
        """Connect, and reconnect while down: a new client when there is none, a
        health check of the one there is otherwise (Mooncake's client reconnects by
        itself once its master is back)."""
        while not self._closing:
            if not self.up:
                await self._try_connect()
            if self.up:
                self._wake_prober = trio.Event()
                with trio.move_on_after(5 * self.cfg.retry):
                    await self._wake_prober.wait()
                if self.up:
                    await self._health()
            await trio.sleep(self.cfg.retry)  # down (just now, or still): not at once

    def _probe(self) -> int:
        """0 when the master answers (in a worker thread): the client's health check
        alone stayed 0 for seconds after its master was killed, so an existence check
        of one key makes the round trip too."""
        client = self.client
        if client is None:
            return -1
        rc = client.health()
        if rc != 0:
            return rc
        found = client.exist([f"{self.cfg.namespace}/probe"])
        return found[0] if found and found[0] < 0 else 0

    async def _try_connect(self) -> None:
        try:
            with trio.fail_after(max(10.0, 5 * self.cfg.timeout)):
                if self.client is None:
                    cfg, connect = self.cfg, self._connect
                    self.client = await trio.to_thread.run_sync(
                        lambda: connect(cfg), abandon_on_cancel=True
                    )
                rc = await trio.to_thread.run_sync(self._probe, abandon_on_cancel=True)
        except Exception as e:  # unreachable, refused, late: try again later
            if self.stats.reconnects == 0 and self.stats.failures == 0:
                log.warning("cluster %s not reachable yet (%s); retrying", self.cfg.master, e)
                self.stats.failures += 1
            return
        if rc == 0 and not self._closing:
            self.up = True
            self.stats.reconnects += 1
            log.info("cluster %s up (node %s)", self.cfg.master, self.cfg.local or "auto")

    async def _health(self) -> None:
        client = self.client
        if client is None:
            return
        with contextlib.suppress(ClusterError):  # _call marked the tier down
            rc = await self._call(self._probe, self.cfg.timeout)
            if rc != 0:
                self._down(f"health check: error {rc}")

    # ------------------------------------------------------------------ keys
    def path_of(self, ino: int) -> bytes | None:
        """The path of ``ino`` inside the mount (no leading ``/``), or None."""
        inodes, parts = self.store.ns.inodes, list[bytes]()
        node = inodes.get(ino)
        for _ in range(4096):
            if node is None:
                return None
            if node.ino == ROOT_INO:
                return b"/".join(reversed(parts))
            parts.append(node.name)
            node = inodes.get(node.parent)
        return None

    def _key(self, kind: str, path: bytes) -> str:
        quoted = urllib.parse.quote_from_bytes(path, safe="/@-_.~+=,:")
        return f"{self.cfg.namespace}/{kind}/{quoted}"

    def _managed(self, parent: int) -> bool:
        """Files in ``parent`` take part (kvfs-managed top-level directories only:
        an engine that manages its own files keeps its own index, see docs)."""
        ev = self.store.evictor
        node = self.store.ns.inodes.get(parent)
        if node is None:
            return False
        if parent == ROOT_INO:
            return ev.default_policy == KVFS_MANAGED
        return ev.group_policy(ev.group_of(node)) == KVFS_MANAGED

    # ------------------------------------------------------------------ lookups
    async def lookup(self, parent: int, name: bytes) -> Inode | None:
        """A local miss of ``name`` in ``parent``: what the cluster has under its path,
        made local; None for a miss (or when the cluster cannot answer in time)."""
        if name.startswith(FETCH_PREFIX) or name in (b".", b".."):
            return None
        if not self.up:
            self.stats.skipped_down += 1
            return None
        if not self._managed(parent):
            return None
        dir_path = self.path_of(parent)
        if dir_path is None:
            return None
        path = dir_path + b"/" + name if dir_path else name
        expiry = self._negative.get(path)
        now = time.monotonic()
        if expiry is not None:
            if expiry > now:
                self.stats.negative_hits += 1
                return None
            del self._negative[path]
        key = (parent, name)
        waiting = self._inflight.get(key)
        if waiting is not None:
            await waiting.wait()
            return self.store.lookup(parent, name)
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
        return self.store.lookup(parent, name)

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
            client = self.client
            try:
                if client is None:
                    raise ClusterError("cluster down")
                found = await self._call(lambda: client.exist(batch.keys), self.cfg.timeout)
                if len(found) != len(batch.keys):
                    raise ClusterError("batch_is_exist answered the wrong count")
                if found and min(found) < 0:
                    self._check(min(found), "batch_is_exist")
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
            fkey, dkey = self._key("f", path), self._key("d", path)
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
            self.fetch_latency.observe(time.monotonic() - t0)
        else:
            self.stats.fetch_failed += 1
        return ok

    async def _get(self, key: str, deadline: float) -> bytes:
        client = self.client
        if client is None:
            raise ClusterError("cluster down")
        return await self._call(lambda: client.get(key), deadline)

    async def _fetch_file(self, parent: int, name: bytes, path: bytes, fkey: str) -> bool:
        header = unpack_header(await self._get(fkey, self.cfg.timeout))
        if header is None or header.kind != KIND_FILE:
            return False
        deadline = trio.current_time() + self.cfg.fetch_timeout
        pieces = []
        for i in range(header.parts):
            left = deadline - trio.current_time()
            if left <= 0:
                return False
            piece = await self._get(self._key(f"p{i}", path), left)
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
        header = unpack_header(await self._get(dkey, self.cfg.timeout))
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
        self._fetching.add(inode.ino)
        try:
            fh = await store.open(inode.ino, os.O_WRONLY, caller)
            try:
                if data:
                    await store.write(fh, 0, data)  # one call: copied once, into units
                await store.flush(fh)
            finally:
                await store.release(fh)
            if store.ns.inodes.get(inode.ino) is not inode or inode.flags & FLAG_WRITING:
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
            self._fetching.discard(inode.ino)

    # ------------------------------------------------------------------ hooks (sync)
    def closed(self, inode: Inode) -> None:
        """A handle that wrote ``inode`` was closed and the file is committed."""
        if self.cfg.publish == "on-close":
            self._queue_publish(inode)

    def renamed(
        self, inode: Inode, old_parent: int, old: bytes, old_dir_path: bytes | None
    ) -> None:
        """``inode`` was renamed from ``old`` in ``old_parent`` (its old directory's
        path taken before the rename)."""
        if inode.ino in self._fetching or old.startswith(FETCH_PREFIX):
            return
        if old_dir_path is not None and not inode.is_dir and self._managed(old_parent):
            self._queue_delete(old_dir_path + b"/" + old if old_dir_path else old)
        if not inode.is_dir and self.cfg.publish == "on-close":
            self._queue_publish(inode)

    def unlinked(self, dir_path: bytes | None, name: bytes, parent: int) -> None:
        """A user removed the file ``name`` from ``parent`` (its path taken before)."""
        if dir_path is None or name.startswith(FETCH_PREFIX) or not self._managed(parent):
            return
        self._queue_delete(dir_path + b"/" + name if dir_path else name)

    def evicted(self, inode: Inode) -> None:
        """Local eviction takes ``inode`` (before its names go): in ``on-evict`` mode it
        is held open until sent, if the queue has room."""
        if self.cfg.publish != "on-evict" or not self.up or inode.ino in self._fetching:
            return
        path = self.path_of(inode.ino)
        if path is None or not self._managed(inode.parent):
            return
        if self._depth >= self.cfg.queue or self._pinned >= 2 * self.cfg.workers:
            self.stats.publish_dropped += 1  # evicted for room: only a few held back
            return
        self._pinned += 1
        inode.opens += 1  # released by the worker: its units stay until then
        self._enqueue(path, _Op("publish", inode.ino, inode.mtime_ns, pinned=True))

    # ------------------------------------------------------------------ the queue
    def _queue_publish(self, inode: Inode) -> None:
        if inode.ino in self._fetching or inode.is_dir or not self.up:
            if not self.up:
                self.stats.publish_dropped += 1
            return
        if not self._managed(inode.parent) or inode.name.startswith(FETCH_PREFIX):
            return
        path = self.path_of(inode.ino)
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
                            self._unpin(op.ino)
            finally:
                del self._busy[path]

    def _unpin(self, ino: int) -> None:
        inode = self.store.ns.inodes.get(ino)
        if inode is not None:
            inode.opens -= 1
            self.store.maybe_drop(inode)

    async def _publish(self, path: bytes, op: _Op) -> None:
        store = self.store
        inode = store.ns.inodes.get(op.ino)
        if inode is None or not self._publishable(inode, path, op):
            self.stats.publish_skipped += 1
            return
        t0 = time.monotonic()
        version = (inode.size, inode.mtime_ns)
        if not op.pinned:
            inode.opens += 1  # not evicted while read (and not counted as a use)
        try:
            data = bytes(await store.reader.read(inode, 0, inode.size)) if inode.size else b""
        except KvfsError as e:
            self.stats.publish_skipped += 1
            log.debug("cluster: %r not published: %s", path, e)
            return
        finally:
            if not op.pinned:
                self._unpin(inode.ino)
        if store.ns.inodes.get(op.ino) is not inode or (inode.size, inode.mtime_ns) != version:
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
        client = self.client
        if client is None:
            raise ClusterError("cluster down")
        budget = self.cfg.timeout + self.cfg.fetch_timeout
        for i, piece in enumerate(pieces):  # the parts first: a header names whole files
            key = self._key(f"p{i}", path)
            rc = self._check(
                await self._call(functools.partial(client.put, key, piece), budget), "put"
            )
            if rc != 0:
                self.stats.publish_failed += 1
                return
        fkey = self._key("f", path)
        rc = self._check(await self._call(lambda: client.put(fkey, header), budget), "put")
        if rc != 0:
            self.stats.publish_failed += 1
            return
        self.stats.published += 1
        self.stats.bytes_published += len(data)
        self.publish_latency.observe(time.monotonic() - t0)

    def _publishable(self, inode: Inode, path: bytes, op: _Op) -> bool:
        if inode.ino in self.store.unreadable:
            return False
        if op.pinned:  # evicted: GONE, no name any more, held open by the queue
            return not inode.flags & (FLAG_QUARANTINED | FLAG_WRITING)
        if not self.store.sendable(inode) or self.path_of(inode.ino) != path:
            return False  # changing, renamed (its new name is queued) or removed
        st = self.store.file_state(inode.ino)
        return st is None or not st.dirty

    async def _send_dirs(self, path: bytes) -> None:
        """Directory markers for every ancestor of ``path`` (once per directory per
        mount), so a node that lacks the directories can make them on lookup."""
        client = self.client
        parts = path.split(b"/")[:-1]
        ancestors: list[tuple[bytes, Inode]] = []  # resolved in one walk, before any await
        node: Inode | None = self.store.ns.inodes.get(ROOT_INO)
        for depth, name in enumerate(parts, 1):
            node = self.store.lookup(node.ino, name) if node is not None else None
            if node is None or not node.is_dir:
                break
            ancestors.append((b"/".join(parts[:depth]), node))
        for d, inode in ancestors:
            if d in self._dirs_sent or client is None:
                continue
            header = pack_header(KIND_DIR, 0, inode.mode, inode.uid, inode.gid, 0, 0, b"")
            key = self._key("d", d)
            rc = self._check(
                await self._call(functools.partial(client.put, key, header), self.cfg.timeout),
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
        client = self.client
        if client is None:
            raise ClusterError("cluster down")
        fkey = self._key("f", path)
        header = unpack_header(await self._get(fkey, self.cfg.timeout))
        keys = [fkey] + [self._key(f"p{i}", path) for i in range(header.parts if header else 0)]
        deadline = trio.current_time() + self.cfg.fetch_timeout
        removed = False
        for key in keys:
            delay = 0.05
            while True:
                rc = self._check(
                    await self._call(functools.partial(client.remove, key), self.cfg.timeout),
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
