"""Tests of kvfs.journal on a memory device: append/flush/recover, checkpoints that
switch halves, and crashes at (and inside) every write: recovery must return a prefix
of the committed transactions, never garbage."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from kvfs.device import ALIGN, Device, FaultyDevice, MemoryDevice
from kvfs.errors import Corruption, DeviceError
from kvfs.journal import (
    Journal,
    Recovered,
    checkpoint_pieces,
    encode_checkpoint,
    half_bounds,
    recover,
)
from kvfs.layout import (
    KIND_CKPT_END,
    PARSE_OK,
    Blob,
    Op,
    decode_ops,
    encode_entry,
    parse_entry,
)

SEED = 0xC0FFEE_1234
META_START = 2 * ALIGN
META_SIZE = 256 * 1024
DEV_SIZE = META_START + META_SIZE + ALIGN

State = dict[str, bytes]


class RecordingDevice(MemoryDevice):
    """Remembers every write, so any crash point can be rebuilt afterwards."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.writes: list[tuple[int, bytes]] = []

    def _pwrite(self, offset: int, bufs: Sequence[memoryview]) -> int:
        self.writes.append((offset, b"".join(bytes(b) for b in bufs)))
        return super()._pwrite(offset, bufs)


class BlobSink:
    """Recovery's payloads as a blob dictionary; records the order it was fed in."""

    def __init__(self) -> None:
        self.state: State = {}
        self.calls: list[str] = []

    def reset(self) -> None:
        self.state.clear()
        self.calls.append("reset")

    def checkpoint(self, payload: bytes) -> None:
        self.calls.append("checkpoint")
        self._apply(payload)

    def transaction(self, payload: bytes) -> None:
        self.calls.append("transaction")
        self._apply(payload)

    def _apply(self, payload: bytes) -> None:
        for op in decode_ops(payload):
            assert isinstance(op, Blob)
            self.state[op.name] = op.data


@dataclass
class Found:
    """What recovery found, with the state it fed."""

    rec: Recovered
    state: State
    calls: list[str]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rec, name)


def recover_dev(dev: Device, seed: int = SEED) -> Found:
    sink = BlobSink()
    rec = recover(dev, META_START, META_SIZE, seed, sink)
    return Found(rec, sink.state, sink.calls)


def state_of(found: Found) -> State:
    return found.state


def recover_image(image: bytes | bytearray, seed: int = SEED) -> Found:
    dev = MemoryDevice(len(image))
    dev.data[:] = image
    return recover_dev(dev, seed)


