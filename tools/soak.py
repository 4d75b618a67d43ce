"""A randomized mixed-workload soak of a real kvfs mount: never a wrong byte, under
eviction pressure and kill -9 of the daemon.

    .venv/bin/python tools/soak.py --minutes 30 [--workdir DIR] [--loop] [--shm]
        [--seed N] [--kill-interval 60:90] [--json OUT]

Writer processes store chunks the ways the engines do (``docs/engines.md``): LMCache
(``O_TRUNC`` + one write; ``O_DIRECT`` overwriting in place), vLLM's fs tier (an
``O_EXCL|O_DIRECT`` tmp file + ``os.replace``), SGLang (a buffered tmp file +
``os.replace``), ``kvfs.client.direct.write_from``, an fsync before the close; and delete.
Reader processes read whole files as the engines do (one ``read``, ``readinto``,
``O_DIRECT`` ``readv``, ``kvfs.client.direct.read_into``) or in 1 MiB pieces. Two top-level
directories: ``pool`` (kvfs-managed, a quota far below what its names need, so
eviction runs all the time) and ``durable`` (engine-managed, well within the pool:
nothing there may ever go). Every few minutes the daemon is killed with SIGKILL
mid-load and the pool remounted (recovery); the soak ends with a clean unmount and
``kvfs fsck``.

Every byte is self-describing: each 4 KiB block of a file starts with a header (run,
name, generation, block index, file length) followed by a body derived from (run,
name, generation), so any reader can tell, with no coordination, correct bytes of
some generation of this name from zeros, another file's bytes, a shifted block or a
short file. A shared table (a seqlock per name, in a mapped file outside the mount)
tells a reader whether its name was rewritten or deleted while it read:

- a *stable* read (no mutation of the name began or ended during it, the mount up)
  must return exactly the current generation, whole, or -- only in ``pool`` -- a
  miss (ENOENT/ESTALE/EIO: eviction). A short or stale read is a failure, and so is
  a miss in ``durable``;
- a read *racing* a rewrite, a delete or the kill may return less, or nothing, or
  an error; every block it returns must still be a block some generation of this
  name held at that offset.

Each writer keeps a ledger on the local disk: the begin of each change, and which
changes are durable (``docs/design.md``, "Durability contract": a file once its
close or fsync returned; a rename or unlink once a later close of this writer
returned). After every remount each name must hold an outcome allowed from its last
durable change on (``pool`` may also have lost it to eviction), never other bytes.

The aware ring (``docs/design.md``, "The aware ring") is in it twice: the odd-numbered
writers and readers take their ``direct-*`` operations through the daemon's ring
(``KVFS_DIRECT_ROUTE=ring``: what a process that may not open the devices gets), and
``--ring-clients`` processes store and read their own names in a third directory,
``ring``, through the ring only, while the controller kills one of them with SIGKILL
every few seconds (mid-request, whatever it was doing) and starts another. Each of
their reads must be exact; at every recovery check (the ring clients stopped) each
``ring`` file must be whole and exact or empty (killed between its create and its
reservation), and at the end no ticket or lease may be left.

Failures (wrong, short, stale or zero-filled reads, lost durable files, unexpected
errors, an operation past its deadline, a daemon that died by itself, fsck not
clean) are printed as they happen and summarised at the end; the exit code is 1 if
there was any. ``tests/mount/test_soak.py`` runs a short version.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import mmap
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvfs.testing import harness  # noqa: E402

MiB = 1 << 20
BLOCK = 4096
POOL, DURABLE, RING = "pool", "durable", "ring"
RING_SIZES = (MiB + 3, 4 * MiB, 9 * MiB - 5)
RING_NAMES = 6
"""Names per ring client (``ring/r<client>-<k>``), each of one of RING_SIZES."""


def ring_content(name: str, size: int) -> bytes:
    return random.Random(f"{name}:{size}").randbytes(size)


def ring_client_main(argv: list[str]) -> int:
    """A ring client: stores and reads its names through the daemon's ring, forever
    (until killed); exit 3 at a wrong byte."""
    os.environ["KVFS_DIRECT_ROUTE"] = "ring"
    import kvfs.client.direct as direct

    mnt, index, seed = argv[0], int(argv[1]), int(argv[2])
    rng = random.Random(seed)
    buf = direct.aligned(max(RING_SIZES))
    bufs = [direct.aligned(max(RING_SIZES)) for _ in range(3)]
    sources: dict[tuple[str, int], Any] = {}
    while True:
        name = f"r{index}-{rng.randrange(RING_NAMES)}"
        path = os.path.join(mnt, RING, name)
        try:
            if rng.random() < 0.5:
                size = rng.choice(RING_SIZES)
                if (name, size) not in sources:
                    src = direct.aligned(size)
                    src[:size] = ring_content(name, size)
                    sources[name, size] = src
                direct.write_from(path, memoryview(sources[name, size])[:size])
            elif rng.random() < 0.5:
                n = direct.read_into(path, buf)
                if n and (n not in RING_SIZES or buf[:n] != ring_content(name, n)):
                    print(f"WRONG BYTES: {name}: {n} bytes", file=sys.stderr, flush=True)
                    return 3
            else:  # a batch by path: the daemon opens them
                names = [f"r{index}-{k}" for k in rng.sample(range(RING_NAMES), 3)]
                paths = [os.path.join(mnt, RING, x) for x in names]
                got = direct.read_batch(zip(paths, bufs, strict=True))
                for x, b, n in zip(names, bufs, got, strict=True):
                    if (
                        isinstance(n, int)
                        and n
                        and (n not in RING_SIZES or b[:n] != ring_content(x, n))
                    ):
                        print(f"WRONG BYTES: {x}: {n} bytes (batch)", file=sys.stderr, flush=True)
                        return 3
        except (OSError, ValueError):
            time.sleep(0.05)  # evicted, the daemon killed and back: try again


# ====================================================================== content
MAGIC = b"KVSOAK\x00\x01"
HEADER = struct.Struct("<8sIIIIQ")  # magic, run, name, generation, block, file length
BODY = BLOCK - HEADER.size


@functools.lru_cache(maxsize=4096)
def body(run: int, name: int, gen: int) -> bytes:
    """The bytes after each block's header in generation ``gen`` of ``name``."""
    return random.Random(f"{run}/{name}/{gen}").randbytes(BODY)


