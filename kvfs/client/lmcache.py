"""An LMCache (0.5.6) storage backend that moves chunks with :mod:`kvfs.client.direct`:
straight between the raw devices and LMCache's CPU memory objects, never through
FUSE. One config block turns it on::

    storage_plugins: ["kvfs"]
    extra_config:
      storage_plugin.kvfs.module_path: kvfs.client.lmcache
      storage_plugin.kvfs.class_name: KvfsDirectBackend
      kvfs.path: /mnt/kv/lmcache        # a directory on a kvfs mount
      kvfs.threads: 4                   # optional: chunks moved at once (each way)
      kvfs.landing_chunks: 16           # optional: chunks retrieved into shared memory

Files are LMCache ``local_disk``'s: the same directory layout and names
(``<key>.pt``, ``/`` as ``-``), the same bytes (the memory object's raw bytes, no
header), so either backend reads what the other wrote. Unlike ``local_disk`` the
directory is the index: :meth:`contains` asks the file system, so a restarted engine
finds its chunks again, and a file kvfs evicted is a miss at once. LMCache keeps a
chunk's shape and dtype in memory only, so a file this process did not write is taken
as a full chunk of the engine's shape (LMCache stores only full chunks unless
``save_unfull_chunk``) and is served only if its size is exactly that.

Retrieves land in the plugin's own memory objects where it can: an LMCache
``TensorMemoryAllocator`` over ``kvfs.client.direct.aligned()`` memory of
``kvfs.landing_chunks`` full chunks (pages are used only as chunks land there, and
freed objects are reused), which the daemon's ring reads into in place; an
ordinary user's retrieve then makes no copy of its own (LMCache's CPU memory is its
own, so a chunk read into it is bounced once through shared memory). The engine
frees them as it frees any memory object (their allocator is their parent); when
they are all in use, or with ``kvfs.landing_chunks: 0``, a retrieve allocates from
LMCache's CPU backend as before.

Never wrong bytes: kvfs.client.direct verifies every unit's checksum, and anything short of
exactly the expected bytes (a missing, shorter or longer file, EIO) is a miss, never
data. Pins hold the file open, so kvfs does not evict a pinned chunk. The plugin never
evicts: point it at a ``kvfs-managed`` directory (kvfs evicts), or ``engine-managed``
when ``local_disk`` shares the directory. Not for layerwise mode.

Importing this module needs neither lmcache nor torch; LMCache's base class is looked
up when LMCache asks for :data:`KvfsDirectBackend`.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import kvfs.client.direct

log = logging.getLogger(__name__)
KNOWN = 1 << 16
"""Layouts of stored chunks kept in memory (bounded: an engine stores millions)."""

Key = Any
"""lmcache.utils.CacheEngineKey (hashable; ``to_string()`` names the file)."""
MemoryObj = Any
"""lmcache.v1.memory_management.MemoryObj (``byte_array``: its bytes, writable)."""


class _Layout(NamedTuple):
    shape: Any
    dtype: Any
    fmt: Any
    cached_positions: Any
    size: int
    """The file's bytes."""


