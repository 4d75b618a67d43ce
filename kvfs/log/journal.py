"""The metadata log: checkpoint + journal in two alternating halves of the meta area.

Format (``docs/format.md``): the meta area on device 0 is split in two halves. A half
holds one *generation*: a checkpoint (CKPT_BEGIN, CKPT_DATA..., CKPT_END) followed by
journal transactions (TXN), every entry carrying the generation, a consecutive
sequence number and an xxh64 checksum; every device write ends with a COMMIT entry.
Recovery (:mod:`kvfs.log.recovery`, re-exported here) takes the newest half whose
checkpoint is complete and replays its transactions up to the first entry that is
torn, corrupt or out of sequence, feeding each payload to a sink as it goes (nothing
is collected). When a half's journal grows
past ``checkpoint_bytes`` (or the half fills) a fresh checkpoint is written into the
other half.

Concurrency contract: ``append`` is synchronous (callers hold no await between a
state change and its append, so log order = state order); it returns a transaction id
(monotonic for the journal's life, not the on-device sequence number). One flusher
task does every device write: a group commit flushes the data devices that saw
writes, then appends the pending transactions behind the last durable entry (the
block holding it is rewritten with its durable bytes unchanged), then flushes the meta
device, and only then wakes ``wait_durable`` callers.

Checkpoints never freeze the loop: ``snapshot()`` is called on the trio thread and
returns an iterator of CKPT_DATA payloads; the flusher calls ``next()`` (short) and
writes the pieces to the other half, awaiting between them, while group commits go on
in the current half. Every transaction appended after ``snapshot()`` was called (the
*window*) is also written into the new half after its CKPT_END, and the new half
becomes current only once that is durable: the new generation is the (fuzzy)
checkpoint plus every transaction since it began (``docs/design.md``, "Checkpoints").

The window must fit in the new half behind the checkpoint. Callers that append much
(an xattr, a create) first ``await admit(nbytes)``, which holds them while the
running checkpoint's window has no room for them (backpressure, before anything is
acknowledged). A window that outgrows the half anyway (small operations do not wait)
is not fail-stop: that attempt is abandoned (its half never becomes current: no
CKPT_END is written), its transactions stay pending, and a fresh checkpoint under a
new generation covers them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import trio
import trio.lowlevel

from kvfs.common.errors import DeviceError, NoSpace
from kvfs.common.timing import Histogram
from kvfs.devices.device import ALIGN, Device, aligned_buffer
from kvfs.format.geometry import META_FULL
from kvfs.format.halves import checkpoint_end, half_bounds
from kvfs.format.records import (
    ENTRY_OVERHEAD,
    ENTRY_VERSION,
    KIND_CKPT_BEGIN,
    KIND_CKPT_DATA,
    KIND_TXN,
    Op,
    commit_entry,
    encode_entry,
    encode_ops,
)
from kvfs.log.recovery import ApplySink, Damage, NullSink, Recovered, RecoverySink, recover, scan

log = logging.getLogger(__name__)

CKPT_WRITE = 1 << 20
"""Checkpoint pieces are gathered into device writes of about this many bytes."""
COMMIT_BYTES = ENTRY_OVERHEAD
"""Size of a COMMIT entry (empty payload)."""
ADMIT_SLACK = COMMIT_BYTES + 2 * ALIGN
"""What :meth:`Journal.admit` keeps free in a half beyond the log it counts: the
COMMIT entry and block rounding."""


@dataclass(frozen=True)
class JournalStatistics:
    generation: int
    half: int
    used_bytes: int
    half_bytes: int
    flushes: int
    checkpoints: int
    durable_seq: int
    """The last durable transaction id (what ``append`` returned)."""
    checkpoint_bytes: int = 0
    """Size of the current half's checkpoint (CKPT_BEGIN .. CKPT_END)."""
    checkpointing: bool = False
    """A checkpoint is being written into the other half right now."""
    journal_bytes: int = 0
    """Bytes of log written by group commits (TXN and COMMIT entries) this session."""
    last_checkpoint_s: float = 0.0
    """Wall time of the last completed checkpoint, snapshot to durable."""
    abandoned_checkpoints: int = 0
    """Checkpoints given up because their window outgrew the half (and retried)."""


class _HalfWriter:
    """Where the log of one half ends: each write starts at the block holding that
    end and rewrites the block's durable bytes (``tail``) unchanged."""

    def __init__(self, base: int, size: int, offset: int = 0, tail: bytes = b"") -> None:
        assert len(tail) == offset % ALIGN
        self.base, self.size, self.offset, self.tail = base, size, offset, tail

    def room(self) -> int:
        return self.size - self.offset


