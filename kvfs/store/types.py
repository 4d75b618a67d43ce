"""The data types the store, its write path (:mod:`kvfs.store.writer`) and its read path
(:mod:`kvfs.store.reader`) share: the store's settings, a file's runtime data state, an
open handle, what the store reports, and what its callers read of an inode. A module of
its own so that all of them can import these without importing each other."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Protocol

import trio

from kvfs.common.errors import KvfsError
from kvfs.evict.evictor import FRESH_GRACE
from kvfs.evict.policy import DEFAULT_POLICY

FILE_SIZE_LIMIT = 1 << 40
"""No file is larger than this (1 TiB), whatever the settings."""


class FileView(Protocol):
    """What the store's callers may read of a file or directory it hands them (the
    tiers that subscribe to its events see only this). The index's inode is one: a
    view over the index's columns, each read a column lookup, nothing copied, so the
    layers above the store name no type of the index."""

    @property
    def ino(self) -> int: ...
    @property
    def parent(self) -> int:
        """The directory of the inode's last name."""

    @property
    def name(self) -> bytes: ...
    @property
    def is_dir(self) -> bool: ...
    @property
    def size(self) -> int: ...
    @property
    def mtime_ns(self) -> int: ...
    @property
    def mode(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...
    @property
    def flags(self) -> int: ...
    @property
    def nlink(self) -> int: ...


class InodeView(FileView, Protocol):
    """A :class:`FileView` as the FUSE adapter reads it to build a request's
    attributes, and hands back to the store (:meth:`Store.allocated_bytes`)."""

    def times(self) -> tuple[int, int, int]:
        """(atime, mtime, ctime) in ns."""

    @property
    def units(self) -> tuple[int, ...]:
        """The unit map (``st_blocks`` is counted from it)."""

    @property
    def mapped_units(self) -> int: ...

    lookups: int
    """Kernel references (the FUSE lookup count): the adapter counts the entries it
    replies, :meth:`Store.forget` the kernel's forgets."""


@dataclass(frozen=True)
class StoreConfig:
    """Tunables, validated once; see ``docs/design.md`` for the measured reasons."""

    cache_bytes: int = 256 << 20
    readahead_units: int = 8
    writeback_units: int = 8
    stripe_units: int = 8
    read_piece_units: int = 4
    max_dirty_bytes: int = 512 << 20
    io_timeout: float = 30.0
    queue_depth: int = 4
    max_file_size: int = 0
    """Bytes a file may reach (EFBIG past it, before anything is evicted for it);
    0: a quarter of the pool. A top-level directory may set its own
    (``user.kvfs.max_file_size``). Never more than ``FILE_SIZE_LIMIT``."""
    reserve: float = 0.05
    """Share of the pool only root (and the mount's owner) may fill, as ext4's
    reserved blocks: another user can never starve them."""
    commit_interval: float = 0.05
    buffer_pool_bytes: int = 64 << 20
    eviction_policy: str = DEFAULT_POLICY
    default_policy: str = "kvfs-managed"
    fresh_grace: float = FRESH_GRACE
    """Seconds after its close during which a file is evicted only as a last resort."""
    high_watermark: float | None = None
    """Evict in the background above this used share (``None``: a headroom twice the
    writes in flight, at most 3 % of the pool or a GiB a device:
    :meth:`kvfs.evict.driver.EvictionDriver.headroom_units`)."""
    low_watermark: float | None = None
    """... down to this one (``None``: as much again under the high one)."""
    discard: bool = True

    def __post_init__(self) -> None:
        high, low = self.high_watermark, self.low_watermark
        if (high is not None and not 0 < high <= 1) or (low is not None and not 0 < low < 1):
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")
        if high is not None and low is not None and not low < high:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")
        for name in ("readahead_units", "writeback_units", "stripe_units", "read_piece_units"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.fresh_grace < 0:
            raise ValueError("fresh_grace must be >= 0")
        if self.io_timeout <= 0 or self.queue_depth < 1 or self.cache_bytes < 0:
            raise ValueError("io_timeout, queue_depth and cache_bytes must be positive")
        if not 0 <= self.reserve < 0.5:
            raise ValueError("the reserve must be a fraction in [0, 0.5)")
        if not 0 <= self.max_file_size <= FILE_SIZE_LIMIT:
            raise ValueError(f"the maximum file size must be at most {FILE_SIZE_LIMIT} bytes")


@dataclass(eq=False)
class FileState:
    """Runtime data state of one inode: dirty and in-flight units, writer count.

    ``error`` is sticky: once a write-back failed or a writer died mid-write, the
    file's bytes are not all stored, so every later write, read, flush and fsync of
    it fails (EIO), it is never committed, and its last close removes it."""

    dirty: dict[int, mmap.mmap] = field(default_factory=dict)
    inflight: dict[int, mmap.mmap] = field(default_factory=dict)
    busy: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    lock: trio.Lock = field(default_factory=trio.Lock)
    error: KvfsError | None = None
    writers: int = 0
    active: int = 0
    """``write`` calls in progress: while one is, a commit is no end of the file."""
    shrinks: int = 0
    """Truncates that shrank the file: a read that awaited across one retakes its
    bytes (the units it waited for may be gone, its length taken from the old size)."""
    resizing: int = 0
    """Shrinking truncates in progress (a SETATTR or an ``O_TRUNC`` open not yet
    answered): reads of the file wait until none is, so that no short reply reaches
    the kernel while it still holds the old size (it would zero-fill the rest of the
    pages and cache them as the file's bytes, ``docs/design.md``)."""
    settled: trio.Event = field(default_factory=trio.Event)
    """Set (and replaced) each time ``resizing`` drops back to 0."""


def check_failed(st: FileState) -> None:
    """Raise the file's sticky failure, if it has one."""
    if st.error is not None:
        raise st.error


@dataclass(frozen=True)
class Handle:
    ino: int
    writable: bool
    pid: int
    owner: tuple[int, int] | None = None
    """The opening process as (pid, start time): is it dying when it closes?"""
    uid: int = 0
    """The opener's user: what it holds open, it pins (bounded per user)."""
    direct: bool = False
    """Opened with O_DIRECT: answered ``direct_io`` if it may read, so the kernel asks
    its reads up to the caller's count, past EOF, never through the page cache; a
    short answer there is no sign of a stale size (``docs/design.md``, rule 6)."""
    shrinks: int = 0
    """The file's ``FileState.shrinks`` when this handle was opened (or when it, or
    the thread that opened it, last shrank the file): once another thread's truncate
    shrank the file, this one reads EIO,
    since the pieces of one read(2) (FUSE requests of at most 1 MiB) could otherwise
    come from two contents (``docs/design.md``, "Reads beside a truncate")."""
    readable: bool = True
    """Opened for reading (not O_WRONLY): what a ring ticket of a map may need."""


@dataclass(frozen=True)
class DeviceSpace:
    path: str
    data_bytes: int
    free_bytes: int
    writable: bool
    """False once the member failed a write (no new data goes there)."""


@dataclass(frozen=True)
class DirectoryUsage:
    """A top-level directory (an eviction and quota group): ``kvfs stats``, metrics."""

    name: str
    used_bytes: int
    """Bytes of device space its named files map (whole units), from running
    counters (``Space.placed``/``Space.charge``): no call walks the directory."""
    quota_bytes: int
    """Its ``user.kvfs.quota``, or the mount's default; 0: no quota."""
    policy: str
    """``kvfs-managed`` or ``engine-managed``."""


@dataclass(frozen=True)
class StoreStatistics:
    files: int
    directories: int
    unit_size: int
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    dirty_bytes: int
    pending_free_bytes: int
    reads: int
    stale_size_reads: int
    """Reads answered EIO because the kernel asked past a size it had not yet seen
    shrink (``docs/design.md``, "Reads beside a truncate", rule 5)."""
    writes: int
    bytes_read: int
    bytes_written: int
    device_bytes_read: int
    device_bytes_written: int
    corruptions: int
    incomplete: int
    evictions: int
    orphan_evictions: int
    quarantined: int
    unreadable_files: int
    """Files with data on a missing member (degraded mount): listed, reads fail."""
    open_handles: int
    bytes_read_memory: int = 0
    """Of ``bytes_read``: served from the daemon's memory (cache, readahead, unflushed
    writes, holes) without waiting for a device."""
    bytes_read_device: int = 0
    """Of ``bytes_read``: waited for a device read."""
    room_waits: int = 0
    """Writes that found the pool full and waited for eviction to make room (the
    background round keeps the headroom so that few do)."""
    room_wait_seconds: float = 0.0
    """Their wait, summed."""
    headroom_bytes: int = 0
    """What background eviction keeps free now (``docs/eviction.md``, "The headroom
    follows the writers")."""


@dataclass
class Traffic:
    """The store's request counters (what :class:`StoreStatistics` reports of them)."""

    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    stale_size_reads: int = 0