def content(run: int, name: int, gen: int, length: int) -> bytes:
    """Generation ``gen`` of name ``name``: ``length`` bytes, a header per block."""
    tail = body(run, name, gen)
    blocks = [
        HEADER.pack(MAGIC, run, name, gen, i, length) + tail for i in range(-(-length // BLOCK))
    ]
    return b"".join(blocks)[:length]


def size_of(seed: int, name: int, max_bytes: int) -> int:
    """A fixed size per name (engines store a key's chunk at one size): tiny
    fragments, about one unit, or several units; aligned or not. The last block of
    an unaligned size holds at least a header."""
    rng = random.Random(f"size/{seed}/{name}")
    r = rng.random()
    if r < 0.2:
        length = rng.randrange(64, 24 * 1024)
    elif r < 0.5:
        length = rng.choice([MiB, MiB - BLOCK, MiB + BLOCK, 1_237_720, 700_000, 2 * MiB])
    else:
        length = rng.randrange(2 * BLOCK, max(3 * BLOCK, max_bytes)) // BLOCK * BLOCK
        if rng.random() < 0.4:
            length += rng.randrange(HEADER.size, BLOCK)
    if 0 < length % BLOCK < HEADER.size:
        length += HEADER.size
    return min(length, max_bytes)


def _describe_block(blk: bytes, run: int, name: int, index: int) -> str:
    if not blk.strip(b"\0"):
        return "zeros"
    if len(blk) < HEADER.size or blk[:8] != MAGIC:
        return "foreign bytes"
    _, r, n, g, i, length = HEADER.unpack_from(blk)
    if (r, n) != (run, name):
        return f"a block of name {n} (run {r}) gen {g} block {i}"
    if i != index:
        return f"block {i} of gen {g} (shifted)"
    return f"gen {g} with a wrong body" if length else "a bad header"


def check_blocks(
    data: bytes, run: int, name: int, length: int, allowed: Callable[[int], bool]
) -> tuple[list[int], str | None]:
    """Every block of ``data`` (a read from offset 0, maybe short) must be the block
    at its offset of a generation of ``name`` that ``allowed``. Returns the
    generations seen per block and a description of the first problems (None: ok)."""
    gens: list[int] = []
    bad: list[str] = []
    nbad = 0
    if len(data) > length:
        bad.append(f"{len(data)} bytes, the file has {length}")
        nbad += 1
    for index, off in enumerate(range(0, len(data), BLOCK)):
        blk = data[off : off + BLOCK]
        gen = -1
        if len(blk) >= HEADER.size and blk[:8] == MAGIC:
            _, r, n, g, i, ln = HEADER.unpack_from(blk)
            if (
                (r, n, i, ln) == (run, name, index, length)
                and allowed(g)
                and blk[HEADER.size :] == body(run, name, g)[: len(blk) - HEADER.size]
            ):
                gen = g
        elif 0 < len(blk) < HEADER.size:  # a short read ending inside a header
            for g in _gens_up_to(allowed):
                if blk == HEADER.pack(MAGIC, run, name, g, index, length)[: len(blk)]:
                    gen = g
                    break
        if gen < 0:
            nbad += 1
            if len(bad) < 3:
                bad.append(f"offset {off}: {_describe_block(blk, run, name, index)}")
        gens.append(gen)
    if not nbad:
        return gens, None
    return gens, f"{nbad} bad block(s) of {len(gens)}: " + "; ".join(bad)


def _gens_up_to(allowed: Callable[[int], bool], limit: int = 1 << 16) -> Iterator[int]:
    return (g for g in range(1, limit) if allowed(g))


def classify(data: bytes, run: int, name: int, length: int) -> tuple[str, str | None]:
    """What a whole-file read after recovery holds: ("empty" | "gen:N", None) or
    ("wrong", why)."""
    if not data:
        return "empty", None
    gens, problem = check_blocks(data, run, name, length, lambda g: True)
    if problem is None and len(set(gens)) > 1:
        problem = f"blocks of generations {sorted(set(gens))} mixed"
    if problem is None and len(data) != length:
        problem = f"short: {len(data)} of {length} bytes"
    if problem is not None:
        return "wrong", problem
    return f"gen:{gens[0]}", None


# ====================================================================== shared table
class Shared:
    """A mapped file outside the mount shared by all processes of one soak.

    Control words (down, epoch, pause, stop), a slot per process (parked, the
    operation in progress and since when), and per name a seqlock: ``seq`` odd while
    a change is in progress, ``gen`` the newest generation begun, ``state``
    (ABSENT, PRESENT: ``low`` is on disk, UNKNOWN: after a failed change)."""

    DOWN, EPOCH, PAUSE, STOP = range(4)
    SLOTS = 64
    ABSENT, PRESENT, UNKNOWN = 0, 1, 2

    def __init__(self, path: Path, names: int, create: bool = False) -> None:
        self.size = 8 * 8 + self.SLOTS * 32 + names * 32
        if create:
            with open(path, "wb") as f:
                f.truncate(self.size)
        self.fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(self.fd, self.size)
        self.q = memoryview(self.map).cast("Q")

    def get(self, word: int) -> int:
        return int(self.q[word])

    def set(self, word: int, value: int) -> None:
        self.q[word] = value

    def _slot(self, slot: int) -> int:
        return 8 + slot * 4

    def parked(self, slot: int) -> int:
        return int(self.q[self._slot(slot)])

    def set_parked(self, slot: int, value: int) -> None:
        self.q[self._slot(slot)] = value

    def begin_op(self, slot: int, code: int, name: int) -> None:
        base = self._slot(slot)
        self.q[base + 2] = code
        self.q[base + 3] = name + 1
        self.q[base + 1] = time.monotonic_ns()

    def end_op(self, slot: int) -> None:
        self.q[self._slot(slot) + 1] = 0

    def op_of(self, slot: int) -> tuple[int, int, int]:
        """(started, in monotonic ns; 0 when idle), code, name (-1: none)."""
        base = self._slot(slot)
        return int(self.q[base + 1]), int(self.q[base + 2]), int(self.q[base + 3]) - 1

    def _name(self, name: int) -> int:
        return 8 + self.SLOTS * 4 + name * 4

    def name_state(self, name: int) -> tuple[int, int, int, int]:
        """(seq, newest generation begun, state, generation on disk)."""
        base = self._name(name)
        seq = int(self.q[base])
        return seq, int(self.q[base + 1]), int(self.q[base + 2]), int(self.q[base + 3])

    def changing(self, names: int) -> list[int]:
        """The names with a change under way now."""
        base = self._name(0)
        seqs = self.q[base : base + names * 4 : 4]
        return [n for n, seq in enumerate(seqs) if seq % 2]

    def begin_change(self, name: int, gen: int) -> None:
        base = self._name(name)
        self.q[base] += 1  # odd: a change is under way
        if gen > self.q[base + 1]:
            self.q[base + 1] = gen

    def end_change(self, name: int, state: int, low: int) -> None:
        base = self._name(name)
        self.q[base + 2] = state
        self.q[base + 3] = low
        self.q[base] += 1  # even again, after the state it publishes

    def reset(self, name: int, state: int, low: int) -> None:
        """After a remount (everything parked): what is on disk now."""
        base = self._name(name)
        self.q[base + 2] = state
        self.q[base + 3] = low
        self.q[base + 1] = max(int(self.q[base + 1]), low)
        self.q[base] += 2


OP_CODES = [
    "idle",
    "trunc",
    "trunc-fsync",
    "odirect-inplace",
    "vllm",
    "sglang",
    "direct-write",
    "delete",
    "read-whole",
    "read-pieces",
    "read-odirect",
    "readinto",
    "direct-read",
    "reconcile",
    "stats",
]
CODE = {name: i for i, name in enumerate(OP_CODES)}
WRITES = ["trunc", "trunc-fsync", "odirect-inplace", "vllm", "sglang", "direct-write"]
ALIGNED_ONLY = {"odirect-inplace", "vllm"}
READS = ["read-whole", "read-pieces", "read-odirect", "readinto", "direct-read"]
OUTAGE_ERRNOS = {errno.ENOTCONN, errno.ECONNABORTED}
MISS = {errno.ENOENT, errno.ESTALE}


@dataclass
class Config:
    workdir: str
    mountpoint: str
    seed: int
    run: int
    pool_names: int
    durable_names: int
    pool_max: int
    durable_max: int
    writers: int
    readers: int
    deadline: float

    def names(self) -> int:
        return self.pool_names + self.durable_names

    def directory(self, name: int) -> str:
        return POOL if name < self.pool_names else DURABLE

    def path(self, name: int) -> str:
        return os.path.join(self.mountpoint, self.directory(name), f"c{name:05d}.bin")

    def length(self, name: int) -> int:
        cap = self.pool_max if name < self.pool_names else self.durable_max
        return size_of(self.seed, name, cap)


# ====================================================================== workers
class Worker:
    """What every writer and reader process shares: the table, failures, counts."""

    def __init__(self, cfg: Config, role: str, index: int) -> None:
        self.cfg = cfg
        self.role, self.index = role, index
        self.who = f"{role}{index}"
        self.slot = index if role == "writer" else cfg.writers + index
        self.shared = Shared(Path(cfg.workdir) / "shared.bin", cfg.names())
        self.rng = random.Random(f"{cfg.seed}/{self.who}")
        self.counts: Counter[str] = Counter()
        self.failures = os.open(
            Path(cfg.workdir) / "failures.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
        )
        self.stats_path = Path(cfg.workdir) / f"stats-{self.who}.json"
        self.last_dump = 0.0
        self.parent = os.getppid()

    def fail(self, kind: str, name: int, detail: str) -> None:
        rec = {
            "t": time.time(),
            "kind": kind,
            "who": self.who,
            "path": os.path.relpath(self.cfg.path(name), self.cfg.mountpoint) if name >= 0 else "",
            "detail": detail,
        }
        os.write(self.failures, (json.dumps(rec) + "\n").encode())
        self.counts[f"failure:{kind}"] += 1

    def outage(self) -> tuple[int, int]:
        return self.shared.get(Shared.DOWN), self.shared.get(Shared.EPOCH)

    def dump(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_dump > 2:
            self.last_dump = now
            tmp = self.stats_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(dict(self.counts)))
            os.replace(tmp, self.stats_path)

    def park(self) -> bool:
        """Between operations: wait while the controller remounts; False: stop."""
        sh = self.shared
        if sh.get(Shared.STOP) or os.getppid() != self.parent:  # done, or orphaned
            return False
        if sh.get(Shared.PAUSE):
            sh.set_parked(self.slot, 1)
            while sh.get(Shared.PAUSE) and not sh.get(Shared.STOP):
                time.sleep(0.02)
            sh.set_parked(self.slot, 0)
            self.resumed()
        return not sh.get(Shared.STOP)

    def resumed(self) -> None:
        pass

    def run(self) -> None:
        try:
            while self.park():
                try:
                    self.step()
                except Exception as e:  # a bug of the soak or an answer it never expects
                    self.fail("exception", -1, f"{e!r}\n{traceback.format_exc()}")
                    time.sleep(0.1)
                self.dump()
        finally:
            self.shared.end_op(self.slot)
            self.dump(force=True)

    def step(self) -> None:
        raise NotImplementedError


def _write_all(fd: int, data: bytes | memoryview) -> int:
    """One write, as the engines do; returns what it wrote."""
    return os.write(fd, data)


class Writer(Worker):
    """Owns the names ``i % writers == index``: writes and deletes them, records
    every change in its ledger."""

    def __init__(self, cfg: Config, index: int) -> None:
        super().__init__(cfg, "writer", index)
        self.names = [n for n in range(cfg.names()) if n % cfg.writers == index]
        self.pool = [n for n in self.names if n < cfg.pool_names]
        self.durable = [n for n in self.names if n >= cfg.pool_names]
        self.ledger = os.open(
            Path(cfg.workdir) / f"ledger-{index}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT
        )
        self.op = 0
        self.gens = {n: self.shared.name_state(n)[1] for n in self.names}
        self.pending: list[tuple[int, int]] = []  # (op, returned at op counter)
        biggest = max(cfg.pool_max, cfg.durable_max)
        self.aligned = memoryview(mmap.mmap(-1, -(-biggest // BLOCK) * BLOCK + BLOCK))

    def aligned_copy(self, data: bytes) -> memoryview:
        """``data`` in a page-aligned buffer (O_DIRECT, kvfs.client.direct)."""
        self.aligned[: len(data)] = data
        return self.aligned[: len(data)]

    def record(self, ev: str, op: int, name: int, **kw: Any) -> None:
        line = json.dumps({"ev": ev, "op": op, "name": name, **kw}) + "\n"
        os.write(self.ledger, line.encode())

    def resumed(self) -> None:
        self.pending.clear()  # the remount's check made everything before it the base

    def durable_point(self, began: int) -> None:
        """A close of this process that began at ``began`` returned: every rename
        and unlink that returned before it is durable."""
        keep = []
        for op, done in self.pending:
            if done < began:
                self.record("durable", op, -1)
            else:
                keep.append((op, done))
        self.pending = keep

    def step(self) -> None:
        rng = self.rng
        name = rng.choice(self.pool if rng.random() < 0.8 or not self.durable else self.durable)
        if rng.random() < 0.12:
            self.delete(name)
            return
        length = self.cfg.length(name)
        kinds = [k for k in WRITES if length % BLOCK == 0 or k not in ALIGNED_ONLY]
        self.write(name, rng.choice(kinds), length)

    def _change(self, kind: str, name: int, gen: int) -> tuple[int, tuple[int, int]]:
        self.op += 1
        self.record("begin", self.op, name, kind=kind, gen=gen)
        self.shared.begin_op(self.slot, CODE[kind], name)
        return self.op, self.outage()

    def _errno_ok(self, e: OSError, name: int, kind: str, before: tuple[int, int]) -> bool:
        """Whether an error of a change is one the soak allows."""
        code = e.errno or 0
        self.counts[f"{kind}:{errno.errorcode.get(code, code)}"] += 1
        if before[0] or self.outage() != before:
            return True  # the daemon was killed meanwhile: any error
        if code in OUTAGE_ERRNOS or code in (errno.ENOSPC, errno.EDQUOT):
            return True
        if code == errno.ENOENT and kind in ("vllm", "sglang") and name < self.cfg.pool_names:
            return True  # the tmp file was evicted before its rename (last resort)
        return code == errno.EIO and self.shared.name_state(name)[2] == Shared.UNKNOWN

    def _short(self, name: int, detail: str, before: tuple[int, int]) -> None:
        """A write() that returned less, and the close after it succeeded: LMCache
        (which ignores the count) now holds a short chunk. Allowed only when the
        daemon was killed meanwhile."""
        self.counts["short-write"] += 1
        if not before[0] and self.outage() == before:
            self.fail("short-write", name, detail)

    def write(self, name: int, kind: str, length: int) -> None:
        self.gens[name] += 1
        gen = self.gens[name]
        data = content(self.cfg.run, name, gen, length)
        path = self.cfg.path(name)
        if kind in ("vllm", "sglang"):
            self.write_renamed(name, kind, gen, data, path)
            return
        op, before = self._change(kind, name, gen)
        self.shared.begin_change(name, gen)
        ok = False
        try:
            began = self.op_counter()
            self._store(kind, path, data)
            ok = True
            self.durable_point(began)
            self.record("durable", op, name)
            self.counts[f"{kind}:ok"] += 1
            self.counts["bytes_written"] += length
        except OSError as e:
            if not self._errno_ok(e, name, kind, before):
                self.fail("write-error", name, f"{kind} gen {gen}: {e!r}")
        except ShortWrite as e:
            self._short(name, f"{kind} gen {gen}: {e}", before)
        finally:
            self.shared.end_change(name, *((Shared.PRESENT, gen) if ok else (Shared.UNKNOWN, 0)))
            self.shared.end_op(self.slot)

    def op_counter(self) -> int:
        self.op += 1
        return self.op

    def _store(self, kind: str, path: str, data: bytes) -> None:
        if kind == "direct-write":
            import kvfs.client.direct

            kvfs.client.direct.write_from(path, self.aligned_copy(data))
            return
        flags = os.O_WRONLY | os.O_CREAT
        flags |= os.O_DIRECT if kind == "odirect-inplace" else os.O_TRUNC
        fd = os.open(path, flags, 0o644)
        try:
            n = self._one_write(fd, data, direct=kind == "odirect-inplace")
            if kind == "trunc-fsync":
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        os.close(fd)
        _check_count(n, data)

    def _one_write(self, fd: int, data: bytes, direct: bool) -> int:
        """One write() of the whole chunk; its count is checked after the close
        (LMCache ignores it and closes)."""
        return _write_all(fd, self.aligned_copy(data) if direct else data)

    def write_renamed(self, name: int, kind: str, gen: int, data: bytes, path: str) -> None:
        """vLLM's fs tier (O_EXCL|O_DIRECT tmp) or SGLang (buffered tmp), then
        ``os.replace`` onto the name."""
        tag = f"{self.rng.getrandbits(40):010x}"
        tmp = f"{path}_{tag}.tmp" if kind == "vllm" else f"{path}.tmp.{os.getpid()}.{tag}"
        self.shared.begin_op(self.slot, CODE[kind], name)
        before = self.outage()
        try:
            began = self.op_counter()
            if kind == "vllm":
                flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT
                fd = os.open(tmp, flags, 0o644)
                try:
                    n = self._one_write(fd, data, direct=True)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                    raise
                os.close(fd)
                _check_count(n, data)
            else:
                with open(tmp, "wb") as f:
                    f.write(data)
            self.durable_point(began)
        except (OSError, ShortWrite) as e:
            self.shared.end_op(self.slot)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, ShortWrite):
                self._short(name, f"{kind} tmp gen {gen}: {e}", before)
            elif not self._errno_ok(e, name, kind, before):
                self.fail("write-error", name, f"{kind} tmp gen {gen}: {e!r}")
            return
        op, before = self._change(kind, name, gen)
        self.shared.begin_change(name, gen)
        state = self.shared.name_state(name)
        ok = False
        try:
            os.replace(tmp, path)
            ok = True
            self.pending.append((op, self.op_counter()))
            self.counts[f"{kind}:ok"] += 1
            self.counts["bytes_written"] += len(data)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not self._errno_ok(e, name, kind, before):
                self.fail("write-error", name, f"{kind} replace gen {gen}: {e!r}")
        finally:
            after = (Shared.PRESENT, gen) if ok else (state[2], state[3])
            if not ok and before != self.outage():
                after = (Shared.UNKNOWN, 0)
            self.shared.end_change(name, *after)
            self.shared.end_op(self.slot)

    def delete(self, name: int) -> None:
        op, before = self._change("delete", name, 0)
        self.shared.begin_change(name, 0)
        ok = False
        try:
            os.unlink(self.cfg.path(name))
            ok = True
            self.counts["delete:ok"] += 1
        except FileNotFoundError:
            ok = True
            self.counts["delete:ENOENT"] += 1
        except OSError as e:
            if not self._errno_ok(e, name, "delete", before):
                self.fail("delete-error", name, repr(e))
        finally:
            if ok:
                self.pending.append((op, self.op_counter()))
            self.shared.end_change(name, *((Shared.ABSENT, 0) if ok else (Shared.UNKNOWN, 0)))
            self.shared.end_op(self.slot)


class ShortWrite(Exception):
    pass


def _check_count(n: int, data: bytes) -> None:
    if n != len(data):
        raise ShortWrite(f"write() returned {n} of {len(data)} bytes, then close() succeeded")


class Reader(Worker):
    """Reads random names the engines' ways and checks every byte."""

    def __init__(self, cfg: Config, index: int) -> None:
        super().__init__(cfg, "reader", index)
        self.buffers: dict[int, mmap.mmap] = {}

    def buffer(self, length: int) -> mmap.mmap:
        size = -(-length // BLOCK) * BLOCK + BLOCK
        if size not in self.buffers:
            if len(self.buffers) > 64:
                for b in self.buffers.values():
                    b.close()
                self.buffers.clear()
            self.buffers[size] = mmap.mmap(-1, size)
        return self.buffers[size]

    def step(self) -> None:
        cfg, rng = self.cfg, self.rng
        hot = self.shared.changing(cfg.names()) if rng.random() < 0.4 else []
        name = rng.choice(hot) if hot else rng.randrange(cfg.names())  # hot: race a change
        kind = rng.choice(READS)
        length = cfg.length(name)
        before = self.outage()
        seq1, newest1, state1, low1 = self.shared.name_state(name)
        self.shared.begin_op(self.slot, CODE[kind], name)
        try:
            got: bytes | int = self._read(kind, cfg.path(name), length)
        except OSError as e:
            got = e.errno or 0
        finally:
            self.shared.end_op(self.slot)
        seq2, newest2, _, _ = self.shared.name_state(name)
        after = self.outage()
        outage = bool(before[0] or after[0] or before != after)
        stable = not outage and seq1 == seq2 and seq1 % 2 == 0 and state1 != Shared.UNKNOWN
        # the oldest generation a racing read may see: the one on disk when it began;
        # after a delete, only what a change under way (seq odd) or later writes
        if state1 == Shared.PRESENT:
            first = low1
        elif state1 == Shared.ABSENT:
            first = newest1 if seq1 % 2 else newest1 + 1
        else:
            first = 1
        self.judge(name, kind, got, length, stable, outage, state1, low1, first, newest2)

    def _read(self, kind: str, path: str, length: int) -> bytes:
        if kind == "direct-read":
            import kvfs.client.direct

            buf = self.buffer(length)
            n = kvfs.client.direct.read_into(path, buf)
            return bytes(buf[:n])
        if kind == "readinto":
            with open(path, "rb", buffering=0) as f:
                ba = bytearray(length)
                n = f.readinto(ba) or 0
                return bytes(ba[:n])
        flags = os.O_RDONLY | (os.O_DIRECT if kind == "read-odirect" else 0)
        fd = os.open(path, flags)
        try:
            if kind == "read-whole":
                return os.read(fd, length)
            if kind == "read-odirect":
                buf = self.buffer(length)
                n = os.preadv(fd, [buf], 0)
                return bytes(buf[:n])
            parts = []
            off = 0
            while piece := os.pread(fd, MiB, off):
                parts.append(piece)
                off += len(piece)
            return b"".join(parts)
        finally:
            os.close(fd)

    def judge(
        self,
        name: int,
        kind: str,
        got: bytes | int,
        length: int,
        stable: bool,
        outage: bool,
        state: int,
        low: int,
        first: int,
        newest2: int,
    ) -> None:
        cfg = self.cfg
        where = cfg.directory(name)
        mode = "stable" if stable else "outage" if outage else "racing"
        if isinstance(got, int):
            label = errno.errorcode.get(got, str(got))
            self.counts[f"{kind}:{mode}:{label}"] += 1
            if outage or got in OUTAGE_ERRNOS:
                return
            if got in MISS or got == errno.EIO:
                if stable and state == Shared.PRESENT and where == DURABLE:
                    self.fail("lost", name, f"{kind}: {label} for gen {low}, stable, {where}")
                return
            self.fail("read-error", name, f"{kind} ({mode}): {label}")
            return
        if stable:
            if state == Shared.PRESENT and got == content(cfg.run, name, low, length):
                self.counts[f"{kind}:stable:exact"] += 1
                self.counts["bytes_verified"] += len(got)
                return
            self._stable_wrong(name, kind, got, length, state, low)
            return
        # racing a change (or the kill): every block of a generation that may be there
        _, problem = check_blocks(
            got, cfg.run, name, length, lambda g: first <= g <= newest2 or g == low
        )
        if problem is not None:
            self.fail(
                "wrong-bytes",
                name,
                f"{kind} ({mode}, gens {first}..{newest2}): {len(got)} bytes: {problem}",
            )
            return
        self.counts[f"{kind}:{mode}:" + ("whole" if len(got) == length else "partial")] += 1
        self.counts["bytes_verified"] += len(got)

    def _stable_wrong(
        self, name: int, kind: str, got: bytes, length: int, state: int, low: int
    ) -> None:
        cfg = self.cfg
        if state == Shared.ABSENT:
            self.fail("deleted-served", name, f"{kind}: {len(got)} bytes of a deleted file")
            return
        gens, problem = check_blocks(got, cfg.run, name, length, lambda g: 0 < g <= low + 1000)
        if problem is not None:
            self.fail("wrong-bytes", name, f"{kind} (stable, gen {low}): {problem}")
        elif len(got) < length:
            self.fail("short-read", name, f"{kind} (stable, gen {low}): {len(got)} of {length}")
        else:
            self.fail("stale", name, f"{kind} (stable): gens {sorted(set(gens))}, want {low}")


def worker_main(argv: list[str]) -> int:
    role, index, cfg_path = argv[0], int(argv[1]), argv[2]
    cfg = Config(**json.loads(Path(cfg_path).read_text()))
    worker: Worker = Writer(cfg, index) if role == "writer" else Reader(cfg, index)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    worker.run()
    return 0


# ====================================================================== the model
@dataclass
class Version:
    op: int
    outcome: str  # "gen:N", "empty", "absent"
    main: bool
    durable: bool = False


@dataclass
class NameModel:
    versions: list[Version] = field(default_factory=list)

    def allowed(self) -> set[str]:
        last = max(i for i, v in enumerate(self.versions) if v.durable)
        return {v.outcome for v in self.versions[last:]}

    def durable_outcome(self) -> str:
        return [v for v in self.versions if v.durable][-1].outcome


def outcomes(kind: str, gen: int) -> list[tuple[str, bool]]:
    """What a crash may leave of a change (the second item: the change's own)."""
    if kind == "delete":
        return [("absent", True)]
    new = (f"gen:{gen}", True)
    if kind in ("vllm", "sglang"):
        return [new]  # an atomic replace
    if kind == "odirect-inplace":
        return [("absent", False), new]  # the first changed byte marks it WRITING
    return [("empty", False), ("absent", False), new]  # O_TRUNC


class Ledgers:
    """Replays the writers' ledgers into a model per name (by (writer, op))."""

    def __init__(self, workdir: Path, writers: int) -> None:
        self.paths = [workdir / f"ledger-{w}.jsonl" for w in range(writers)]
        self.offsets = [0] * writers
        self.models: dict[int, NameModel] = {}
        self.by_op: dict[tuple[int, int], int] = {}

    def base(self, name: int, outcome: str) -> None:
        self.models[name] = NameModel([Version(0, outcome, True, durable=True)])

    def replay(self) -> int:
        """Read what the ledgers gained; returns how many records."""
        n = 0
        for w, path in enumerate(self.paths):
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets[w])
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[w] += end
            for line in data[:end].splitlines():
                self.apply(w, json.loads(line))
                n += 1
        return n

    def apply(self, w: int, rec: dict[str, Any]) -> None:
        key = (w, rec["op"])
        if rec["ev"] == "begin":
            name = rec["name"]
            self.by_op[key] = name
            model = self.models[name]
            for outcome, main in outcomes(rec["kind"], rec["gen"]):
                model.versions.append(Version(rec["op"], outcome, main))
        elif rec["ev"] == "durable":
            name = self.by_op.get(key, -1)
            for v in self.models[name].versions if name >= 0 else []:
                if v.op == rec["op"] and v.main:
                    v.durable = True


# ====================================================================== controller
def _read_proc(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read().strip()
    except OSError as e:
        return f"<{e.strerror}>"


def process_state(pid: int) -> dict[str, Any]:
    """What the kernel says a process is doing: its State line and, per thread, the
    wait channel and kernel stack (``/proc/PID/task/TID/stack``: root only)."""
    status = _read_proc(f"/proc/{pid}/status")
    state = next(
        (ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("State:")),
        status,
    )
    threads = {}
    with contextlib.suppress(OSError):
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            task = f"/proc/{pid}/task/{tid}"
            threads[tid] = {
                "state": (_read_proc(f"{task}/stat").rpartition(")")[2].split() or ["?"])[0],
                "wchan": _read_proc(f"{task}/wchan"),
                "stack": _read_proc(f"{task}/stack").splitlines(),
            }
    return {
        "pid": pid,
        "cmdline": _read_proc(f"/proc/{pid}/cmdline").replace("\0", " "),
        "state": state,
        "threads": threads,
    }


def fuse_holders() -> list[str]:
    """Every process with ``/dev/fuse`` open ("PID fd FD CMDLINE"): while one holds a
    connection's fd, the kernel does not abort the connection's requests. Each
    thread's table is read: a killed daemon's leader is a zombie with none, while a
    thread of it stuck in the kernel still holds the shared table."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                fds = f"/proc/{pid}/task/{tid}/fd"
                for fd in os.listdir(fds):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"{fds}/{fd}") == "/dev/fuse":
                            cmd = _read_proc(f"/proc/{pid}/cmdline").replace("\0", " ")
                            found[(pid, fd)] = f"{pid} fd {fd} (thread {tid}) {cmd[:120]}"
    return sorted(found.values())


def format_diagnosis(diag: dict[str, Any]) -> str:
    """A hang's diagnosis for the terminal: the threads in the kernel, with stacks."""
    lines = [
        f"  /dev/fuse held by: {diag['fuse_holders'] or 'nobody'}; "
        f"waiting requests per connection: {diag['fuse_connections']}"
    ]
    procs = [("stuck", diag["stuck"])]
    if isinstance(diag["daemon"], dict):
        procs.append(("daemon", diag["daemon"]))
    else:
        lines.append(f"  daemon: {diag['daemon']}")
    for what, proc in procs:
        lines.append(f"  {what} pid {proc['pid']} ({proc['state']}): {proc['cmdline'][:100]}")
        for tid, t in proc["threads"].items():
            lines.append(f"    thread {tid} {t['state']} wchan {t['wchan']}")
            lines += [f"      {frame}" for frame in t["stack"]]
    return "\n".join(lines)


def fuse_connections() -> dict[str, str]:
    """Requests waiting per FUSE connection (``/sys/fs/fuse/connections/N/waiting``)."""
    root = "/sys/fs/fuse/connections"
    with contextlib.suppress(OSError):
        return {c: _read_proc(f"{root}/{c}/waiting") for c in sorted(os.listdir(root))}
    return {}


def _unlink(path: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
        os.unlink(path)


@dataclass
class Totals:
    kills: int = 0
    connections_aborted: int = 0
    """Kills after which the daemon could not exit: its FUSE connection was aborted."""
    remounts: int = 0
    checks: int = 0
    names_checked: int = 0
    durable_verified: int = 0
    evicted_or_absent: int = 0
    tmp_removed: int = 0
    evictions: Counter[str] = field(default_factory=Counter)
    ring_kills: int = 0
    ring_files_checked: int = 0
    fsck: str = ""
    failures: list[dict[str, Any]] = field(default_factory=list)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvfs-soak-")).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        for stale in self.workdir.glob("*.jsonl"):
            stale.unlink()
        for stale in self.workdir.glob("stats-*.json"):
            stale.unlink()
        self.mnt = self.workdir / "mnt"
        self.log = self.workdir / "kvfs.log"
        self.cfg = Config(
            workdir=str(self.workdir),
            mountpoint=str(self.mnt),
            seed=args.seed,
            run=self.rng.randrange(1 << 32),
            pool_names=args.pool_names,
            durable_names=args.durable_names,
            pool_max=args.pool_max,
            durable_max=args.durable_max,
            writers=args.writers,
            readers=args.readers,
            deadline=args.deadline,
        )
        self.shared = Shared(self.workdir / "shared.bin", self.cfg.names(), create=True)
        self.slot = Shared.SLOTS - 1
        self.totals = Totals()
        self.ledgers = Ledgers(self.workdir, args.writers)
        self.failure_file = self.workdir / "failures.jsonl"
        self.failure_file.touch()
        self.failures_seen = 0
        self.procs: list[subprocess.Popen[bytes]] = []
        self.daemon: subprocess.Popen[bytes] | None = None
        self.stack: ExitStack | None = None
        self.mount_evictions: Counter[str] = Counter()
        self.aborted = False
        self.device = ""
        self.loop = False
        self.t0 = time.monotonic()

    # -------------------------------------------------------------- failures
    def fail(self, kind: str, path: str, detail: str, **extra: Any) -> None:
        rec = {"t": time.time(), "kind": kind, "who": "controller", "path": path, "detail": detail}
        rec.update(extra)
        with open(self.failure_file, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def collect_failures(self) -> None:
        lines = self.failure_file.read_text().splitlines()
        for line in lines[self.failures_seen :]:
            rec = json.loads(line)
            self.totals.failures.append(rec)
            print(
                f"[{self.elapsed():7.1f}s] FAILURE {rec['kind']} {rec['who']} "
                f"{rec['path']}: {rec['detail']}",
                flush=True,
            )
            if "diagnosis" in rec:
                print(format_diagnosis(rec["diagnosis"]), flush=True)
        self.failures_seen = len(lines)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def note(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)

    # -------------------------------------------------------------- the mount
    def mount(self, first: bool) -> None:
        assert self.stack is None
        stack = ExitStack()
        extra = ["--format", "--meta-size", self.args.meta_size] if first else []
        try:
            self.daemon = stack.enter_context(
                harness.mounted(
                    self.mnt, [self.device], *extra, log_file=self.log, timeout=self.args.deadline
                )
            )
        except BaseException:
            stack.close()
            raise
        self.stack = stack
        self.mount_evictions = Counter()

    def kill(self) -> None:
        assert self.daemon is not None and self.stack is not None
        self.poll_stats()
        if harness.kill(self.daemon, self.mnt):
            self.totals.connections_aborted += 1
            self.note(
                "the killed daemon could not exit (a thread of it blocked in a FUSE "
                "notification): its connection was aborted"
            )
        self.stack.close()
        self.stack = None
        self.daemon = None
        self.totals.evictions.update(self.mount_evictions)

    def unmount(self) -> int:
        assert self.daemon is not None and self.stack is not None
        self.poll_stats()
        code = harness.stop(self.daemon, self.mnt, timeout=self.args.deadline)
        self.stack.close()
        self.stack = None
        self.daemon = None
        self.totals.evictions.update(self.mount_evictions)
        return code

    def poll_stats(self) -> None:
        """Evictions by reason and directory since this mount (kept at each poll,
        so a kill loses at most a poll's worth)."""
        try:
            stats = json.loads(os.getxattr(self.mnt, "user.kvfs.stats"))
        except OSError:
            return
        counts = Counter(
            {f"{r['reason']}:{r['directory']}": int(r["files"]) for r in stats["evictions"]}
        )
        self.mount_evictions = counts | self.mount_evictions
        if any(key.endswith(f":{DURABLE}") for key in counts) and not self.durable_evicted:
            self.durable_evicted = True
            self.fail("evicted-durable", DURABLE, f"eviction took files of {DURABLE}: {counts}")

    durable_evicted = False

    def setup_tree(self) -> None:
        pool, durable = self.mnt / POOL, self.mnt / DURABLE
        pool.mkdir()
        durable.mkdir()
        (self.mnt / RING).mkdir()
        os.setxattr(pool, "user.kvfs.policy", b"kvfs-managed")
        os.setxattr(pool, "user.kvfs.quota", str(self.args.pool_quota).encode())
        os.setxattr(durable, "user.kvfs.policy", b"engine-managed")
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)
        for name in range(self.cfg.names()):
            self.ledgers.base(name, "absent")

    # -------------------------------------------------------------- processes
    def spawn(self) -> None:
        cfg_path = self.workdir / "config.json"
        cfg_path.write_text(json.dumps(asdict(self.cfg)))
        for role, n in (("writer", self.cfg.writers), ("reader", self.cfg.readers)):
            for i in range(n):
                env = dict(os.environ)
                if i % 2:  # its direct-* operations through the daemon's ring
                    env["KVFS_DIRECT_ROUTE"] = "ring"
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "worker", role, str(i), str(cfg_path)], env=env
                    )
                )
        self.ring_procs = [self._ring_client(i) for i in range(self.args.ring_clients)]

    def _ring_client(self, index: int) -> subprocess.Popen[bytes]:
        seed = self.rng.randrange(1 << 30)
        cmd = [sys.executable, __file__, "ringclient", str(self.mnt), str(index), str(seed)]
        return subprocess.Popen(cmd)

    ring_procs: list[subprocess.Popen[bytes]] = []

    def kill_a_ring_client(self) -> None:
        """SIGKILL one ring client, mid-request or not, and start another in its place."""
        if not self.ring_procs:
            return
        i = self.rng.randrange(len(self.ring_procs))
        self.check_ring_clients()
        self.ring_procs[i].kill()
        self.ring_procs[i].wait()
        self.totals.ring_kills += 1
        self.ring_procs[i] = self._ring_client(i)

    def check_ring_clients(self) -> None:
        for i, p in enumerate(self.ring_procs):
            if p.poll() is not None:
                kind = "ring-wrong-bytes" if p.returncode == 3 else "ring-client-died"
                self.fail(kind, RING, f"ring client {i} exited {p.returncode} by itself")
                self.ring_procs[i] = self._ring_client(i)

    def check_ring_files(self, when: str) -> None:
        """The ring clients stopped (SIGSTOP): every ring file whole and exact, or empty
        (its client was killed between its create and its reservation)."""
        for p in self.ring_procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGSTOP)
        try:
            for entry in os.listdir(self.mnt / RING):
                data = self._read_all(str(self.mnt / RING / entry))
                self.totals.ring_files_checked += 1
                if isinstance(data, int):
                    if data not in MISS:  # evicted meanwhile: a miss is allowed
                        self.fail("ring-read", f"{RING}/{entry}", f"{when}: errno {data}")
                elif data and (
                    len(data) not in RING_SIZES or data != ring_content(entry, len(data))
                ):
                    self.fail("ring-wrong-bytes", f"{RING}/{entry}", f"{when}: {len(data)} bytes")
        finally:
            for p in self.ring_procs:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)

    def watchdog(self) -> None:
        """A thread: an operation of any process past its deadline is a hang (then
        everything is torn down and the soak exits 3)."""
        slots = [*range(self.cfg.writers + self.cfg.readers), self.slot]
        while not self.aborted:
            now = time.monotonic_ns()
            for s in slots:
                started, code, name = self.shared.op_of(s)
                if started and (now - started) / 1e9 > self.cfg.deadline:
                    who = "controller" if s == self.slot else f"slot {s}"
                    path = os.path.relpath(self.cfg.path(name), self.mnt) if name >= 0 else ""
                    self.fail(
                        "hang",
                        path,
                        f"{who}: {OP_CODES[code]} running for {(now - started) / 1e9:.0f} s "
                        f"(deadline {self.cfg.deadline:.0f} s)",
                        diagnosis=self.diagnose(s),
                    )
                    self.abort()
                    return
            time.sleep(1)

    def diagnose(self, slot: int) -> dict[str, Any]:
        """Where a hung slot's process is stuck, who holds ``/dev/fuse``, the daemon."""
        pid = os.getpid() if slot == self.slot else self.procs[slot].pid
        daemon = self.daemon
        alive = daemon is not None and daemon.poll() is None
        return {
            "stuck": process_state(pid),
            "fuse_holders": fuse_holders(),
            "fuse_connections": fuse_connections(),
            "daemon": process_state(daemon.pid) if daemon is not None and alive else "not running",
        }

    def abort(self) -> None:
        self.aborted = True
        self.collect_failures()
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        if self.daemon is not None:  # aborts its connection if it cannot exit
            harness.kill(self.daemon, self.mnt)
        harness.unmount(self.mnt)
        if self.loop:
            subprocess.run(["losetup", "-d", self.device], capture_output=True)
        self.report()
        os._exit(3)

    def wait_parked(self) -> None:
        deadline = time.monotonic() + self.cfg.deadline
        for i, p in enumerate(self.procs):
            while not self.shared.parked(i):
                if p.poll() is not None:
                    self.fail("worker-died", "", f"worker slot {i} exited {p.returncode}")
                    return
                if time.monotonic() > deadline:
                    return  # the watchdog reports the operation it is stuck in
                time.sleep(0.02)

    def check_workers(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None and not self.shared.get(Shared.STOP):
                self.fail("worker-died", "", f"worker slot {i} exited {p.returncode}")
                self.abort()

    # -------------------------------------------------------------- recovery check
    def reconcile(self, when: str, live: bool = False) -> None:
        """Everything parked, the mount fresh: every name holds an outcome its
        ledger allows; the table and the ledger base are reset to what is there.
        ``live`` (no crash since the writers stopped): a name holds exactly what
        its writer's last change left (or, in ``pool``, nothing)."""
        self.ledgers.replay()
        cfg = self.cfg
        self.totals.checks += 1
        for d in (POOL, DURABLE):
            for entry in os.listdir(self.mnt / d):
                if ".tmp" in entry:  # a tmp file whose rename never came
                    self._timed(functools.partial(_unlink, self.mnt / d / entry), "reconcile", -1)
                    self.totals.tmp_removed += 1
                elif not (entry.startswith("c") and entry.endswith(".bin")):
                    self.fail("phantom", f"{d}/{entry}", f"{when}: a name no writer made")
        for name in range(cfg.names()):
            self._reconcile_name(name, when, live)
        self.check_ring_files(when)
        for d in (POOL, DURABLE):
            fd = os.open(self.mnt / d, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(fd)  # the cleanup (unlinks) is the base of the next check
            os.close(fd)

    def _timed(self, fn: Callable[[], Any], what: str, name: int) -> Any:
        self.shared.begin_op(self.slot, CODE[what], name)
        try:
            return fn()
        finally:
            self.shared.end_op(self.slot)

    def _read_all(self, path: str) -> bytes | int:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            return e.errno or 0

    def _reconcile_name(self, name: int, when: str, live: bool) -> None:
        cfg = self.cfg
        path = cfg.path(name)
        rel = os.path.relpath(path, self.mnt)
        got = self._timed(lambda: self._read_all(path), "reconcile", name)
        model = self.ledgers.models[name]
        allowed = model.allowed()
        _, _, state, low = self.shared.name_state(name)
        if live and state != Shared.UNKNOWN:
            allowed = {f"gen:{low}" if state == Shared.PRESENT else "absent"}
        if cfg.directory(name) == POOL:
            allowed.add("absent")  # eviction
        self.totals.names_checked += 1
        if isinstance(got, int):
            outcome = "absent" if got == errno.ENOENT else f"errno:{errno.errorcode.get(got)}"
        else:
            outcome, problem = classify(got, cfg.run, name, cfg.length(name))
            if problem is not None:
                self.fail("wrong-after-recovery", rel, f"{when}: {problem}")
        durable = model.durable_outcome()
        if outcome != "wrong" and outcome not in allowed:
            kind = "lost-durable" if outcome == "absent" or outcome.startswith("errno") else ""
            self.fail(
                kind or "not-allowed-after-recovery",
                rel,
                f"{when}: holds {outcome}; allowed {sorted(allowed)} (durable: {durable}); "
                f"versions {[(v.op, v.outcome, v.durable) for v in model.versions][-6:]}",
            )
        if outcome == durable and outcome.startswith("gen:"):
            self.totals.durable_verified += 1
        elif outcome == "absent" and durable != "absent":
            self.totals.evicted_or_absent += 1
        # the new base: what is there (an empty or unreadable file is removed)
        if outcome.startswith("gen:"):
            gen = int(outcome[4:])
            self.shared.reset(name, Shared.PRESENT, gen)
            self.ledgers.base(name, outcome)
            return
        if outcome != "absent":
            self._timed(lambda: _unlink(path), "reconcile", name)
        self.shared.reset(name, Shared.ABSENT, 0)
        self.ledgers.base(name, "absent")

    # -------------------------------------------------------------- the run
    def kill_cycle(self) -> None:
        sh = self.shared
        self.note(f"kill -9 #{self.totals.kills + 1} of the daemon (pid {self.daemon_pid()})")
        sh.set(Shared.DOWN, 1)
        self.kill()
        self.totals.kills += 1
        sh.set(Shared.PAUSE, 1)
        self.wait_parked()
        self.collect_failures()
        self.mount(first=False)
        self.totals.remounts += 1
        self.reconcile(f"after kill {self.totals.kills}")
        sh.set(Shared.EPOCH, sh.get(Shared.EPOCH) + 1)
        sh.set(Shared.DOWN, 0)
        sh.set(Shared.PAUSE, 0)
        self.note(f"remounted, {self.cfg.names()} names checked against the ledgers")

    def daemon_pid(self) -> int:
        return self.daemon.pid if self.daemon is not None else 0

    def next_kill(self) -> float:
        lo, hi = self.args.kill_interval
        return time.monotonic() + self.rng.uniform(lo, hi)

    def run(self) -> int:
        args = self.args
        with ExitStack() as outer:
            image = self._image(outer)
            self.device = (
                outer.enter_context(harness.loop_device(image, direct_io=True))
                if args.loop
                else str(image)
            )
            self.loop = args.loop
            self.note(
                f"soak: seed {args.seed}, {args.seconds:.0f} s, {self.cfg.names()} names, "
                f"{args.writers} writers, {args.readers} readers, pool quota "
                f"{args.pool_quota >> 20} MiB on {self.device}; workdir {self.workdir}"
            )
            self.mount(first=True)
            self.setup_tree()
            self.spawn()
            threading.Thread(target=self.watchdog, daemon=True).start()
            end = time.monotonic() + args.seconds
            kill_at = self.next_kill() if args.kill_interval[1] > 0 else float("inf")
            ring_kill_at = time.monotonic() + self.rng.uniform(1, 4)
            last_stats = 0.0
            try:
                while time.monotonic() < end:
                    time.sleep(0.25)
                    self.collect_failures()
                    self.check_workers()
                    assert self.daemon is not None
                    if self.daemon.poll() is not None:
                        self.fail("daemon-died", "", f"kvfs exited {self.daemon.returncode}")
                        self.abort()
                    if time.monotonic() - last_stats > 2:
                        last_stats = time.monotonic()
                        self._timed(self.poll_stats, "stats", -1)
                    if time.monotonic() >= ring_kill_at:
                        self.kill_a_ring_client()
                        ring_kill_at = time.monotonic() + self.rng.uniform(1, 4)
                    if time.monotonic() >= kill_at and end - time.monotonic() > 10:
                        self.kill_cycle()
                        kill_at = self.next_kill()
                    if len(self.totals.failures) >= args.max_failures:
                        self.note(f"{args.max_failures} failures: stopping early")
                        break
                self.finish()
            finally:
                self.aborted = True
                for p in [*self.procs, *self.ring_procs]:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                if self.stack is not None:
                    assert self.daemon is not None
                    self.unmount()
        self.collect_failures()
        self.report()
        return 1 if self.totals.failures else 0

    def _image(self, stack: ExitStack) -> Path:
        if self.args.shm:
            image = Path("/dev/shm") / f"kvfs-soak-{os.getpid()}.img"
            stack.callback(lambda: image.unlink(missing_ok=True))
        else:
            image = self.workdir / "pool.img"
        return harness.make_image(image, self.args.image_size)

    def finish(self) -> None:
        sh = self.shared
        sh.set(Shared.STOP, 1)
        deadline = time.monotonic() + self.cfg.deadline
        for p in self.procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.fail("hang", "", f"a worker did not stop within {self.cfg.deadline:.0f} s")
        self.collect_failures()
        self.check_ring_clients()
        for p in self.ring_procs:  # the last kills: then nothing of theirs may be left
            p.kill()
            p.wait()
            self.totals.ring_kills += 1
        self.reconcile("at the end", live=True)
        left: dict[str, Any] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stats = json.loads(os.getxattr(self.mnt, "user.kvfs.stats"))
            left = {k: stats["direct"][k] for k in ("tickets", "leased_files")}
            if not any(left.values()):
                break
            time.sleep(0.2)
        else:
            self.fail("ring-left", RING, f"after every client was killed: {left}")
        code = self.unmount()
        if code != 0:
            self.fail("unclean-unmount", "", f"kvfs exited {code} on a clean unmount")
        r = subprocess.run(
            [*harness.kvfs_command(), "fsck", self.device],
            capture_output=True,
            text=True,
            timeout=max(600, self.cfg.deadline),
        )
        last = (r.stdout.strip().splitlines() or [""])[-1]
        self.totals.fsck = f"exit {r.returncode}: {last}"
        if r.returncode != 0:
            self.fail("fsck", "", f"fsck exited {r.returncode}:\n{r.stdout}{r.stderr}")
        log = self.log.read_text(errors="replace") if self.log.exists() else ""
        if "Traceback" in log:
            i = log.index("Traceback")
            self.fail("daemon-traceback", "", log[i : i + 2000])

    # -------------------------------------------------------------- the summary
    def counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for path in self.workdir.glob("stats-*.json"):
            with contextlib.suppress(ValueError, OSError):
                total.update(json.loads(path.read_text()))
        return total

    def summary(self) -> dict[str, Any]:
        counts = self.counts()
        t = self.totals
        log = self.log.read_text(errors="replace") if self.log.exists() else ""
        errors = [line for line in log.splitlines() if " ERROR " in line]
        return {
            "seed": self.args.seed,
            "seconds": round(self.elapsed(), 1),
            "kills": t.kills,
            "connections_aborted": t.connections_aborted,
            "remounts": t.remounts,
            "recovery_checks": t.checks,
            "names_checked": t.names_checked,
            "durable_verified_after_recovery": t.durable_verified,
            "absent_after_recovery": t.evicted_or_absent,
            "tmp_files_removed": t.tmp_removed,
            "ring_client_kills": t.ring_kills,
            "ring_files_checked": t.ring_files_checked,
            "bytes_written": counts.pop("bytes_written", 0),
            "bytes_verified": counts.pop("bytes_verified", 0),
            "evictions": dict(t.evictions),
            "ops": dict(sorted(counts.items())),
            "fsck": t.fsck,
            "kvfs_log_errors": len(errors),
            "kvfs_log_error_sample": errors[:5],
            "failures": len(t.failures),
            "failures_by_kind": dict(Counter(f["kind"] for f in t.failures)),
            "failure_sample": t.failures[:30],
            "workdir": str(self.workdir),
        }

    def report(self) -> None:
        s = self.summary()
        ops = Counter(s["ops"])
        by_kind: Counter[str] = Counter()
        for key, n in ops.items():
            by_kind[key.split(":")[0]] += n
        print(
            f"soak: {s['seconds']} s, seed {s['seed']}, {s['kills']} kill -9 "
            f"({s['connections_aborted']} needing a connection abort), "
            f"{s['recovery_checks']} recovery checks ({s['names_checked']} names, "
            f"{s['durable_verified_after_recovery']} durable files byte-identical, "
            f"{s['absent_after_recovery']} absent after being durable)"
        )
        print(
            f"  written {s['bytes_written'] / MiB:.0f} MiB, verified "
            f"{s['bytes_verified'] / MiB:.0f} MiB; evictions {s['evictions']}"
        )
        print("  ops: " + ", ".join(f"{k} {n}" for k, n in sorted(by_kind.items())))
        print(
            f"  ring: {s['ring_client_kills']} ring clients killed (-9), "
            f"{s['ring_files_checked']} ring files checked"
        )
        for key, n in sorted(ops.items()):
            print(f"    {key}: {n}")
        print(f"  fsck: {s['fsck']}; kvfs log ERROR lines: {s['kvfs_log_errors']}")
        print(f"  failures: {s['failures']} {s['failures_by_kind']}")
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(s, indent=1))


# ====================================================================== CLI
def _interval(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(":")
    a, b = float(lo), float(hi or lo)
    if a < 0 or b < a:
        raise argparse.ArgumentTypeError(f"not LOW:HIGH seconds: {text!r}")
    return a, b


def parse_args(argv: list[str]) -> argparse.Namespace:
    from kvfs.common.sizes import parse_size

    def size(text: str) -> int:
        try:
            return parse_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seconds", type=float, help="instead of --minutes")
    p.add_argument("--workdir", help="image, ledgers, log, mountpoint (default: a new temp dir)")
    p.add_argument("--loop", action="store_true", help="on a loop device (--direct-io=on)")
    p.add_argument("--shm", action="store_true", help="the image in /dev/shm")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--kill-interval", type=_interval, default=(60.0, 90.0), help="LOW:HIGH s (0: never)"
    )
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--writers", type=int, default=3)
    p.add_argument("--readers", type=int, default=3)
    p.add_argument("--image-size", type=size, default=1 << 30)
    p.add_argument("--meta-size", default="16M")
    p.add_argument("--pool-quota", type=size, default=320 * MiB)
    p.add_argument("--pool-names", type=int, default=240)
    p.add_argument("--durable-names", type=int, default=80)
    p.add_argument("--pool-max", type=size, default=8 * MiB, help="largest chunk in pool")
    p.add_argument("--durable-max", type=size, default=3 * MiB, help="largest in durable")
    p.add_argument("--deadline", type=float, default=60.0, help="per operation, s")
    p.add_argument("--max-failures", type=int, default=200, help="stop early after these")
    p.add_argument(
        "--ring-clients", type=int, default=2, help="ring-only clients, killed at random (0: none)"
    )
    args = p.parse_args(argv)
    if args.seconds is None:
        args.seconds = args.minutes * 60
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    if args.writers < 1 or args.readers < 0 or args.writers + args.readers >= Shared.SLOTS:
        p.error(f"--writers 1.. and --readers 0.. with fewer than {Shared.SLOTS} in all")
    if args.durable_names and args.durable_names < args.writers:
        p.error("--durable-names: at least one per writer")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    if argv[:1] == ["ringclient"]:
        return ring_client_main(argv[1:])
    args = parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    if shutil.which("fusermount3") is None or not os.path.exists("/dev/fuse"):
        print("soak: needs /dev/fuse and fusermount3", file=sys.stderr)
        return 2
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
