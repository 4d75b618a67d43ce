"""Tests of kvfs.log.journal on a memory device: append/flush/recover, checkpoints that
switch halves, and crashes at (and inside) every write: recovery must return a prefix
of the committed transactions, never garbage."""

from __future__ import annotations

import errno
import gzip
import importlib.util
import itertools
import queue
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

import kvfs.log.journal as journal_mod
from kvfs.common.errors import Corruption, DeviceError
from kvfs.devices.device import ALIGN, Device
from kvfs.devices.pool import Pool
from kvfs.format.halves import checkpoint_pieces, encode_checkpoint, half_bounds
from kvfs.format.records import (
    ENTRY_OVERHEAD,
    KIND_CKPT_END,
    KIND_TXN,
    PARSE_OK,
    Blob,
    Op,
    decode_ops,
    encode_entry,
    encode_ops,
    parse_entry,
)
from kvfs.format.superblock import Superblock
from kvfs.index.namespace import ROOT_INO, Namespace
from kvfs.log.journal import ApplySink, Journal, Recovered, recover, scan
from kvfs.testing.devices import FaultyDevice, MemoryDevice

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
        """Fuzzy, like the namespace's: the keys now, each value when its piece is
        made (transactions may have changed it since)."""
        keys = list(self.model)

        def ops() -> Iterator[Op]:
            for key in keys:
                yield Blob(key, self.model[key])

        return checkpoint_pieces(ops(), per_piece=2)

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
    dev: RecordingDevice,
    work: Workload,
    txns: int,
    checkpoint_bytes: int,
    *,
    commit_interval: float = 0.001,
    during_checkpoints: bool = False,
) -> Journal:
    """``txns`` transactions, waiting for some. ``during_checkpoints``: one more
    transaction, and a task that waits for it, each time the checkpoint's snapshot
    makes its next piece: a group commit into the old half between the new half's
    pieces, driven by its waiter (with a long ``commit_interval``, by nothing else)."""
    journal: Journal | None = None

    def snapshot() -> Iterator[bytes]:
        for piece in work.snapshot():
            yield piece
            if during_checkpoints and len(work.states) < txns:  # the last is the loop's
                assert journal is not None
                nursery.start_soon(durable, journal.append(work.txn(len(work.states))))

    async def durable(seq: int) -> None:
        assert journal is not None
        await journal.wait_durable(seq)
        work.marks.append((len(dev.writes), seq))

    journal = Journal(
        dev,
        META_START,
        META_SIZE,
        [dev],
        snapshot,
        seed=SEED,
        checkpoint_bytes=checkpoint_bytes,
        commit_interval=commit_interval,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        work.states.append(dict(work.model))
        await journal.checkpoint()
        work.marks.append((len(dev.writes), 0))
        while len(work.states) <= txns:
            i = len(work.states)
            seq = journal.append(work.txn(i))
            if work.rng.random() < 0.4 or i == txns:
                await durable(seq)
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


async def test_empty_snapshot_payloads_are_pauses_not_entries() -> None:
    """A snapshot may yield empty payloads: steps of a scan that produced nothing
    (the namespace image bounds each step). They are skipped: the checkpoint holds
    only the real pieces, and recovers the state."""
    dev = RecordingDevice(DEV_SIZE)
    work = Workload(4)
    work.states.append({})
    for i in range(1, 9):
        work.txn(i)

    def snapshot() -> Iterator[bytes]:
        for piece in work.snapshot():
            yield b""
            yield piece
            yield b""

    pieces = sum(1 for _ in work.snapshot())
    journal = Journal(dev, META_START, META_SIZE, [dev], snapshot, seed=SEED)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.checkpoint()
        nursery.cancel_scope.cancel()
    found = recover_dev(dev)
    # CKPT_BEGIN, one CKPT_DATA per real piece, CKPT_END, COMMIT: nothing for a pause
    assert (found.rec.seq, found.rec.transactions) == (pieces + 3, 0)
    assert work.index_of(state_of(found)) == 8


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


@pytest.mark.parametrize("ckpt_write", [journal_mod.CKPT_WRITE, 1])
async def test_crash_at_every_write_and_inside_every_write_recovers_a_prefix(
    ckpt_write: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ckpt_write 1: every checkpoint piece is a device write of its own, with group
    commits into the old half between them (a checkpoint in progress). The group
    commits are driven by their waiters only (no timer), so which writes happen is
    the same however slow the machine is."""
    monkeypatch.setattr(journal_mod, "CKPT_WRITE", ckpt_write)
    dev = RecordingDevice(DEV_SIZE)
    work = Workload(3)
    journal = await run_workload(
        dev, work, 150, checkpoint_bytes=12 * 1024, commit_interval=3600, during_checkpoints=True
    )
    assert journal.statistics().checkpoints >= 4, "the workload should switch halves often"
    base1, _ = half_bounds(META_START, META_SIZE, 1)
    halves = [offset >= base1 for offset, _ in dev.writes]
    switches = sum(a != b for a, b in itertools.pairwise(halves))
    if ckpt_write == 1:  # commits into the old half between the new half's pieces
        assert switches > 2 * journal.statistics().checkpoints, switches
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


# ----------------------------------------------------------------------------- checkpoints
class GatedDevice(RecordingDevice):
    """Writes into ``region`` wait for a permit (in the writer's thread, as a slow
    device would): the test decides when each checkpoint write completes, and may
    make one fail."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.region: tuple[int, int] | None = None
        self.entered: queue.Queue[int] = queue.Queue()
        self.permits = threading.Semaphore(0)
        self.fail_next = False

    def _pwrite(self, offset: int, bufs: Sequence[memoryview]) -> int:
        region = self.region
        if region is not None and region[0] <= offset < region[1]:
            self.entered.put(offset)
            assert self.permits.acquire(timeout=10), "the test never let this write go"
            if self.fail_next:
                self.fail_next = False
                raise OSError(errno.EIO, "injected")
        return super()._pwrite(offset, bufs)

    async def next_gated_write(self) -> int:
        return await trio.to_thread.run_sync(self.entered.get, True, 5)

    def open_gate(self) -> None:
        self.region = None
        self.permits.release(1000)


def gated_journal(dev: GatedDevice, work: Workload, **kw: Any) -> Journal:
    return Journal(
        dev, META_START, META_SIZE, [dev], work.snapshot, seed=SEED, commit_interval=0.001, **kw
    )


async def started_checkpoint(dev: GatedDevice, journal: Journal, work: Workload) -> None:
    """Checkpoint once (generation 1, half 1), fill the model, then start generation
    2's checkpoint into half 0 and return while its first piece write is held."""
    await journal.checkpoint()
    for i in range(1, 9):
        await journal.wait_durable(journal.append(work.txn(i)))
    base0, size = half_bounds(META_START, META_SIZE, 0)
    dev.region = (base0, base0 + size)
    journal.request_checkpoint()
    await dev.next_gated_write()
    assert journal.checkpointing and journal.generation == 1


async def test_commits_go_on_while_a_checkpoint_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the new half's pieces are written one by one, transactions are made
    durable in the old half between them, and all of them (those durable in the old
    half and those still pending) end up in the new generation behind CKPT_END."""
    monkeypatch.setattr(journal_mod, "CKPT_WRITE", 1)
    dev = GatedDevice(DEV_SIZE)
    work = Workload(11)
    work.states.append({})
    journal = gated_journal(dev, work)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await started_checkpoint(dev, journal, work)
        durable_in_old: list[int] = []
        for i in range(9, 12):
            seq = journal.append(work.txn(i))
            dev.permits.release()  # one piece written; the commit goes in before the next
            with trio.fail_after(5):
                await journal.wait_durable(seq)
            await dev.next_gated_write()  # the checkpoint is not done: another piece
            assert journal.checkpointing and journal.generation == 1
            durable_in_old.append(i)
            # a crash now: the old half has everything durable
            assert work.index_of(recover_dev(dev).state) == i
        assert durable_in_old == [9, 10, 11]
        journal.append(work.txn(12))  # pending when the checkpoint ends
        dev.open_gate()
        with trio.fail_after(5):
            await journal.wait_durable()
            while journal.checkpointing:  # noqa: ASYNC110 - no event to wait on
                await trio.sleep(0.001)
        assert (journal.generation, journal.half) == (2, 0)
        nursery.cancel_scope.cancel()
    found = recover_dev(dev)
    assert (found.generation, found.half) == (2, 0)
    assert found.transactions >= 4  # 9..12 replayed behind the fuzzy checkpoint
    assert work.index_of(found.state) == 12
    first_txn = found.calls.index("transaction")
    assert "checkpoint" not in found.calls[first_txn:], "transactions come after the pieces"


async def test_a_checkpoint_requested_while_one_runs_starts_after_it() -> None:
    dev = GatedDevice(DEV_SIZE)
    work = Workload(12)
    work.states.append({})
    journal = gated_journal(dev, work)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await started_checkpoint(dev, journal, work)
        before = journal.statistics().checkpoints
        done = trio.Event()

        async def wait_for_a_fresh_one() -> None:
            await journal.checkpoint()
            done.set()

        nursery.start_soon(wait_for_a_fresh_one)
        await trio.sleep(0.01)
        assert not done.is_set() and journal.checkpointing
        dev.open_gate()  # the running checkpoint completes, then the requested one runs
        with trio.fail_after(5):
            await done.wait()
        # it waited for a second checkpoint, one that started after the call
        assert journal.statistics().checkpoints == before + 2
        assert (journal.generation, journal.half) == (3, 1)
        nursery.cancel_scope.cancel()
    assert work.index_of(recover_dev(dev).state) == 8


async def test_a_full_half_during_a_checkpoint_holds_commits_back_never_loses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old half fills while a checkpoint is being written: commits that no longer
    fit wait (pieces go on, nothing is written into the old half) and become durable
    in the new half when it is current."""
    monkeypatch.setattr(journal_mod, "CKPT_WRITE", 1)
    dev = GatedDevice(DEV_SIZE)
    work = Workload(13)
    work.states.append({})
    idle, done = False, False

    def snapshot() -> Iterator[bytes]:
        """The model's pieces, then (the gated checkpoint) more until the test says
        so, each one a gated write: the test decides how long it takes. (They are
        fuzzy pieces like any: the value of "n" when the piece is made. An empty
        payload would be a pause, which the journal writes nothing for.)"""
        yield from work.snapshot()
        while idle and not done:
            yield encode_ops([Blob("n", work.model["n"])])

    _, half_size = half_bounds(META_START, META_SIZE, 0)
    journal = Journal(
        dev, META_START, META_SIZE, [dev], snapshot, seed=SEED, checkpoint_bytes=1 << 20
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.checkpoint()
        i = 0
        while journal.statistics().used_bytes < half_size // 2 - ALIGN:  # no checkpoint yet
            i += 1
            await journal.wait_durable(journal.append(work.txn(i)))
        base0, _ = half_bounds(META_START, META_SIZE, 0)
        dev.region = (base0, base0 + half_size)
        idle = True
        journal.request_checkpoint()
        await dev.next_gated_write()
        while journal.statistics().used_bytes + ALIGN + 8192 < half_size:
            i += 1
            seq = journal.append(work.txn(i))
            dev.permits.release()
            with trio.fail_after(5):
                await journal.wait_durable(seq)  # into the old half, between two pieces
            await dev.next_gated_write()
            assert journal.checkpointing and journal.generation == 1
        held = [journal.append(work.txn(j)) for j in range(i + 1, i + 16)]
        for _ in range(3):  # pieces go on, the commit is due, but it does not fit
            dev.permits.release()
            await dev.next_gated_write()
        assert journal.statistics().durable_seq < held[0]
        assert journal.checkpointing and journal.generation == 1
        done = True
        dev.open_gate()
        with trio.fail_after(5):
            await journal.wait_durable(held[-1])
        assert (journal.generation, journal.half) == (2, 0)
        nursery.cancel_scope.cancel()
    found = recover_dev(dev)
    assert (found.generation, found.half) == (2, 0)
    assert work.index_of(found.state) == i + 15


async def test_a_device_error_mid_checkpoint_is_fail_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(journal_mod, "CKPT_WRITE", 1)
    dev = GatedDevice(DEV_SIZE)
    work = Workload(14)
    work.states.append({})
    journal = gated_journal(dev, work)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await started_checkpoint(dev, journal, work)
        seq = journal.append(work.txn(9))
        dev.fail_next = True
        dev.permits.release()
        with trio.fail_after(5), pytest.raises(DeviceError):
            await journal.wait_durable(seq)
        with pytest.raises(DeviceError):
            await journal.checkpoint()
        # and nothing more is let in to be acknowledged in vain
        with pytest.raises(DeviceError):
            journal.check_usable()
        with trio.fail_after(5), pytest.raises(DeviceError):
            await journal.admit(100)
        nursery.cancel_scope.cancel()
    found = recover_dev(dev)  # the old half, with what was durable (8), never 9 half-done
    assert found.generation == 1 and work.index_of(found.state) == 8


TXN_MAX = 3 * (900 + 32) + 64
"""An upper bound on the encoded payload of one ``Workload.txn``."""


async def test_a_window_that_outgrows_the_new_half_is_retried_not_fail_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Transactions appended while a checkpoint is written (its window) that would
    not fit the new half behind it (here: more than a whole half of them, appended
    without ``admit``): that attempt is abandoned, a fresh checkpoint covers them,
    and every one is durable and recovered; the log never fails."""
    monkeypatch.setattr(journal_mod, "CKPT_WRITE", 1)
    dev = GatedDevice(DEV_SIZE)
    work = Workload(16)
    work.states.append({})
    journal = gated_journal(dev, work)
    _, half_size = half_bounds(META_START, META_SIZE, 0)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await started_checkpoint(dev, journal, work)
        window, i = 0, 8
        while window <= half_size:  # all appended while the first piece is held
            i += 1
            ops = work.txn(i)
            window += len(encode_ops(ops)) + ENTRY_OVERHEAD
            last = journal.append(ops)
        dev.open_gate()
        with trio.fail_after(10):
            await journal.wait_durable(last)
        stats = journal.statistics()
        assert stats.abandoned_checkpoints >= 1 and journal.half == 0, stats
        nursery.cancel_scope.cancel()
    found = recover_dev(dev)
    assert (found.generation, found.half) == (journal.generation, 0)
    assert found.generation > 2, "the retry must not reuse the abandoned generation"
    assert work.index_of(found.state) == i


async def test_admit_holds_appends_while_the_window_has_no_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A writer that calls ``admit`` before each append is held while the running
    checkpoint's window has no room left in the new half (the bound on the next
    checkpoint stays within a half), and goes on once that checkpoint is current:
    nothing abandoned, everything durable."""
    monkeypatch.setattr(journal_mod, "CKPT_WRITE", 1)
    dev = GatedDevice(DEV_SIZE)
    work = Workload(17)
    work.states.append({})
    journal = gated_journal(dev, work)
    _, half_size = half_bounds(META_START, META_SIZE, 0)
    total = 4 * half_size // TXN_MAX * 2  # several halves of transactions
    appended: list[int] = []

    async def writer() -> None:
        for i in range(9, 9 + total):
            await journal.admit(TXN_MAX)
            appended.append(journal.append(work.txn(i)))

    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await started_checkpoint(dev, journal, work)
        nursery.start_soon(writer)
        with trio.fail_after(10):
            while True:  # the writer stops by itself, the first piece still held
                count = len(appended)
                await trio.sleep(0.05)
                if len(appended) == count:
                    break
        assert 0 < len(appended) < total and journal.checkpointing
        assert journal.next_checkpoint_bound <= half_size
        dev.open_gate()
        with trio.fail_after(10):
            while len(appended) < total:  # noqa: ASYNC110 - no event to wait on
                await trio.sleep(0.01)
            await journal.wait_durable(appended[-1])
        assert journal.statistics().abandoned_checkpoints == 0
        nursery.cancel_scope.cancel()
    assert work.index_of(recover_dev(dev).state) == 8 + total


async def test_a_durable_close_costs_its_entry_not_a_block() -> None:
    """Sequential small commits: the log grows by each TXN plus a 40-byte COMMIT."""
    dev = RecordingDevice(DEV_SIZE)
    work = Workload(15)
    journal = Journal(dev, META_START, META_SIZE, [dev], work.snapshot, seed=SEED)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.checkpoint()
        start = journal.statistics().used_bytes
        payload_bytes = 0
        for i in range(50):
            ops: list[Op] = [Blob("k", b"%d" % i)]
            payload_bytes += len(encode_entry(1, 1, 1, encode_ops(ops)))
            await journal.wait_durable(journal.append(ops))
        grown = journal.statistics().used_bytes - start
        nursery.cancel_scope.cancel()
    assert grown == payload_bytes + 50 * ENTRY_OVERHEAD, grown
    assert journal.statistics().journal_bytes == grown
    found = recover_dev(dev)
    assert found.transactions == 50 and found.state == {"k": b"49"}


# ----------------------------------------------------------------------------- old logs
V1_IMAGES = Path(__file__).parents[2] / "data"


def v1_maker(script: str = "make_v1_images") -> Any:
    """The script that made the images (its file lists and contents)."""
    spec = importlib.util.spec_from_file_location(script, V1_IMAGES / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def v1_device(kind: str, prefix: str = "v1") -> MemoryDevice:
    raw = gzip.decompress((V1_IMAGES / f"{prefix}-{kind}.img.gz").read_bytes())
    dev = MemoryDevice(len(raw))
    dev.data[:] = raw
    return dev


@pytest.mark.parametrize("kind", ["clean", "dirty"])
def test_a_version_1_log_still_recovers(kind: str) -> None:
    """Logs written by kvfs 0.2.0 (PAD-aligned flushes, entry version 1)."""
    maker = v1_maker()
    dev = v1_device(kind)
    pool = Pool([dev], [Superblock.decode(bytes(dev.data[:4096]))])
    meta, start, size = pool.meta
    ns = Namespace(lambda ops: None)
    found = recover(meta, start, size, pool.seed, ApplySink(ns.apply, ns.reset, ns.load_payload))
    ns.finish_load()
    assert found.version == 1 and not found.damage and not found.fell_back
    assert (found.transactions == 0) == (kind == "clean")
    FILES, LATER = maker.FILES, maker.LATER
    names = set(ns.inodes[ROOT_INO].entries or {})
    assert names == {b"dir", *FILES, *LATER}
    assert ns.inodes[ROOT_INO].xattrs == {b"user.x": b"value"}
    for name, size_ in {**FILES, **LATER}.items():
        assert ns.lookup(ROOT_INO, name).size == size_


@pytest.mark.parametrize("where", ["header", "payload"])
async def test_mid_log_damage_is_found_without_block_aligned_flushes(where: str) -> None:
    """A durable transaction in the middle of the log is damaged (its magic, or a
    payload byte): a later write (COMMIT then a valid entry) proves it was durable,
    so it is reported as damage and every later transaction is still replayed."""
    dev = RecordingDevice(DEV_SIZE)
    work = Workload(16)
    await run_workload(dev, work, 60, checkpoint_bytes=1 << 20)
    found = recover_dev(dev)
    base, size = half_bounds(META_START, META_SIZE, found.half)
    entries = list(scan(dev, base, size, found.generation, SEED))
    txns = [(end, e) for end, e in entries if e.kind == KIND_TXN]
    end, victim = txns[len(txns) // 3]
    start = end - len(encode_entry(KIND_TXN, 0, 0, victim.payload))
    bad = bytearray(dev.data)
    bad[base + start + (0 if where == "header" else 40)] ^= 0x5A
    damaged = recover_image(bad)
    assert len(damaged.damage) == 1 and damaged.damage[0].offset == start
    assert damaged.transactions == found.transactions - 1
    assert damaged.state["n"] == b"60", "the transactions after the damage are kept"