class Workload:
    """Transactions over a blob dictionary; the journal snapshots the dictionary."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.model: State = {}
        self.states: list[State] = []  # states[i] = after i transactions (0 = checkpoint)
        self.marks: list[tuple[int, int]] = []  # (writes so far, transactions durable)

    def snapshot(self) -> Iterator[bytes]:
        return checkpoint_pieces([Blob(k, v) for k, v in self.model.items()], per_piece=3)

    def txn(self, i: int) -> list[Op]:
        ops: list[Op] = [Blob("n", b"%d" % i)]
        for _ in range(self.rng.randrange(1, 4)):
            key = f"k{self.rng.randrange(12)}"
            ops.append(Blob(key, self.rng.randbytes(self.rng.randrange(0, 900))))
        for op in ops:
            assert isinstance(op, Blob)
            self.model[op.name] = op.data
        self.states.append(dict(self.model))
        return ops

    def index_of(self, state: State) -> int:
        """Which transaction prefix ``state`` is; fails on anything else."""
        i = int(state.get("n", b"0"))
        assert 0 <= i < len(self.states) and state == self.states[i], "not a committed prefix"
        return i

    def durable_before(self, writes: int) -> int:
        return max((t for w, t in self.marks if w <= writes), default=0)


async def run_workload(
    dev: RecordingDevice, work: Workload, txns: int, checkpoint_bytes: int
) -> Journal:
    journal = Journal(
        dev,
        META_START,
        META_SIZE,
        [dev],
        work.snapshot,
        seed=SEED,
        checkpoint_bytes=checkpoint_bytes,
        commit_interval=0.001,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        work.states.append(dict(work.model))
        await journal.checkpoint()
        work.marks.append((len(dev.writes), 0))
        for i in range(1, txns + 1):
            seq = journal.append(work.txn(i))
            if work.rng.random() < 0.4 or i == txns:
                await journal.wait_durable(seq)
                work.marks.append((len(dev.writes), i))
        nursery.cancel_scope.cancel()
    return journal


async def test_append_flush_recover_round_trip() -> None:
    dev = RecordingDevice(DEV_SIZE)
    work = Workload(1)
    journal = await run_workload(dev, work, 40, checkpoint_bytes=1 << 20)
    found = recover_dev(dev)
    assert work.index_of(state_of(found)) == 40
    assert found.transactions == 40
    assert (found.generation, found.half) == (journal.generation, journal.half) == (1, 1)
    stats = journal.statistics()
    assert stats.checkpoints == 1 and stats.flushes >= 1
    assert stats.durable_seq == journal.last_seq == 40


async def test_resume_checkpoints_first_then_switches_halves() -> None:
    dev = RecordingDevice(DEV_SIZE)
    work = Workload(2)
    await run_workload(dev, work, 10, checkpoint_bytes=1 << 20)
    found = recover_dev(dev)
    assert (found.generation, found.half) == (1, 1)
    journal = Journal(dev, META_START, META_SIZE, [dev], work.snapshot, seed=SEED)
    journal.resume(found.rec, in_place=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        for i in range(11, 16):
            # the first flush after resume must not overwrite the recovered log
            await journal.wait_durable(journal.append(work.txn(i)))
            again = recover_dev(dev)
            assert (again.generation, again.half) == (2, 0)
            assert work.index_of(state_of(again)) == i
        await journal.checkpoint()
        assert (journal.generation, journal.half) == (3, 1)
        await journal.wait_durable(journal.append(work.txn(16)))
        nursery.cancel_scope.cancel()
    last = recover_dev(dev)
    assert (last.generation, last.half, last.transactions) == (3, 1, 1)
    assert work.index_of(state_of(last)) == 16


async def test_resume_in_place_after_a_clean_checkpoint_appends_behind_it() -> None:
    dev = RecordingDevice(DEV_SIZE)
    work = Workload(3)
    await run_workload(dev, work, 6, checkpoint_bytes=1 << 20)
    first = Journal(dev, META_START, META_SIZE, [dev], work.snapshot, seed=SEED)
    first.resume(recover_dev(dev).rec, in_place=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await first.start()  # a checkpoint: the "clean unmount" state
        nursery.cancel_scope.cancel()
    clean = recover_dev(dev)
    assert clean.transactions == 0 and not clean.fell_back
    journal = Journal(dev, META_START, META_SIZE, [dev], work.snapshot, seed=SEED)
    journal.resume(clean.rec, in_place=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.start()  # nothing to do: no checkpoint is written
        for i in range(7, 10):
            await journal.wait_durable(journal.append(work.txn(i)))
        nursery.cancel_scope.cancel()
    assert journal.statistics().checkpoints == 0
    after = recover_dev(dev)
    assert (after.generation, after.half) == (clean.generation, clean.half)
    assert after.transactions == 3
    assert work.index_of(state_of(after)) == 9


async def test_crash_at_every_write_and_inside_every_write_recovers_a_prefix() -> None:
    dev = RecordingDevice(DEV_SIZE)
    work = Workload(3)
    journal = await run_workload(dev, work, 150, checkpoint_bytes=12 * 1024)
    assert journal.statistics().checkpoints >= 4, "the workload should switch halves often"
    image = bytearray(DEV_SIZE)
    previous = 0
    for n, (offset, data) in enumerate(dev.writes):
        lower = work.durable_before(n)
        for cut in range(512, len(data), 512):  # torn inside this write, at sector size
            torn = bytearray(image)
            torn[offset : offset + cut] = data[:cut]
            try:
                i = work.index_of(state_of(recover_image(torn)))
            except Corruption:
                assert n == 0, "only the very first checkpoint may leave nothing"
                continue
            assert i >= lower, (n, cut, i, lower)
        image[offset : offset + len(data)] = data
        i = work.index_of(state_of(recover_image(image)))
        assert i >= work.durable_before(n + 1), (n, i)
        assert i >= previous, "a completed write made recovery go backwards"
        previous = i
    assert previous == 150


async def test_flipped_bytes_anywhere_in_the_log_give_a_prefix_or_corruption() -> None:
    dev = RecordingDevice(DEV_SIZE)
    work = Workload(4)
    await run_workload(dev, work, 80, checkpoint_bytes=16 * 1024)
    final = bytes(dev.data)
    rng = random.Random(5)
    positions = sorted(rng.sample(range(META_START, META_START + META_SIZE), 400))
    for pos in positions:
        bad = bytearray(final)
        bad[pos] ^= rng.randrange(1, 256)
        try:
            found = recover_image(bad)
        except Corruption:
            continue  # only if both halves lost their checkpoint
        work.index_of(state_of(found))
    # the tail of the current log: each flip cuts the log there, never more
    found = recover_image(final)
    base, _ = half_bounds(META_START, META_SIZE, found.half)
    for pos in range(base + found.end - 1, base + found.end - 4 * ALIGN, -37):
        bad = bytearray(final)
        bad[pos] ^= 0xFF
        i = work.index_of(state_of(recover_image(bad)))
        assert i <= 80


def test_incomplete_newer_checkpoint_falls_back_to_the_older_half() -> None:
    old: list[Op] = [Blob("state", b"old")]
    new: list[Op] = [Blob("state", b"new"), Blob("big", bytes(3 * ALIGN))]
    image = bytearray(DEV_SIZE)
    old_ckpt, _, _ = encode_checkpoint(old, 4, 0, SEED)
    new_ckpt, _, _ = encode_checkpoint(new, 5, 10, SEED)
    base0, _ = half_bounds(META_START, META_SIZE, 0)
    base1, _ = half_bounds(META_START, META_SIZE, 1)
    image[base0 : base0 + len(old_ckpt)] = old_ckpt
    image[base1 : base1 + len(new_ckpt)] = new_ckpt
    found = recover_image(image)
    assert (found.generation, found.half, state_of(found)) == (
        5,
        1,
        {"state": b"new", "big": bytes(3 * ALIGN)},
    )
    pos, seq = 0, None  # find where the CKPT_END entry ends
    view = memoryview(new_ckpt)
    while True:
        status, entry, nxt = parse_entry(view, pos, 5, seq, SEED)
        assert status == PARSE_OK and entry is not None
        pos, seq = nxt, entry.seq + 1
        if entry.kind == KIND_CKPT_END:
            break
    for keep in [*range(0, pos, 512), pos - 8, pos - 1]:
        torn = bytearray(image)
        torn[base1 + keep : base1 + len(new_ckpt)] = bytes(len(new_ckpt) - keep)
        found = recover_image(torn)
        assert (found.generation, state_of(found)) == (4, {"state": b"old"}), keep


def test_another_pools_log_is_never_picked_up() -> None:
    ours, _, _ = encode_checkpoint([Blob("pool", b"ours")], 3, 0, SEED)
    theirs, _, _ = encode_checkpoint([Blob("pool", b"theirs")], 9, 0, SEED + 1)
    base0, _ = half_bounds(META_START, META_SIZE, 0)
    base1, _ = half_bounds(META_START, META_SIZE, 1)
    image = bytearray(DEV_SIZE)
    image[base1 : base1 + len(theirs)] = theirs
    with pytest.raises(Corruption):
        recover_image(image)
    image[base0 : base0 + len(ours)] = ours
    found = recover_image(image)
    assert (found.generation, state_of(found)) == (3, {"pool": b"ours"})
    # their transactions appended after our checkpoint are not ours either
    txn = encode_entry(1, 3, found.seq + 1, b"", SEED + 1)
    image[base0 + found.end : base0 + found.end + len(txn)] = txn
    assert recover_image(image).transactions == 0


def test_nothing_valid_is_corruption() -> None:
    with pytest.raises(Corruption):
        recover_image(bytes(DEV_SIZE))
    rng = random.Random(6)
    with pytest.raises(Corruption):
        recover_image(rng.randbytes(DEV_SIZE))


async def test_failing_meta_device_fails_waiters_instead_of_hanging() -> None:
    inner = MemoryDevice(DEV_SIZE)
    dev = FaultyDevice(inner)
    work = Workload(7)
    journal = Journal(
        dev, META_START, META_SIZE, [dev], work.snapshot, seed=SEED, commit_interval=0.001
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.checkpoint()
        dev.fail_writes = True
        seq = journal.append(work.txn(1))
        with trio.fail_after(5), pytest.raises(DeviceError):
            await journal.wait_durable(seq)
        nursery.cancel_scope.cancel()