class _Unmonitored:
    """Takes LMCache's allocator statistics calls and keeps nothing."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class _Backend:
    """The implementation; :data:`KvfsDirectBackend` is this class on top of LMCache's
    ``StoragePluginInterface`` (which gives the interface's defaults)."""

    def __init__(
        self,
        dst_device: str = "cpu",
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        extra: dict[str, Any] = (config.extra_config if config is not None else None) or {}
        path = extra.get("kvfs.path")
        if not path or metadata is None or local_cpu_backend is None:
            raise ValueError(
                "KvfsDirectBackend needs extra_config['kvfs.path'], the engine's "
                "metadata and a LocalCPUBackend (max_local_cpu_size > 0)"
            )
        self.path = os.path.abspath(str(path).removeprefix("file://"))
        os.makedirs(self.path, exist_ok=True)
        self.dst_device = dst_device
        self.config, self.metadata, self.loop = config, metadata, loop
        self.local_cpu_backend = local_cpu_backend
        self.fmt: Any = None  # the allocator's default (KV_2LTD), as the engine stores
        if metadata.use_mla:
            mm = importlib.import_module("lmcache.v1.memory_management")
            self.fmt = mm.MemoryFormat.KV_MLA_FMT
        threads = int(extra.get("kvfs.threads", 4))
        self._writers = ThreadPoolExecutor(threads, thread_name_prefix="kvfs-lmcache-put")
        self._lock = threading.Lock()
        self._known: OrderedDict[Key, _Layout] = OrderedDict()
        """Chunks this process stored, as its memory object described them (the
        newest :data:`KNOWN`; a file no longer known is taken as a full chunk)."""
        self._puts: set[Key] = set()
        self._pins: dict[Key, list[int]] = {}
        self._landing_bytes = max(int(extra.get("kvfs.landing_chunks", 16)), 0) * (
            self.full_chunk_bytes()
        )
        self._landing: Any = None  # made at the first retrieve
        self.counters = {"stored": 0, "store_failed": 0, "hits": 0, "misses": 0}

    def __str__(self) -> str:
        return "KvfsDirectBackend"

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def key_path(self, key: Key) -> str:
        """Where ``local_disk`` keeps ``key`` in this directory."""
        return os.path.join(self.path, key.to_string().replace("/", "-") + ".pt")

    def full_chunk_bytes(self) -> int:
        """Bytes of one full chunk of the engine's KV (every layer group)."""
        return sum(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in zip(
                self.metadata.get_shapes(), self.metadata.get_dtypes(), strict=True
            )
        )

    def _layout(self, key: Key) -> _Layout | None:
        """How to allocate ``key``'s memory object, or None if it is not here
        (absent, being stored, or a file not of the chunk's size)."""
        with self._lock:
            if key in self._puts:
                return None
            known = self._known.get(key)
        try:
            size = os.stat(self.key_path(key)).st_size
        except OSError:
            return None
        if known is None:
            full = self.metadata.get_shapes(), self.metadata.get_dtypes(), self.fmt
            known = _Layout(*full, None, self.full_chunk_bytes())
        return known if size == known.size else None

    # ------------------------------------------------------------ lookup
    def contains(self, key: Key, pin: bool = False) -> bool:
        if self._layout(key) is None:
            return False
        return self.pin(key) if pin else True

    def exists_in_put_tasks(self, key: Key) -> bool:
        with self._lock:
            return key in self._puts

    def pin(self, key: Key) -> bool:
        """Hold the file open: kvfs never evicts a file with an open handle."""
        try:
            fd = os.open(self.key_path(key), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        with self._lock:
            self._pins.setdefault(key, []).append(fd)
        return True

    def unpin(self, key: Key) -> bool:
        with self._lock:
            fds = self._pins.get(key)
            fd = fds.pop() if fds else None
            if fds == []:
                del self._pins[key]
        if fd is None:
            return False
        os.close(fd)
        return True

    def touch_cache(self) -> None:
        """No recency of its own to update: kvfs sees the reads."""

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Key], pin: bool = False
    ) -> int:
        hits = 0
        for key in keys:
            if not self.contains(key, pin):
                break
            hits += 1
        return hits

    # ------------------------------------------------------------ store
    def batched_submit_put_task(
        self,
        keys: Sequence[Key],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[Key], None] | None = None,
    ) -> list[Future[None]]:
        """Write each chunk not already here, asynchronously; a chunk is found by
        :meth:`contains` only once its file is durable."""
        jobs = []
        for key, obj in zip(keys, objs, strict=True):
            if self._layout(key) is not None:
                continue  # here already: a chunk's key names its bytes
            with self._lock:
                if key in self._puts:
                    continue
                self._puts.add(key)
            obj.ref_count_up()  # the caller drops its reference when we return
            jobs.append(self._writers.submit(self._put, key, obj, on_complete_callback))
        return jobs

    def _put(self, key: Key, obj: MemoryObj, done: Callable[[Key], None] | None) -> None:
        meta, path, layout = obj.metadata, self.key_path(key), None
        try:
            buf = obj.byte_array
            kvfs.client.direct.write_from(path, buf)  # durable, or no file
            layout = _Layout(meta.shape, meta.dtype, meta.fmt, meta.cached_positions, len(buf))
        except Exception:
            log.exception("kvfs: storing %s failed", path)
        finally:
            obj.ref_count_down()
            with self._lock:  # known before it stops being a put: never a gap
                if layout is not None:
                    self._known[key] = layout
                    if len(self._known) > KNOWN:
                        self._known.popitem(last=False)
                self._puts.discard(key)
                self.counters["stored" if layout is not None else "store_failed"] += 1
        if done is not None and layout is not None:
            try:
                done(key)
            except Exception:
                log.exception("kvfs: on_complete_callback failed for %s", key)

    # ------------------------------------------------------------ retrieve
    def _allocate(self, key: Key) -> MemoryObj | None:
        layout = self._layout(key)
        if layout is None:
            return None
        landing = self._landing_allocator()
        if landing is not None:
            mm = importlib.import_module("lmcache.v1.memory_management")
            fmt = layout.fmt if layout.fmt is not None else mm.MemoryFormat.KV_2LTD
            obj = landing.allocate(layout.shape, layout.dtype, fmt)
            if obj is not None:
                return obj
        return self.local_cpu_backend.allocate(layout.shape, layout.dtype, layout.fmt)

    def _landing_allocator(self) -> Any:
        """LMCache's allocator over this plugin's shared memory (None when off)."""
        with self._lock:
            if self._landing is None and self._landing_bytes:
                try:
                    torch = importlib.import_module("torch")
                    tm = importlib.import_module(
                        "lmcache.v1.memory_allocators.tensor_memory_allocator"
                    )
                    memory = kvfs.client.direct.aligned(self._landing_bytes)
                    tensor = torch.frombuffer(memory, dtype=torch.uint8)  # keeps ``memory``
                    landing = tm.TensorMemoryAllocator(tensor, align_bytes=4096)
                except (ImportError, AttributeError, OSError, RuntimeError) as e:
                    log.warning("kvfs: no landing memory (%s): retrieves use LMCache's", e)
                    self._landing_bytes = 0  # tried once
                    return None
                landing.stats_monitor = _Unmonitored()  # LMCache's cache-usage gauges
                self._landing = landing  # are its CPU backend's, not this memory's
            return self._landing

    def landing_in_use(self) -> int:
        """Bytes of the landing memory held by memory objects the engine has not
        freed yet (0 when it is off or unused)."""
        with self._lock:
            landing = self._landing
        return int(landing.total_allocated_size) if landing is not None else 0

    def _load(self, key: Key, obj: MemoryObj | None) -> MemoryObj | None:
        """Fill ``obj`` with ``key``'s file; exactly its bytes or None (a miss)."""
        return self._load_all([key], [obj])[0]

    def _load_all(self, keys: list[Key], objs: list[MemoryObj | None]) -> list[MemoryObj | None]:
        """Each ``obj`` filled with its key's file as one
        :func:`kvfs.client.direct.read_batch` (on the ring: one message for all):
        exactly its bytes, or None (a miss, its object released)."""
        pairs = zip(keys, objs, strict=True)
        wanted = [(self.key_path(k), o.byte_array) for k, o in pairs if o is not None]
        reads = iter(kvfs.client.direct.read_batch(wanted))
        return [
            self._loaded(k, o, next(reads) if o is not None else None)
            for k, o in zip(keys, objs, strict=True)
        ]

    def _loaded(
        self, key: Key, obj: MemoryObj | None, got: int | OSError | None
    ) -> MemoryObj | None:
        if obj is None:
            self._count("misses")
            return None
        ok = isinstance(got, int) and got == len(obj.byte_array)
        if isinstance(got, FileNotFoundError):
            with self._lock:
                self._known.pop(key, None)
        elif isinstance(got, OSError):  # EIO (a bad unit), a file too long (EFBIG)
            log.warning("kvfs: %s not served: %s", self.key_path(key), got)
        if not ok:
            obj.ref_count_down()
            self._count("misses")
            return None
        with self._lock:
            known = self._known.get(key)
        if known is not None:
            obj.metadata.cached_positions = known.cached_positions
        self._count("hits")
        return obj

    def get_blocking(self, key: Key) -> MemoryObj | None:
        return self._load(key, self._allocate(key))

    def batched_get_blocking(self, keys: list[Key]) -> list[MemoryObj | None]:
        objs = [self._allocate(k) for k in keys]  # the allocator is not thread-safe
        return self._load_all(keys, objs)

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[Key], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        loop = asyncio.get_running_loop()
        objs = await loop.run_in_executor(None, self.batched_get_blocking, keys)
        got: list[MemoryObj] = []
        for obj in objs:  # the hits up to the first miss
            if obj is None:
                break
            obj.pin()  # as local_disk: the engine unpins after the retrieve
            got.append(obj)
        for obj in objs[len(got) :]:
            if obj is not None:
                obj.ref_count_down()
        return got

    # ------------------------------------------------------------ removal
    def remove(self, key: Key, force: bool = True) -> bool:
        with self._lock:
            self._known.pop(key, None)
        try:
            os.unlink(self.key_path(key))
        except FileNotFoundError:
            return False
        return True

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        self._writers.shutdown(wait=True)
        with self._lock:
            pins, self._pins = self._pins, {}
        for fds in pins.values():
            for fd in fds:
                os.close(fd)


_built: type | None = None


def __getattr__(name: str) -> Any:
    """``KvfsDirectBackend``: :class:`_Backend` as an LMCache StoragePluginInterface,
    built on first use so that importing this module needs no lmcache."""
    global _built
    if name != "KvfsDirectBackend":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _built is None:
        base = importlib.import_module("lmcache.v1.storage_backend.abstract_backend")
        plugin = base.StoragePluginInterface
        _built = type(plugin)(name, (_Backend, plugin), {"__module__": __name__})
    return _built
