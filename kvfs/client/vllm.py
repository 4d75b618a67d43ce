"""A secondary tier for vLLM 0.32's offloading tiering (``OffloadingConnector`` with
``TieringOffloadingSpec``) that moves KV blocks with :mod:`kvfs.client.direct`:
straight between the raw devices and vLLM's CPU tier, never through FUSE. vLLM loads
it by name, no patch or registration::

    "secondary_tiers": [{"type": "KvfsTier", "module_path": "kvfs.vllm_tier",
                         "root_dir": "/mnt/kv/vllm"}]

It is vLLM's own ``fs`` tier (``FileSystemTierManager``) with only the byte movement
replaced, so everything else is vLLM's: the file names (``FileMapper``: the same
``<root>/<model>_<sha12>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin`` and
``config.json``), the lookup (the file's existence, ``FsAsyncLookupManager``), the
dual-queue thread pool, the job bookkeeping, events, and the options (``root_dir``,
``n_read_threads``, ``n_write_threads``, ``enable_kv_events``, ``locality``,
``backpressure``). The bytes of a block file are
the block's bytes, as vLLM writes them, so either tier reads a pool the other wrote.

Store (a job's blocks): a block whose file exists is skipped, as vLLM does; the others
are written at once by :func:`kvfs.client.direct.write_many` (one group commit) under
vLLM's temporary names (``<file>_<random>.tmp``), each durable and whole or absent,
then renamed to their names: a file appears under its name only whole, which the
existence lookup of every tier sharing the directory relies on (a direct write's file
exists, empty, until its commit). A failed job still publishes its whole blocks and
removes the rest.

Load: the blocks of a job are read at once (vLLM's tier reads them one after the
other), as one :func:`kvfs.client.direct.read_batch` into their slots of the CPU
tier (checksums verified). A missing file (evicted by kvfs, removed) fails
that block cleanly: vLLM marks it a miss and recomputes it. A short file is a failure
and is removed, as vLLM's tier does; a longer one is a failure; a unit failing its
checksum is EIO: never wrong bytes. As in vLLM's tier, a job that fails keeps the
blocks before the first failed one.

Backpressure: vLLM's contract is the tier's job results, and they are the fs tier's
(one result per job, ``transfer_bytes`` = blocks x block size, the job's submit time),
so a ``backpressure`` detector sees the same signal from either tier (its defaults
are the local ones for both).

Importing this module needs neither vLLM nor torch; :data:`KvfsTier` is built on top
of vLLM's class when vLLM asks for it. The bytes take :mod:`kvfs.client.direct`'s
route: the devices (a process that may open them: root), the mount daemon's ring (any
other user), or plain reads and writes through the file system (not kvfs), with the
same results; ``kvfs.direct.stats()`` counts which.
"""

from __future__ import annotations

import errno
import functools
import importlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import kvfs.client.direct

log = logging.getLogger(__name__)


@dataclass
class Statistics:
    """This process's block counts, every KvfsTier together."""

    blocks_stored: int = 0
    blocks_skipped: int = 0
    """Stores of a block whose file existed (written by any tier, or earlier)."""
    store_failures: int = 0
    blocks_loaded: int = 0
    load_failures: int = 0
    """Blocks that failed to load: missing (a clean miss), short, too long, EIO."""
    short_removed: int = 0
    """Short files removed after a failed load (vLLM's fs tier does the same)."""


_stats = Statistics()
_lock = threading.Lock()
_local = threading.local()


def stats() -> dict[str, int]:
    """This process's counters (see :class:`Statistics`)."""
    with _lock:
        return asdict(_stats)


def _count(**deltas: int) -> None:
    with _lock:
        for k, v in deltas.items():
            setattr(_stats, k, getattr(_stats, k) + v)


def _tmp_suffix() -> str:
    """vLLM's temporary-file suffix: ``_<random 63-bit>.tmp``, one per thread."""
    suffix: str | None = getattr(_local, "suffix", None)
    if suffix is None:
        suffix = _local.suffix = f"_{int.from_bytes(os.urandom(8), 'little') >> 1}.tmp"
    return suffix


def _blocks(view: memoryview, offsets: Sequence[int], block_size: int) -> list[memoryview]:
    """Each block's bytes in the CPU tier; an offset out of bounds is an error (a
    memoryview slice would silently come out short)."""
    flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    for off in offsets:
        if off < 0 or off + block_size > len(flat):
            raise ValueError(
                f"block offset {off} (block_size {block_size}) is out of "
                f"bounds for a buffer of size {len(flat)}"
            )
    return [flat[off : off + block_size] for off in offsets]


# ---------------------------------------------------------------------- stores
def store_blocks(
    paths: Sequence[str], view: memoryview, offsets: Sequence[int], block_size: int
) -> None:
    """Store block i (``view[offsets[i]:][:block_size]``) as file ``paths[i]`` unless
    that file exists: written direct under a temporary name, durable, then renamed.
    Raises the first error once every block is published or removed."""
    blocks = _blocks(view, offsets, block_size)
    todo = [(p, b) for p, b in zip(paths, blocks, strict=True) if not os.path.exists(p)]
    _count(blocks_skipped=len(paths) - len(todo))
    if not todo:
        return
    tmps = []
    for path, _ in todo:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmps.append(path + _tmp_suffix())
    failure: BaseException | None = None
    try:
        kvfs.client.direct.write_many(zip(tmps, (b for _, b in todo), strict=True))
    except Exception as e:
        failure = e  # every file is whole or absent now: publish the whole ones
    published = _publish(tmps, [p for p, _ in todo], block_size, failure is not None)
    _count(blocks_stored=published, store_failures=len(todo) - published)
    if failure is not None:
        raise failure


