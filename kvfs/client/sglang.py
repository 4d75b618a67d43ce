"""An SGLang (0.5.23) HiCache storage backend that moves pages with
:mod:`kvfs.client.direct`: straight between the raw devices and SGLang's host pages,
never through FUSE. SGLang loads it as a dynamic backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvfs",
        "module_path": "kvfs.sglang_storage", "class_name": "KvfsStorage",
        "file_storage_path": "/mnt/kv/sglang"}'

The directory is ``HiCacheFile``'s, resolved as it resolves it
(``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, else ``file_storage_path``, else
``/tmp/hicache``), and so are the files: :class:`KvfsStorage` *is* a ``HiCacheFile``
that only moves the bytes another way. Same names
(``<key>_<model>_<tp_rank>_<tp_size>.bin``, from ``HiCacheFile``'s own suffixes), same
bytes (the page tensor's raw bytes, no header), each file stored under a hidden
``.<uuid>.tmp`` name and renamed into place, so a name is there only when its page
is whole: either backend reads what the other wrote. ``exists``, ``batch_exists``,
``batch_exists_v2``, the metadata cache, the optional ``LRUFileEvictor``
(``max_size``...) and ``clear`` are ``HiCacheFile``'s, unchanged. The other keys of
the extra config are ``HiCacheFile``'s.

Reads: a page is served only if its file holds exactly the page's bytes, each unit
verified against its checksum. A missing file (never stored, evicted by kvfs or by
the evictor) is a clean miss: ``None``. Anything else (EIO, a file shorter or longer
than the page) is a failure, never data: :meth:`get` raises ``OSError``, as
``HiCacheFile`` does for a short read; ``batch_get`` logs it and answers ``None`` for
that page (SGLang takes the pages before the first ``None``; an exception would cost
the whole batch). A ``batch_get`` is one :func:`kvfs.client.direct.read_batch`: on
the aware ring, one message for all its pages. Writes: ``batch_set`` stores its new pages with one
:func:`kvfs.client.direct.write_many` (durable when it returns, one group commit),
then renames them into place; a failed batch leaves none of its new pages.

kvfs never evicts a file being read (the read holds it open). Point it at a
``kvfs-managed`` directory (SGLang never evicts unless ``max_size`` is set), or
``engine-managed`` when SGLang's evictor runs.

Importing this module needs neither sglang nor torch; SGLang's ``HiCacheFile`` is
looked up when SGLang asks for :data:`KvfsStorage`.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import logging
import os
import threading
import uuid
from typing import TYPE_CHECKING, Any

import kvfs.client.direct

log = logging.getLogger(__name__)

Tensor = Any
"""torch.Tensor (a host page: flat, contiguous)."""


class PageNotServed(OSError):
    """A page whose file is there but does not hold exactly the page's bytes."""


