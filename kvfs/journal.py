"""The metadata log: checkpoint + journal in two alternating halves of the meta area.

Format (``docs/format.md``): the meta area on device 0 is split in two halves. A half
holds one *generation*: a checkpoint (CKPT_BEGIN, CKPT_DATA..., CKPT_END) followed by
journal transactions (TXN), every entry carrying the generation, a consecutive
sequence number and an xxh64 checksum. Recovery takes the newest half whose
checkpoint is complete and replays its transactions up to the first entry that is
torn, corrupt or out of sequence. When a half fills (or its journal grows past
``checkpoint_bytes``) a fresh checkpoint is written into the other half.

Concurrency contract: ``append`` is synchronous (callers hold no await between a
state change and its append, so log order = state order). One flusher task writes
batches: it flushes the data devices that saw writes, then the journal blocks, then
the meta device, and only then wakes ``wait_durable`` callers (group commit). Each
flush ends on a block boundary (a PAD entry), so a durable block is never rewritten.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import trio

from kvfs.device import ALIGN, Device, aligned_buffer
from kvfs.errors import Corruption, DeviceError
from kvfs.layout import (
    ENTRY_OVERHEAD,
    KIND_CKPT_BEGIN,
    KIND_CKPT_DATA,
    KIND_CKPT_END,
    KIND_PAD,
    KIND_TXN,
    PARSE_END,
    PARSE_MORE,
    PARSE_OK,
    Entry,
    Op,
    decode_ops,
    encode_entry,
    encode_ops,
    entry_header,
    pad_entry,
    parse_entry,
    peek_entry,
)

log = logging.getLogger(__name__)

READ_CHUNK = 8 << 20
META_FULL = 0.75
"""Fraction of a half a checkpoint may fill before growth is refused (ENOSPC)."""
CKPT_OPS = 4096
"""Operations per checkpoint entry (a few hundred KiB)."""


@dataclass(frozen=True)
class JournalStatistics:
    generation: int
    half: int
    used_bytes: int
    half_bytes: int
    flushes: int
    checkpoints: int
    durable_seq: int


@dataclass(frozen=True)
class Damage:
    """Entries lost in the middle of a log: a later, complete group commit proves
    that what lies between was durable once (kvfs writes a group commit only after
    the one before it is durable), so this is damage, not the torn end of a crash."""

    offset: int
    """Byte offset in the half of the first entry that failed."""
    first_seq: int
    lost: int
    """Sequence numbers skipped over (transactions and PAD entries)."""

    def __str__(self) -> str:
        return (
            f"damaged at byte {self.offset}: {self.lost} entries from sequence number "
            f"{self.first_seq} are lost, the complete transactions after them are kept"
        )


@dataclass
class Recovered:
    """What recovery found: the state's operations and where the log ended."""

    generation: int
    half: int
    end: int
    seq: int
    transactions: int
    ops: list[Op]
    fell_back: bool = False
    """The newest checkpoint was incomplete; this is the older half."""
    damage: list[Damage] = field(default_factory=list)
    """Mid-log damage skipped over; the transactions after it are in ``ops``."""