def _publish(tmps: list[str], dests: list[str], block_size: int, check: bool) -> int:
    """Rename each temporary file to its name (only whole ones when ``check``: after a
    failed batch), remove the rest; how many were published. Raises the first error of
    a rename, after trying every file."""
    published = 0
    error: OSError | None = None
    for tmp, dest in zip(tmps, dests, strict=True):
        try:
            if check and os.stat(tmp).st_size != block_size:
                raise OSError(errno.EIO, "not written whole", tmp)
            os.replace(tmp, dest)
            published += 1
        except OSError as e:
            if error is None and not check:
                error = e
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
            except OSError as cleanup:
                log.warning("Failed to remove temp file %s: %s", tmp, cleanup)
    if error is not None:
        raise error
    return published


# ---------------------------------------------------------------------- loads
def load_blocks(
    paths: Sequence[str], view: memoryview, offsets: Sequence[int], block_size: int
) -> None:
    """Read file ``paths[i]`` into block i of ``view``, all of them at once, one batch
    (:func:`kvfs.client.direct.read_batch`: on the ring, one message for the job). On
    a failure raises the OSError of the first failed block with ``num_succeeded`` =
    the blocks before it (vLLM keeps those), once every read is done and checked."""
    blocks = _blocks(view, offsets, block_size)
    reads = kvfs.client.direct.read_batch(zip(paths, blocks, strict=True))
    first: OSError | None = None
    for i, (path, block, read) in enumerate(zip(paths, blocks, reads, strict=True)):
        try:
            check_load(path, block, functools.partial(_outcome, read))
        except OSError as e:
            if first is None:
                e.num_succeeded = i  # type: ignore[attr-defined]  # vLLM's protocol
                first = e
    if first is not None:
        raise first


def _outcome(read: int | OSError) -> int:
    if isinstance(read, OSError):
        raise read
    return read


def check_load(path: str, block: memoryview, read: Callable[[], int]) -> None:
    """What ``read`` (a :func:`kvfs.client.direct.read_into` of ``path`` into
    ``block``) came to: exactly ``len(block)`` bytes, or an OSError."""
    try:
        n = read()
    except ValueError as e:  # longer than a block: not a block of this layout
        _count(load_failures=1)
        raise OSError(errno.EFBIG, f"{path}: longer than a {len(block)}-byte block") from e
    except OSError:
        _count(load_failures=1)
        raise
    if n < len(block):
        _count(load_failures=1)
        try:  # a short block file is corrupt for good: vLLM's fs tier removes it too
            os.remove(path)
            _count(short_removed=1)
        except OSError as e:
            log.warning("Failed to remove short-read file %s: %s", path, e)
        raise OSError(errno.EIO, f"Short read: expected {len(block)} bytes, read {n}", path)
    _count(blocks_loaded=1)


# ---------------------------------------------------------------------- the tier
class _KvfsIO:
    """What KvfsTier adds to vLLM's ``FileSystemTierManager`` (the next base class):
    its two job submissions, with this module's byte movement in place of
    ``fs.io.batch_store_block`` / ``batch_load_block``; the bookkeeping is the fs
    tier's, field for field, so its ``get_finished_jobs`` reports the jobs."""

    # the fs tier's fields (vLLM 0.32 ``FileSystemTierManager.__init__``)
    events: list[Any] | None
    file_mapper: Any
    _pool: Any
    _primary_kv_view: memoryview
    _block_size: int
    _store_job_keys: dict[int, list[Any]]
    _load_job_keys: dict[int, list[Any]]
    _job_block_counts: dict[int, int]
    _load_progress: dict[int, int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        root = os.path.dirname(self.file_mapper.get_config_file_path())
        log.info("KvfsTier at %s: route %s", root, kvfs.client.direct.route(root))

    def _job(self, job: Any) -> tuple[list[Any], list[str], list[int]]:
        keys = list(job.keys)
        paths = [self.file_mapper.get_file_name(k) for k in keys]
        offsets = [int(cid) * self._block_size for cid in job.chunk_ids]
        self._job_block_counts[job.job_id] = len(keys)
        return keys, paths, offsets

    def submit_store(self, job_metadata: Any) -> None:
        keys, paths, offsets = self._job(job_metadata)
        if self.events is not None:
            self._store_job_keys[job_metadata.job_id] = keys
        task = functools.partial(
            store_blocks, paths, self._primary_kv_view, offsets, self._block_size
        )
        self._pool.enqueue_store(job_metadata.job_id, 1, [task])

    def submit_load(self, job_metadata: Any) -> None:
        job_id = job_metadata.job_id
        keys, paths, offsets = self._job(job_metadata)
        self._load_job_keys[job_id] = keys

        def load_task() -> None:
            try:
                load_blocks(paths, self._primary_kv_view, offsets, self._block_size)
            except OSError as exc:
                # written before the pool reports the job (as the fs tier does)
                self._load_progress[job_id] = getattr(exc, "num_succeeded", 0)
                log.debug("Load of %d blocks for job %s failed: %s", len(paths), job_id, exc)
                raise

        self._pool.enqueue_load(job_id, 1, [load_task])


_built: type | None = None


def __getattr__(name: str) -> Any:
    """``KvfsTier``: :class:`_KvfsIO` on vLLM's ``FileSystemTierManager``, built on
    first use so that importing this module needs no vLLM."""
    global _built
    if name != "KvfsTier":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _built is None:
        fs = importlib.import_module("vllm.v1.kv_offload.tiering.fs.manager")
        base = fs.FileSystemTierManager
        ns = {"__module__": __name__, "__qualname__": name, "__doc__": __doc__}
        _built = type(base)(name, (_KvfsIO, base), ns)
    return _built