class _Storage:
    """The implementation; :data:`KvfsStorage` is this class on top of SGLang's
    ``HiCacheFile`` (which gives the names, ``exists``, the evictor and the rest)."""

    if TYPE_CHECKING:  # HiCacheFile's, at run time
        file_path: str
        metadata_cache: Any
        _evictor: Any

        def _get_suffixed_key(self, key: str) -> str: ...
        def exists(self, key: str) -> bool: ...

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        """``StorageBackendFactory`` calls ``KvfsStorage(storage_config, kwargs)``."""
        super().__init__(storage_config)  # type: ignore[call-arg]  # HiCacheFile's
        self._lock = threading.Lock()
        self.counters = {"hits": 0, "misses": 0, "failed": 0, "stored": 0, "store_failed": 0}

    def __str__(self) -> str:
        return f"KvfsStorage({self.file_path})"

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def page_path(self, key: str) -> str:
        """The file of ``key``'s page: ``HiCacheFile``'s name for it."""
        return os.path.join(self.file_path, f"{self._get_suffixed_key(key)}.bin")

    # ------------------------------------------------------------ reads
    def _load(self, key: str, target: Tensor) -> Tensor | None:
        """Fill ``target`` with ``key``'s page: exactly its bytes, or None if the file
        is not there; raises :class:`PageNotServed` (or the read's OSError) else."""
        return self._loaded_all([key], [target], raising=True)[0]

    def _loaded_all(
        self, keys: list[str], targets: list[Tensor], raising: bool
    ) -> list[Tensor | None]:
        """Every page read into its target as one :func:`kvfs.client.direct.read_batch`
        (on the ring: one message); per page the target, or None (no such file, or,
        unless ``raising``, a page not served whole)."""
        if any(t is None for t in targets):
            raise ValueError("KvfsStorage reads into a target page (a host tensor)")
        suffixed = [self._get_suffixed_key(k) for k in keys]
        paths = [os.path.join(self.file_path, f"{s}.bin") for s in suffixed]
        dests = [t if t.is_contiguous() else t.contiguous() for t in targets]
        reads = kvfs.client.direct.read_batch(zip(paths, dests, strict=True))
        out: list[Tensor | None] = []
        for key, name, path, target, dest, got in zip(
            keys, suffixed, paths, targets, dests, reads, strict=True
        ):
            try:
                out.append(self._served(name, path, target, dest, got))
            except OSError as e:
                if raising:
                    raise
                log.warning("kvfs: page %s not served: %s", key, e)
                out.append(None)
        return out

    def _served(
        self, suffixed: str, path: str, target: Tensor, dest: Tensor, got: int | OSError
    ) -> Tensor | None:
        """A page's read, checked: the target, None for a missing file; raises else."""
        if isinstance(got, FileNotFoundError):
            if self.metadata_cache is not None:
                self.metadata_cache.remove(suffixed)
            self._count("misses")
            return None
        if isinstance(got, OSError):
            self._count("failed")
            if got.errno == errno.EFBIG:  # a file longer than the page
                raise PageNotServed(f"{path}: {got}")
            raise got
        expected = target.numel() * target.element_size()
        if got != expected:
            self._count("failed")
            raise PageNotServed(f"{path}: {got} bytes, the page is {expected}")
        if dest is not target:
            target.copy_(dest)
        self._evictor.touch(suffixed, path)
        if self.metadata_cache is not None:
            self.metadata_cache.add(suffixed)
        self._count("hits")
        return target

    def get(
        self, key: str, target_location: Tensor = None, target_sizes: Any = None
    ) -> Tensor | None:
        """``target_location`` filled with ``key``'s page, or None (no such file);
        raises OSError for a page that cannot be served whole."""
        return self._load(key, target_location)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Tensor | None]:
        """Each page read into its target at once; None for a page not served."""
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return self._loaded_all(list(keys), list(targets), raising=False)

    # ------------------------------------------------------------ writes
    def set(
        self,
        key: str,
        value: Tensor = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store the pages not here yet; True when every page is here. As
        ``HiCacheFile``: a page here already is only touched, and the first page the
        evictor refuses ends the batch (the pages before it are stored)."""
        admitted: dict[str, tuple[str, Tensor]] = {}  # suffixed key -> (tmp, page)
        complete = True
        for key, value in zip(keys, values, strict=True):
            suffixed = self._get_suffixed_key(key)
            if suffixed in admitted:
                continue
            if self.exists(key):
                self._evictor.touch(suffixed, self.page_path(key))
                continue
            page = value.contiguous()
            if not self._evictor.reserve(suffixed, page.numel() * page.element_size(), key=key):
                complete = False
                break
            tmp = os.path.join(self.file_path, f".{uuid.uuid4().hex}.tmp")
            admitted[suffixed] = (tmp, page)
        if admitted and not self._store(admitted):
            return False
        return complete

    def _store(self, admitted: dict[str, tuple[str, Tensor]]) -> bool:
        """Write the pages to their temporary names, durably, then rename each into
        place. A failed write leaves none of them (each is whole or absent, and which
        is which is not told): their reservations are released."""
        try:
            kvfs.client.direct.write_many(admitted.values())
        except (OSError, ValueError) as e:
            log.error("kvfs: storing %d pages in %s failed: %s", len(admitted), self.file_path, e)
            for suffixed, (tmp, _) in admitted.items():
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                self._evictor.abort(suffixed)
            self._count("store_failed", len(admitted))
            return False
        ok = True
        for suffixed, (tmp, _) in admitted.items():
            try:
                os.replace(tmp, os.path.join(self.file_path, f"{suffixed}.bin"))
            except OSError as e:
                log.error("kvfs: placing page %s failed: %s", suffixed, e)
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                self._evictor.abort(suffixed)
                self._count("store_failed")
                ok = False
                continue
            self._evictor.commit(suffixed)
            if self.metadata_cache is not None:
                self.metadata_cache.add(suffixed)
            self._count("stored")
        return ok

    def close(self) -> None:
        """Nothing to stop: reads are batches of :mod:`kvfs.client.direct`."""


_built: type | None = None


def __getattr__(name: str) -> Any:
    """``KvfsStorage``: :class:`_Storage` as an SGLang ``HiCacheFile`` (so a
    ``HiCacheStorage``), built on first use so that importing this module needs no
    sglang."""
    global _built
    if name != "KvfsStorage":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _built is None:
        base = importlib.import_module("sglang.srt.mem_cache.hicache_storage").HiCacheFile
        _built = type(base)(name, (_Storage, base), {"__module__": __name__})
    return _built
