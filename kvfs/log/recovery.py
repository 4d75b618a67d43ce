"""Recovery of the metadata log: find the newest complete checkpoint of the two
halves and feed its pieces and the journal behind it to a sink, streaming (the read
window is all it holds), detecting damage in the middle of the log. The format is
``docs/format.md`` ("Metadata area", "Recovery"); the writer is :mod:`kvfs.log.journal`.
Blocking: runs before serving, and in ``kvfs fsck``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kvfs.common.errors import Corruption
from kvfs.devices.device import ALIGN, Device, aligned_buffer
from kvfs.format.halves import half_bounds
from kvfs.format.records import (
    ENTRY_OVERHEAD,
    ENTRY_VERSION,
    KIND_CKPT_BEGIN,
    KIND_CKPT_DATA,
    KIND_CKPT_END,
    KIND_COMMIT,
    KIND_PAD,
    KIND_TXN,
    MAGIC_BYTES,
    PARSE_END,
    PARSE_MORE,
    PARSE_OK,
    Entry,
    Op,
    decode_ops,
    entry_header,
    parse_entry,
    peek_entry,
)

log = logging.getLogger(__name__)

READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class Damage:
    """Entries lost in the middle of a log: a later, complete group commit proves
    that what lies between was durable once (kvfs writes a group commit only after
    the one before it is durable), so this is damage, not the torn end of a crash."""

    offset: int
    """Byte offset in the half of the first entry that failed."""
    first_seq: int
    lost: int
    """Sequence numbers skipped over (transactions and COMMIT/PAD entries)."""

    def __str__(self) -> str:
        return (
            f"damaged at byte {self.offset}: {self.lost} entries from sequence number "
            f"{self.first_seq} are lost, the complete transactions after them are kept"
        )


class RecoverySink(Protocol):
    """What recovery feeds, in log order: the checkpoint's payloads, then the
    transactions'. ``reset`` discards everything fed so far (the newest half turned
    out incomplete; the older one follows)."""

    def reset(self) -> None: ...

    def checkpoint(self, payload: bytes) -> None: ...

    def transaction(self, payload: bytes) -> None: ...


class NullSink:
    """A sink that keeps nothing (to find where a log is and ends)."""

    def reset(self) -> None:
        pass

    def checkpoint(self, payload: bytes) -> None:
        pass

    def transaction(self, payload: bytes) -> None:
        pass


class ApplySink:
    """Decodes every payload and hands each operation to ``apply``, which returns
    False for one it skipped (it names what is gone: a fuzzy checkpoint's replay, or
    a log damaged in the middle); those are counted in :attr:`skipped`."""

    def __init__(
        self,
        apply: Callable[[Op], bool],
        reset: Callable[[], None],
        load: Callable[[bytes], None] | None = None,
    ) -> None:
        self._apply, self._reset, self._load = apply, reset, load
        self.skipped = 0
        self.first_skipped: list[Op] = []
        """The first few skipped operations (for reports)."""

    def reset(self) -> None:
        self._reset()
        self.skipped = 0
        self.first_skipped.clear()

    def checkpoint(self, payload: bytes) -> None:
        if self._load is not None:  # the index decodes its own checkpoint payloads
            self._load(payload)
        else:
            self._feed(payload)

    def transaction(self, payload: bytes) -> None:
        self._feed(payload)

    def _feed(self, payload: bytes) -> None:
        apply = self._apply
        for op in decode_ops(payload):
            try:
                done = apply(op)
            except (KeyError, AssertionError):  # it depended on what a damaged log lost
                done = False
            if not done:
                self.skipped += 1
                if len(self.first_skipped) < 20:
                    self.first_skipped.append(op)


@dataclass
class Recovered:
    """What recovery found: where the log is and where it ended (the state itself
    went to the sink)."""

    generation: int
    half: int
    end: int
    seq: int
    """Sequence number of the last valid entry."""
    transactions: int
    version: int = ENTRY_VERSION
    """Entry version of the half (1: written by kvfs 0.2.0)."""
    checkpoint_end: int = 0
    """Half offset right after the CKPT_END entry."""
    tail: bytes = b""
    """The bytes of the log's last partial block (``end % 4096`` of them): a writer
    that goes on in place rewrites them unchanged."""
    fell_back: bool = False
    """The newest checkpoint was incomplete; this is the older half."""
    damage: list[Damage] = field(default_factory=list)
    """Mid-log damage skipped over; the transactions after it were fed too."""


def recover(
    dev: Device, meta_start: int, meta_size: int, seed: int, sink: RecoverySink | None = None
) -> Recovered:
    """Find the newest complete checkpoint and replay its journal into ``sink``
    (blocking): its CKPT_DATA payloads, then its TXN payloads, in order. Memory is
    bounded by the read window, not the log."""
    sink = sink if sink is not None else NullSink()
    candidates = []
    for half in (0, 1):
        base, _ = half_bounds(meta_start, meta_size, half)
        head = aligned_buffer(ALIGN)
        dev.read_into(base, memoryview(head))
        entry = peek_entry(bytes(head), seed)
        if entry is not None and entry.kind == KIND_CKPT_BEGIN:
            candidates.append((entry.generation, half, entry.version))
    for i, (generation, half, version) in enumerate(sorted(candidates, reverse=True)):
        found = _replay_half(dev, meta_start, meta_size, half, generation, version, seed, sink)
        if found is not None:
            found.fell_back = i > 0
            return found
        sink.reset()
        log.warning("checkpoint generation %d is incomplete; trying the older one", generation)
    raise Corruption("no complete metadata checkpoint found (not formatted, or destroyed)")


def _replay_half(
    dev: Device,
    meta_start: int,
    meta_size: int,
    half: int,
    generation: int,
    version: int,
    seed: int,
    sink: RecoverySink,
) -> Recovered | None:
    base, size = half_bounds(meta_start, meta_size, half)
    reader = _HalfReader(dev, base, size, generation, seed, version)
    damage: list[Damage] = []
    # complete: version 1 at CKPT_END; version 2 at the COMMIT that ends the write
    # holding CKPT_END and the window's transactions (a torn one falls back)
    ended, complete, end, seq, txns, ckpt_end = False, False, 0, 0, 0, 0
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
        if entry.kind == KIND_CKPT_DATA and not ended:
            sink.checkpoint(entry.payload)
        elif entry.kind == KIND_TXN:
            if not ended:
                break
            sink.transaction(entry.payload)
            txns += 1
        elif entry.kind == KIND_CKPT_END:
            ended, ckpt_end = True, nxt
            complete = version == 1
        elif entry.kind == KIND_COMMIT and ended:
            complete = True
        pos, expected = nxt, entry.seq + 1
        end, seq = nxt, entry.seq
    if not complete:
        return None
    return Recovered(
        generation,
        half,
        end,
        seq,
        txns,
        version,
        ckpt_end,
        reader.tail(end),
        damage=damage,
    )


def scan(
    dev: Device, base: int, size: int, generation: int, seed: int
) -> Iterator[tuple[int, Entry]]:
    """Yield (end offset in the half, entry) of one half's log up to its first bad
    entry (tools and tests: where each entry lies)."""
    head = aligned_buffer(ALIGN)
    dev.read_into(base, memoryview(head))
    first = peek_entry(bytes(head), seed)
    version = first.version if first is not None else ENTRY_VERSION
    reader = _HalfReader(dev, base, size, generation, seed, version)
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

    def __init__(
        self, dev: Device, base: int, size: int, generation: int, seed: int, version: int
    ) -> None:
        self.dev, self.base, self.size = dev, base, size
        self.generation, self.seed, self.version = generation, seed, version
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
                    memoryview(self.buf),
                    pos - self.start,
                    self.generation,
                    expected,
                    self.seed,
                    self.version,
                )
                if status != PARSE_MORE:
                    return status, entry, nxt + self.start
            if not self._load(pos):
                return PARSE_END, None, pos

    def tail(self, end: int) -> bytes:
        """The bytes of the block holding ``end``, up to ``end``."""
        block = end - end % ALIGN
        if block < self.start:
            self.buf, self.start = bytearray(), block
        while end > self.start + len(self.buf):
            if not self._load(end):
                break
        return bytes(self.buf[block - self.start : end - self.start])

    def resume_after(self, pos: int, expected: int | None) -> tuple[int, int] | None:
        """Where the log goes on after the bad entry at ``pos`` (offset, sequence
        number), if it provably does; None for a torn tail.

        Candidates: the entry right after the bad one when its header is intact (a
        flipped payload bit), else the first valid entry of this generation with a
        later sequence number, found by searching the bytes for the entry magic.
        The proof that this is not the torn end of the last write: walking on from
        the candidate reaches the end of a device write (a COMMIT entry; version 1:
        a PAD ending on a block boundary) followed by a valid entry -- a later
        write, and kvfs only issues a write once the one before it is durable."""
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
        at = pos + 8
        while at < limit:
            at = self._find_magic(at, limit)
            if at < 0:
                return
            head = self._header(at)
            if head is not None and head[2] > expected:
                status, entry, _ = self.parse(at, None)
                if status == PARSE_OK and entry is not None:
                    yield at, entry.seq
                    return
            at += 8

    def _find_magic(self, at: int, limit: int) -> int:
        """The first 8-aligned half offset in [at, limit) where the entry magic
        starts (``bytes.find``: C speed), or -1."""
        at += -at % 8
        while at < limit:
            while at < self.start or at + len(MAGIC_BYTES) > self.start + len(self.buf):
                if not self._load(at):
                    return -1
            hit = self.buf.find(MAGIC_BYTES, at - self.start, limit - self.start)
            while hit >= 0 and (hit + self.start) % 8:
                hit = self.buf.find(MAGIC_BYTES, hit + 1, limit - self.start)
            if hit >= 0:
                return hit + self.start
            have = self.start + len(self.buf)
            if have >= limit or not self._load(have):
                return -1
            at = max(at, have - len(MAGIC_BYTES))
            at += -at % 8
        return -1

    def _header(self, pos: int) -> tuple[int, int, int, int] | None:
        """(kind, generation, seq, length) of a plausible entry header at ``pos``."""
        while pos < self.start or pos + ENTRY_OVERHEAD > self.start + len(self.buf):
            if not self._load(pos):
                return None
        return entry_header(memoryview(self.buf), pos - self.start, self.generation, self.version)

    def _later_flush(self, pos: int, seq: int) -> bool:
        limit = pos + RESUME_SCAN
        while pos < limit:
            status, entry, nxt = self.parse(pos, seq)
            if status != PARSE_OK or entry is None:
                return False
            if entry.kind == KIND_COMMIT or (entry.kind == KIND_PAD and nxt % ALIGN == 0):
                return self.parse(nxt, entry.seq + 1)[0] == PARSE_OK
            pos, seq = nxt, entry.seq + 1
        return False


__all__ = [
    "ApplySink",
    "Damage",
    "NullSink",
    "Recovered",
    "RecoverySink",
    "recover",
    "scan",
]