def half_bounds(meta_start: int, meta_size: int, half: int) -> tuple[int, int]:
    size = (meta_size // 2) // ALIGN * ALIGN
    return meta_start + half * size, size


def recover(dev: Device, meta_start: int, meta_size: int, seed: int) -> Recovered:
    """Find the newest complete checkpoint and replay its journal (blocking)."""
    candidates = []
    for half in (0, 1):
        base, _ = half_bounds(meta_start, meta_size, half)
        head = aligned_buffer(ALIGN)
        dev.read_into(base, memoryview(head))
        entry = peek_entry(bytes(head), seed)
        if entry is not None and entry.kind == KIND_CKPT_BEGIN:
            candidates.append((entry.generation, half))
    for i, (generation, half) in enumerate(sorted(candidates, reverse=True)):
        found = _replay_half(dev, meta_start, meta_size, half, generation, seed)
        if found is not None:
            found.fell_back = i > 0
            return found
        log.warning("checkpoint generation %d is incomplete; trying the older one", generation)
    raise Corruption("no complete metadata checkpoint found (not formatted, or destroyed)")


def _replay_half(
    dev: Device, meta_start: int, meta_size: int, half: int, generation: int, seed: int
) -> Recovered | None:
    base, size = half_bounds(meta_start, meta_size, half)
    reader = _HalfReader(dev, base, size, generation, seed)
    ops: list[Op] = []
    damage: list[Damage] = []
    complete, end, seq, txns = False, 0, 0, 0
    pos: int = 0
    expected: int | None = None
    while True:
        status, entry, nxt = reader.parse(pos, expected)
        if status != PARSE_OK or entry is None:
            resume = reader.resume_after(pos, expected) if complete else None
            if resume is None or expected is None:
                break
            damage.append(Damage(pos, expected, resume[1] - expected))
            pos, expected = resume
            continue
        if entry.kind in (KIND_CKPT_DATA, KIND_TXN):
            if entry.kind == KIND_TXN and not complete:
                break
            ops.extend(decode_ops(entry.payload))
            txns += entry.kind == KIND_TXN
        elif entry.kind == KIND_CKPT_END:
            complete = True
        pos, expected = nxt, entry.seq + 1
        end, seq = nxt, entry.seq
    if not complete:
        return None
    return Recovered(generation, half, end, seq, txns, ops, damage=damage)


def scan(
    dev: Device, base: int, size: int, generation: int, seed: int
) -> Iterator[tuple[int, Entry]]:
    """Yield (end offset in the half, entry) of one half's log up to its first bad
    entry (tools and tests: where each entry lies)."""
    reader = _HalfReader(dev, base, size, generation, seed)
    pos, expected = 0, None
    while True:
        status, entry, nxt = reader.parse(pos, expected)
        if status != PARSE_OK or entry is None:
            return
        yield nxt, entry
        pos, expected = nxt, entry.seq + 1


RESUME_SCAN = 32 << 20
"""How far past a bad entry recovery looks for the log to go on (bytes): further than
one group commit writes (a few MiB)."""


class _HalfReader:
    """Parses the entries of one half, reading the device forward in big pieces."""

    def __init__(self, dev: Device, base: int, size: int, generation: int, seed: int) -> None:
        self.dev, self.base, self.size = dev, base, size
        self.generation, self.seed = generation, seed
        self.buf = bytearray()
        self.start = 0  # half offset of buf[0]

    def _load(self, pos: int) -> bool:
        """Make the window start at or before ``pos`` and grow it by one piece;
        False at the end of the half."""
        if pos < self.start:  # a walk back (after a proof walk): start over there
            self.buf, self.start = bytearray(), pos - pos % ALIGN
        elif pos - self.start > READ_CHUNK:
            drop = (pos - self.start) // ALIGN * ALIGN
            del self.buf[:drop]
            self.start += drop
        have = self.start + len(self.buf)
        if have >= self.size:
            return False
        n = min(READ_CHUNK, self.size - have)
        chunk = aligned_buffer(n)
        try:
            self.dev.read_into(self.base + have, memoryview(chunk)[:n])
            self.buf += chunk[:n]
        finally:
            chunk.close()
        return True

    def parse(self, pos: int, expected: int | None) -> tuple[int, Entry | None, int]:
        """``parse_entry`` at half offset ``pos``, reading more of the half as needed."""
        while True:
            if pos >= self.start:
                status, entry, nxt = parse_entry(
                    memoryview(self.buf), pos - self.start, self.generation, expected, self.seed
                )
                if status != PARSE_MORE:
                    return status, entry, nxt + self.start
            if not self._load(pos):
                return PARSE_END, None, pos

    def resume_after(self, pos: int, expected: int | None) -> tuple[int, int] | None:
        """Where the log goes on after the bad entry at ``pos`` (offset, sequence
        number), if it provably does; None for a torn tail.

        Candidates: the entry right after the bad one when its header is intact (a
        flipped payload bit), else the first entry of this generation with a later
        sequence number at a block boundary (every group commit starts on one).
        The proof that this is not the torn end of the last write: walking on from
        the candidate reaches the end of a group commit (a PAD ending on a block
        boundary) followed by a valid entry -- a later write, and kvfs only issues
        a write once the one before it is durable."""
        if expected is None:
            return None
        for cand, cseq in self._candidates(pos, expected):
            if self._later_flush(cand, cseq):
                return cand, cseq
        return None

    def _candidates(self, pos: int, expected: int) -> Iterator[tuple[int, int]]:
        head = self._header(pos)
        if head is not None and head[2] == expected:
            nxt = pos + ENTRY_OVERHEAD + head[3]
            yield nxt + (-nxt % 8), expected + 1
        limit = min(self.size, pos + RESUME_SCAN)
        block = pos + ALIGN - pos % ALIGN
        while block < limit:
            head = self._header(block)
            if head is not None and head[2] > expected:
                status, entry, _ = self.parse(block, None)
                if status == PARSE_OK and entry is not None:
                    yield block, entry.seq
                    return
            block += ALIGN

    def _header(self, pos: int) -> tuple[int, int, int, int] | None:
        """(kind, generation, seq, length) of a plausible entry header at ``pos``."""
        while pos < self.start or pos + ENTRY_OVERHEAD > self.start + len(self.buf):
            if not self._load(pos):
                return None
        return entry_header(memoryview(self.buf), pos - self.start, self.generation)

    def _later_flush(self, pos: int, seq: int) -> bool:
        limit = pos + RESUME_SCAN
        while pos < limit:
            status, entry, nxt = self.parse(pos, seq)
            if status != PARSE_OK or entry is None:
                return False
            if entry.kind == KIND_PAD and nxt % ALIGN == 0:
                return self.parse(nxt, entry.seq + 1)[0] == PARSE_OK
            pos, seq = nxt, entry.seq + 1
        return False


def encode_checkpoint(
    ops: Iterable[Op], generation: int, seq: int, seed: int
) -> tuple[bytes, int, int]:
    """A whole checkpoint, block-padded: (bytes, last sequence number, op count)."""
    pieces = [encode_entry(KIND_CKPT_BEGIN, generation, seq + 1, b"", seed)]
    seq += 1
    batch: list[Op] = []
    count = 0
    for op in ops:
        batch.append(op)
        count += 1
        if len(batch) >= CKPT_OPS:
            seq += 1
            pieces.append(encode_entry(KIND_CKPT_DATA, generation, seq, encode_ops(batch), seed))
            batch = []
    if batch:
        seq += 1
        pieces.append(encode_entry(KIND_CKPT_DATA, generation, seq, encode_ops(batch), seed))
    seq += 1
    pieces.append(encode_entry(KIND_CKPT_END, generation, seq, count.to_bytes(8, "little"), seed))
    data = b"".join(pieces)
    seq += 1
    data += pad_entry(generation, seq, len(data), ALIGN, seed)
    return data, seq, count


class Journal:
    """Appends transactions to the current half; checkpoints into the other."""

    def __init__(
        self,
        meta: Device,
        meta_start: int,
        meta_size: int,
        data_devices: list[Device],
        snapshot: Callable[[], Iterable[Op]],
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
        self._offset = 0  # bytes of the current half in use (block aligned)
        self._ckpt_end = 0
        self._seq = 0
        self._durable = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._dirty_devices: set[int] = set()
        self._wake = trio.Event()
        self._flushed = trio.Event()
        self._want_checkpoint = False
        self._failed: DeviceError | None = None
        self._flushes = self._checkpoints = 0
        self._lock = trio.Lock()

    # ----------------------------------------------------------------- state
    def resume(self, found: Recovered, in_place: bool) -> None:
        """Continue after what recovery found. ``in_place`` (a clean unmount: the log
        ends right after its checkpoint, nothing torn can follow) appends to that
        half at once; otherwise the first flush writes a fresh checkpoint into the
        other half, so nothing is ever appended behind a torn tail."""
        self.generation, self.half = found.generation, found.half
        self._seq = self._durable = found.seq
        if in_place:
            self._offset = self._ckpt_end = found.end
        else:
            self._want_checkpoint = True

    async def start(self) -> None:
        """Write the checkpoint that ``resume`` asked for, if it asked for one."""
        if self._want_checkpoint:
            await self.checkpoint()

    def append(self, ops: list[Op]) -> int:
        """Queue one atomic transaction; returns its sequence number (sync)."""
        self._seq += 1
        raw = encode_entry(KIND_TXN, self.generation, self._seq, encode_ops(ops), self._seed)
        self._pending.append(raw)
        self._pending_bytes += len(raw)
        if self._pending_bytes > (4 << 20):
            self._wake.set()
        return self._seq

    @property
    def last_seq(self) -> int:
        return self._seq

    def note_data_write(self, device_index: int) -> None:
        """A data write completed; flush that device before the next journal write."""
        self._dirty_devices.add(device_index)

    async def wait_durable(self, seq: int | None = None) -> None:
        """Return once transaction ``seq`` (default: all so far) is on stable storage."""
        target = self._seq if seq is None else seq
        while self._durable < target:
            if self._failed is not None:
                raise DeviceError(f"metadata log unavailable: {self._failed}")
            self._wake.set()
            await self._flushed.wait()

    async def checkpoint(self) -> None:
        """Write a fresh checkpoint into the other half and wait for it."""
        self._want_checkpoint = True
        target = self._seq
        self._wake.set()
        while self._want_checkpoint or self._durable < target:
            if self._failed is not None:
                raise DeviceError(f"metadata log unavailable: {self._failed}")
            await self._flushed.wait()

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
                flushed, self._flushed = self._flushed, trio.Event()
                flushed.set()
                self._on_durable(self._durable)

    def _needs_checkpoint(self) -> bool:
        grown = self._offset - self._ckpt_end + self._pending_bytes
        full = self._offset + self._pending_bytes + 2 * ALIGN > self._half_size
        return grown > self._checkpoint_bytes or full  # (offset + grown counted twice)

    async def _write_pending(self) -> None:
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        self._seq += 1
        data += pad_entry(self.generation, self._seq, self._offset + len(data), ALIGN, self._seed)
        last = self._seq
        await self._write_blocks(self._offset, data, self._take_dirty())
        self._offset += len(data)
        self._durable = last
        self._flushes += 1

    def _take_dirty(self) -> list[int]:
        dirty, self._dirty_devices = sorted(self._dirty_devices), set()
        return dirty

    async def _write_checkpoint(self) -> None:
        """Snapshot now (sync), then write it to the other half as generation+1."""
        t0 = time.monotonic()
        generation, half = self.generation + 1, 1 - self.half
        self._pending.clear()
        self._pending_bytes = 0
        data, self._seq, count = encode_checkpoint(
            self._snapshot(), generation, self._seq, self._seed
        )
        if len(data) + 2 * ALIGN > self._half_size:
            raise DeviceError(
                f"metadata area too small: checkpoint needs {len(data)} bytes, "
                f"half holds {self._half_size}"
            )
        self.generation, self.half = generation, half
        self._want_checkpoint = False
        await self._write_blocks(0, data, self._take_dirty())
        self._offset = self._ckpt_end = len(data)
        self._durable = self._seq
        self._checkpoints += 1
        log.info(
            "checkpoint generation %d: %d records, %d bytes, %.3f s",
            generation,
            count,
            len(data),
            time.monotonic() - t0,
        )

    async def _write_blocks(self, offset: int, data: bytes, dirty: list[int]) -> None:
        if offset + len(data) > self._half_size:
            raise DeviceError("metadata log half overflow")
        base, _ = half_bounds(self._meta_start, self._meta_size, self.half)
        buf = aligned_buffer(len(data))
        buf[: len(data)] = data
        devices = [self._data_devices[i] for i in dirty]

        def write() -> None:
            for dev in devices:
                dev.flush()
            # release the views even on error: a traceback holding one would make
            # buf.close() raise BufferError instead of the DeviceError
            with memoryview(buf) as whole, whole[: len(data)] as view:
                self._meta.write(base + offset, [view])
            self._meta.flush()

        try:
            # a hung device must not hang every commit: same deadline as data I/O; the
            # abandoned thread keeps ``buf`` alive through its views until it returns
            with trio.move_on_after(self._io_timeout):
                await trio.to_thread.run_sync(write, abandon_on_cancel=True)
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
        """The last checkpoint fills more than META_FULL of a half: refuse growth.

        Between checkpoints the state can only grow by what the journal holds, and
        the journal part of a half is at least 1 - META_FULL of it, so the next
        checkpoint always fits (docs/design.md, "Limits")."""
        return self._ckpt_end > self._half_size * META_FULL

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the last checkpoint written (or found at mount); 0 before one."""
        return self._ckpt_end

    def statistics(self) -> JournalStatistics:
        return JournalStatistics(
            self.generation,
            self.half,
            self._offset,
            self._half_size,
            self._flushes,
            self._checkpoints,
            self._durable,
        )


__all__ = [
    "Damage",
    "Journal",
    "JournalStatistics",
    "Recovered",
    "encode_checkpoint",
    "half_bounds",
    "recover",
    "scan",
]