class Journal:
    """Appends transactions to the current half; checkpoints into the other."""

    def __init__(
        self,
        meta: Device,
        meta_start: int,
        meta_size: int,
        data_devices: list[Device],
        snapshot: Callable[[], Iterator[bytes]],
        *,
        seed: int,
        on_durable: Callable[[int], None] = lambda seq: None,
        checkpoint_bytes: int = 0,
        commit_interval: float = 0.05,
        io_timeout: float = 30.0,
    ) -> None:
        self._meta = meta
        self._meta_start, self._meta_size = meta_start, meta_size
        self._data_devices = data_devices
        self._snapshot = snapshot
        self._seed = seed
        self._on_durable = on_durable
        _, self._half_size = half_bounds(meta_start, meta_size, 0)
        self._checkpoint_bytes = checkpoint_bytes or self._half_size // 2
        self._interval = commit_interval
        self._io_timeout = io_timeout
        self.generation = 0
        self.half = 0
        self._writer: _HalfWriter | None = None  # None: nothing may be appended here
        self._entry_seq = 0  # sequence number of the current half's last entry
        self._ckpt_size = 0  # bytes of the current half's checkpoint
        self._txid = 0  # last transaction id handed out by append
        self._durable = 0  # last durable transaction id
        self._pending: list[tuple[int, bytes]] = []  # (txid, ops payload), not yet written
        self._pending_bytes = 0
        self._window: list[bytes] | None = None  # payloads since the running snapshot
        self._in_checkpoint = False
        self._window_bytes = 0
        self._attempted = 0  # the highest generation a checkpoint was begun under
        self._ckpt_estimate = 0  # bytes the running checkpoint is expected to take
        self._ckpt_written = 0  # bytes of the running checkpoint staged so far
        self._abandoned = 0
        self._dirty_devices: set[int] = set()
        self._wake = trio.Event()
        self._flushed = trio.Event()
        self._last_flush = time.monotonic()
        self._want_checkpoint = False
        self._ckpt_begun = self._ckpt_done = 0
        self._failed: DeviceError | None = None
        self._flushes = self._checkpoints = 0
        self._journal_bytes = 0
        self._last_ckpt_s = 0.0
        self.commit_latency = Histogram()
        """Seconds per group commit (its write and flush)."""
        self.checkpoint_latency = Histogram()
        """Seconds per checkpoint, snapshot to durable."""
        self._lock = trio.Lock()

    # ----------------------------------------------------------------- state
    def resume(self, found: Recovered, in_place: bool) -> None:
        """Continue after what recovery found. ``in_place`` (a clean unmount: the log
        ends right after its checkpoint, nothing torn can follow) appends to that
        half at once, if it is of the current entry version; otherwise the first
        flush writes a fresh checkpoint into the other half, so nothing is ever
        appended behind a torn tail (nor version-2 entries behind version-1 ones)."""
        self.generation, self.half = found.generation, found.half
        self._attempted = found.generation
        self._entry_seq = found.seq
        if in_place and found.version == ENTRY_VERSION:
            base, _ = half_bounds(self._meta_start, self._meta_size, self.half)
            self._writer = _HalfWriter(base, self._half_size, found.end, found.tail)
            self._ckpt_size = found.checkpoint_end
        else:
            self._want_checkpoint = True

    async def start(self) -> None:
        """Write the checkpoint that ``resume`` asked for, if it asked for one."""
        if self._want_checkpoint:
            await self.checkpoint()

    def append(self, ops: list[Op]) -> int:
        """Queue one atomic transaction; returns its transaction id (sync)."""
        self._txid += 1
        payload = encode_ops(ops)
        self._pending.append((self._txid, payload))
        self._pending_bytes += len(payload) + ENTRY_OVERHEAD + 8
        if self._window is not None:
            self._window.append(payload)
            self._window_bytes += len(payload) + ENTRY_OVERHEAD + 8
        if self._pending_bytes > (4 << 20):
            self._wake.set()
        return self._txid

    async def admit(self, nbytes: int) -> None:
        """Wait until a transaction of about ``nbytes`` encoded bytes may be appended,
        so that the next checkpoint and its window still fit a half: while a
        checkpoint runs, until its window has room for it (else until it is done);
        otherwise while everything logged since the last checkpoint plus this would
        overflow a half, until a fresh checkpoint. Append with no await after this
        returns. NoSpace if even a fresh checkpoint leaves no room (the metadata
        area is full); DeviceError once the log failed: nothing is acknowledged
        that could never be durable."""
        cost = nbytes + ENTRY_OVERHEAD + 8
        fresh = False
        while True:
            self.check_usable()
            if self._window is not None:
                if cost <= self._window_room():
                    return
                await self._flushed.wait()
                continue
            if self.next_checkpoint_bound + cost + ADMIT_SLACK <= self._half_size:
                return
            if fresh:
                raise NoSpace(
                    f"metadata area full: {cost} more bytes of log would not fit a half "
                    f"of {self._half_size} behind a {self._ckpt_size}-byte checkpoint"
                )
            await self.checkpoint()
            fresh = True

    def check_usable(self) -> None:
        """DeviceError (EIO) once the log has failed (sync): an operation that would
        log is refused before it changes anything, never acknowledged in vain."""
        if self._failed is not None:
            raise DeviceError(f"metadata log unavailable: {self._failed}")

    def _window_room(self) -> int:
        """Bytes the running checkpoint's window may still take in the new half: what
        the checkpoint leaves (at least its estimate) less the CKPT_END and COMMIT
        entries and a block of slack."""
        ckpt = max(self._ckpt_estimate, self._ckpt_written) + 2 * ENTRY_OVERHEAD + 8
        return self._half_size - ckpt - ADMIT_SLACK - self._window_bytes

    @property
    def next_checkpoint_bound(self) -> int:
        """An upper bound (state grows by no more than the log that records it) on
        the next checkpoint: the running one's estimate and window, else everything
        in the current half and pending."""
        if self._window is not None:
            return max(self._ckpt_estimate, self._ckpt_written) + self._window_bytes
        used = self._writer.offset if self._writer is not None else self._ckpt_size
        return used + self._pending_bytes

    async def checkpoint_settled(self) -> None:
        """Return once no checkpoint is being written."""
        while self._in_checkpoint:
            if self._failed is not None:
                raise DeviceError(f"metadata log unavailable: {self._failed}")
            await self._flushed.wait()

    @property
    def last_seq(self) -> int:
        """The last transaction id handed out by :meth:`append`."""
        return self._txid

    @property
    def durable_seq(self) -> int:
        """The last transaction id on stable storage."""
        return self._durable

    def note_data_write(self, device_index: int) -> None:
        """A data write completed; flush that device before the next journal write."""
        self._dirty_devices.add(device_index)

    async def wait_durable(self, seq: int | None = None) -> None:
        """Return once transaction ``seq`` (default: all so far) is on stable storage."""
        target = self._txid if seq is None else seq
        while self._durable < target:
            if self._failed is not None:
                raise DeviceError(f"metadata log unavailable: {self._failed}")
            self._wake.set()
            await self._flushed.wait()

    async def checkpoint(self) -> None:
        """Write a fresh checkpoint, one that starts after this call (a running one
        does not count), and wait until it is the current half."""
        target = self._ckpt_begun + 1
        self._want_checkpoint = True
        self._wake.set()
        while self._ckpt_done < target:
            if self._failed is not None:
                raise DeviceError(f"metadata log unavailable: {self._failed}")
            await self._flushed.wait()

    def request_checkpoint(self) -> None:
        """Start a checkpoint soon, without waiting for it (sync)."""
        self._want_checkpoint = True
        self._wake.set()

    @property
    def checkpointing(self) -> bool:
        """A checkpoint is being written (snapshot taken, new half not yet current)."""
        return self._in_checkpoint

    # ----------------------------------------------------------------- flusher
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The flusher task: group-commits pending transactions until cancelled."""
        task_status.started()
        while True:
            with trio.move_on_after(self._interval):
                await self._wake.wait()
            self._wake = trio.Event()
            if self._pending or self._want_checkpoint:
                await self.flush_once()

    async def flush_once(self) -> None:
        async with self._lock:
            try:
                if self._failed is not None:
                    # fail-stop: the failed batch is gone, so a later write would leave a
                    # sequence gap that recovery stops at, silently losing "durable" txns
                    self._pending.clear()
                    self._pending_bytes = 0
                elif self._want_checkpoint or self._needs_checkpoint():
                    await self._write_checkpoint()
                elif self._pending:
                    await self._write_pending()
            except DeviceError as e:
                log.error("metadata log write failed: %s", e)
                self._failed = e
            finally:
                self._signal()

    def _signal(self) -> None:
        """Wake whoever waits for durability (after any write, or a failure)."""
        flushed, self._flushed = self._flushed, trio.Event()
        flushed.set()
        self._on_durable(self._durable)

    def _needs_checkpoint(self) -> bool:
        if self._writer is None:
            return True
        grown = self._writer.offset - self._ckpt_size + self._pending_bytes
        # at half of the room the last checkpoint left at most, so that the window of
        # the next one has the other half of it, in both halves
        limit = min(self._checkpoint_bytes, (self._half_size - self._ckpt_size) // 2)
        return grown > limit or not self._fits_pending()

    def _fits_pending(self) -> bool:
        """The pending transactions fit in the current half (with their COMMIT)."""
        w = self._writer
        return w is not None and self._pending_bytes + COMMIT_BYTES + ALIGN <= w.room()

    async def _write_pending(self) -> None:
        """One group commit into the current half."""
        assert self._writer is not None
        pending, self._pending = self._pending, []
        self._pending_bytes = 0
        seq = self._entry_seq
        gen, seed = self.generation, self._seed
        parts = []
        for _, payload in pending:
            seq += 1
            parts.append(encode_entry(KIND_TXN, gen, seq, payload, seed))
        seq += 1
        parts.append(commit_entry(gen, seq, seed))
        data = b"".join(parts)
        t0 = time.monotonic()
        await self._write(self._writer, data, self._take_dirty(), flush_meta=True)
        self.commit_latency.observe(time.monotonic() - t0)
        self._entry_seq = seq
        self._durable = pending[-1][0]
        self._flushes += 1
        self._journal_bytes += len(data)
        self._last_flush = time.monotonic()

    def _take_dirty(self) -> list[int]:
        dirty, self._dirty_devices = sorted(self._dirty_devices), set()
        return dirty

    async def _write_checkpoint(self) -> None:
        """Write generation+1 into the other half from ``snapshot()``'s pieces while
        group commits go on in this half; then the window's transactions behind its
        CKPT_END, and switch once that is durable."""
        t0 = time.monotonic()
        # a fresh generation even after an abandoned attempt: that one's entries
        # may linger in the half and must never pass for this one's
        generation, half = max(self.generation, self._attempted) + 1, 1 - self.half
        self._attempted = generation
        base, _ = half_bounds(self._meta_start, self._meta_size, half)
        new = _HalfWriter(base, self._half_size)
        self._want_checkpoint = False
        self._ckpt_begun += 1
        begun = self._ckpt_begun
        self._ckpt_estimate = max(self._ckpt_estimate, self.next_checkpoint_bound)
        self._ckpt_written = 0
        self._window, self._window_bytes = [], 0
        self._in_checkpoint = True
        try:
            pieces = self._snapshot()
            seed = self._seed
            seq = 1
            stage = [encode_entry(KIND_CKPT_BEGIN, generation, seq, b"", seed)]
            staged = len(stage[0])
            count = 0
            for payload in pieces:  # each next() is short, on this (the trio) thread
                if not payload:  # a pause: the snapshot scanned without producing
                    await self._commit_meanwhile()
                    continue
                seq += 1
                count += 1
                entry = encode_entry(KIND_CKPT_DATA, generation, seq, payload, seed)
                stage.append(entry)
                staged += len(entry)
                self._ckpt_written = new.offset + staged
                if staged >= CKPT_WRITE:
                    await self._write(new, b"".join(stage), [], flush_meta=False)
                    stage, staged = [], 0
                await self._commit_meanwhile()
            seq += 1
            stage.append(checkpoint_end(generation, seq, count, seed))
            ckpt_size = new.offset + staged + len(stage[-1])
            # the window ends here: from now on appends wait for the new half
            window, self._window = self._window, None
            last = self._txid
            for payload in window:
                seq += 1
                stage.append(encode_entry(KIND_TXN, generation, seq, payload, seed))
            seq += 1
            stage.append(commit_entry(generation, seq, seed))
            data = b"".join(stage)
            if len(data) > new.room() and ckpt_size + COMMIT_BYTES + ALIGN <= new.size:
                self._abandon(generation, ckpt_size, window)
                return
            self._pending.clear()
            self._pending_bytes = 0
            await self._write(new, data, self._take_dirty(), flush_meta=True)
        finally:
            self._window = None
            self._in_checkpoint = False
        self._ckpt_estimate = 0
        self.generation, self.half, self._writer = generation, half, new
        self._entry_seq, self._ckpt_size = seq, ckpt_size
        self._durable = max(self._durable, last)
        self._ckpt_done = begun  # a call waits for one begun after it: this one counts
        self._checkpoints += 1
        self._last_ckpt_s = time.monotonic() - t0
        self.checkpoint_latency.observe(self._last_ckpt_s)
        log.info(
            "checkpoint generation %d: %d pieces, %d bytes + %d window transaction(s), %.3f s",
            generation,
            count,
            ckpt_size,
            len(window),
            self._last_ckpt_s,
        )

    def _abandon(self, generation: int, ckpt_size: int, window: list[bytes]) -> None:
        """The checkpoint fits its half but its window does not: nothing more is
        written there (no CKPT_END: recovery ignores the half), the window's
        transactions stay pending in the current half, and a fresh checkpoint starts
        at once; it covers them (its snapshot is taken after them), and its window
        has the room this one's estimate lacked."""
        self._abandoned += 1
        self._ckpt_estimate = ckpt_size + self._window_bytes
        self._want_checkpoint = True
        self._wake.set()
        log.warning(
            "checkpoint generation %d abandoned: its %d window transaction(s) outgrew "
            "the half after its %d bytes; taking another",
            generation,
            len(window),
            ckpt_size,
        )

    async def _commit_meanwhile(self) -> None:
        """Between two checkpoint pieces: a group commit into the current half when
        one is due (someone waits, or the interval passed) and fits; a full half
        holds them back until the new one is current (backpressure, nothing lost)."""
        due = self._wake.is_set() or time.monotonic() - self._last_flush >= self._interval
        if self._pending and due and self._fits_pending():
            self._wake = trio.Event()
            await self._write_pending()
            self._signal()
        else:
            await trio.lowlevel.checkpoint()

    async def _write(
        self, writer: _HalfWriter, data: bytes, dirty: list[int], *, flush_meta: bool
    ) -> None:
        """Append ``data`` to ``writer``'s half: flush the ``dirty`` data devices, write
        from the start of the block holding the log's end (its durable bytes again,
        unchanged), zero-filled to a block, then flush the meta device if asked."""
        if len(data) > writer.room():
            raise DeviceError(
                f"metadata area too small: the log needs {writer.offset + len(data)} bytes "
                f"of a half that holds {writer.size} (reformat with a larger --meta-size)"
            )
        head = writer.tail
        start = writer.offset - len(head)
        n = len(head) + len(data)
        size = -(-n // ALIGN) * ALIGN
        buf = aligned_buffer(size)
        buf[: len(head)] = head
        buf[len(head) : n] = data
        devices = [self._data_devices[i] for i in dirty]

        def write() -> None:
            for dev in devices:
                dev.flush()
            # release the views even on error: a traceback holding one would make
            # buf.close() raise BufferError instead of the DeviceError
            with memoryview(buf) as whole, whole[:size] as view:
                self._meta.write(writer.base + start, [view])
            if flush_meta:
                self._meta.flush()

        try:
            # a hung device must not hang every commit: same deadline as data I/O; the
            # abandoned thread keeps ``buf`` alive through its views until it returns
            with trio.move_on_after(self._io_timeout):
                await trio.to_thread.run_sync(write, abandon_on_cancel=True)
                end = start + n
                writer.tail = bytes(buf[end - end % ALIGN - start : n])
                writer.offset = end
                buf.close()
                return
            raise DeviceError(
                f"{self._meta.path}: journal write missed its {self._io_timeout:g} s deadline"
            )
        except BaseException:
            with contextlib.suppress(BufferError):
                buf.close()  # BufferError: the abandoned thread still uses it
            raise

    @property
    def metadata_full(self) -> bool:
        """The last complete checkpoint fills more than META_FULL of a half: refuse
        growth.

        Between checkpoints the state can only grow by what the journal holds, and
        the journal part of a half is at least 1 - META_FULL of it, so the next
        checkpoint always fits (docs/design.md, "Limits")."""
        return self._ckpt_size > self._half_size * META_FULL

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the last checkpoint written (or found at mount); 0 before one."""
        return self._ckpt_size

    def statistics(self) -> JournalStatistics:
        return JournalStatistics(
            self.generation,
            self.half,
            self._writer.offset if self._writer is not None else 0,
            self._half_size,
            self._flushes,
            self._checkpoints,
            self._durable,
            self._ckpt_size,
            self.checkpointing,
            self._journal_bytes,
            self._last_ckpt_s,
            self._abandoned,
        )


__all__ = [
    "ApplySink",
    "Damage",
    "Journal",
    "JournalStatistics",
    "NullSink",
    "Recovered",
    "RecoverySink",
    "recover",
    "scan",
]
