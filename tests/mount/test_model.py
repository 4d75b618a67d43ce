"""A randomized concurrency model test on a real mount under constant eviction pressure.

The contract (``docs/engines.md``): an engine reading a chunk gets its exact bytes, or a
clean miss (ENOENT) -- never zeros, a short file or another file's data. kvfs may evict
closed files of kvfs-managed directories whenever the pool is full, so an open of a
closed file may miss; but the rename of a tmp file its writer has just closed must
succeed (kvfs must not evict a file between its close and its first use), and no
operation may hit a name the workload never used (EEXIST on a fresh O_EXCL name).

Seven threads of this process and two writer subprocesses (each replaced by a new
process half-way, so the first one's files become orphans) run a seeded random mix for
``KVFS_MODEL_SECONDS`` (default 35 s) on a 136 MiB pool, writing many times its size:

- vLLM-style stores (``name_<rand>.tmp``, O_CREAT|O_EXCL, maybe O_DIRECT, close,
  ``os.replace`` over a possibly existing name), SGLang-style stores (one tmp name per
  thread and directory, reused with O_CREAT|O_TRUNC, then ``os.replace``), creates of
  new files (one write, many writes, out-of-order pwrites, O_DIRECT), in-place O_TRUNC
  rewrites (under a per-name lock, readers take it too), unlinks and mkdirs;
- ``os.listdir`` and ``os.scandir`` with ``entry.stat()`` (slow iterations that read
  files in the middle), opens with full reads (buffered, unbuffered, one readinto,
  O_DIRECT, preads at random offsets) and stats.

Every file is self-verifying: a 128-byte header (magic, the hash and text of the final
name it was written for, a version, the total length) and a body derived from (name,
version), so a read is right iff it is the complete content of SOME version of THAT
name. Files under 128 bytes (``tiny<size>-...``) are created once, with content derived
from their name. At the end the workload quiesces, every file in the tree is read back,
the pool is remounted cleanly and every file is read back again (none lost, none new).

Seed: ``KVFS_MODEL_SEED`` (printed; the interleaving still depends on timing).
``KVFS_MODEL_SKIP=list,stat`` leaves operations out of the mix (to tell causes apart).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import mmap
import os
import random
import stat
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfs.testing.harness import make_image
from tests.conftest import KvfsMount, _expected, _finish, require_fuse

MiB = 1 << 20
POOL_SIZE = 136 * MiB
DEFAULT_SEED = 20261201
"""The workload's seed unless KVFS_MODEL_SEED names another (thread interleavings differ
from run to run anyway; a failure prints the seed that reproduces its workload)."""
SECONDS = float(os.environ.get("KVFS_MODEL_SECONDS", "35"))
THREADS = 7
READER_THREADS = 2  # of THREADS: listing- and read-heavy
WRITER_PROCS = 2
TOPS = ("vllm", "sglang", "misc", "rw")
FINALS = 24  # final names per vllm/sglang directory (stores replace them often)
RW_NAMES = 6  # names rewritten in place with O_TRUNC (under a lock)
MAX_SUBDIRS = 4
SKIP = set(filter(None, os.environ.get("KVFS_MODEL_SKIP", "").split(",")))
"""Operations left out of the mix (diagnosis: e.g. ``list`` to see what readdir causes)."""

MAGIC = b"KVMODEL1"
HEADER = struct.Struct("<8sQQ16s88s")  # magic, version, total length, name hash, name
HDR = HEADER.size
PERIOD = 65521  # body period: prime, so a misplaced 4 KiB page or 1 MiB unit shows
assert HDR == 128

# ============================================================================ content


def name_hash(rel: str) -> bytes:
    return hashlib.blake2b(rel.encode(), digest_size=16).digest()


def _block(rel: str, version: int) -> bytes:
    return hashlib.shake_128(f"{rel}|{version}".encode()).digest(PERIOD)


def body(rel: str, version: int, n: int) -> bytes:
    block = _block(rel, version)
    return (block * (n // PERIOD + 1))[:n]


def content(rel: str, version: int, size: int) -> bytes:
    """The complete bytes of version ``version`` of the file named ``rel``."""
    assert size >= HDR
    head = HEADER.pack(MAGIC, version, size, name_hash(rel), rel.encode()[:88])
    return head + body(rel, version, size - HDR)


def is_tiny(rel: str) -> bool:
    return rel.rsplit("/", 1)[-1].startswith("tiny")


def tiny_name(d: str, size: int, tag: str) -> str:
    return f"{d}/tiny{size}-{tag}"


def tiny_content(rel: str) -> bytes:
    size = int(rel.rsplit("/", 1)[-1][4:].split("-", 1)[0])
    return hashlib.shake_128(rel.encode()).digest(size)


def _what(data: bytes | memoryview) -> str:
    if not any(data):
        return "all zeros"
    return "non-zero bytes"


def first_difference(got: bytes, want: bytes, base: int = 0) -> str:
    n = min(len(got), len(want))
    step = 1 << 16
    for off in range(0, n, step):
        end = min(off + step, n)
        if got[off:end] != want[off:end]:
            i = next(i for i in range(off, end) if got[i] != want[i])
            j = i
            while j < n and got[j] != want[j] and j - i < 4 * MiB:
                j += 1
            return (
                f"bytes differ from offset {base + i} ({j - i}+ bytes, "
                f"{_what(got[i : i + 4096])} there)"
            )
    if len(got) != len(want):
        return f"{len(got)} bytes instead of {len(want)} (the first {n} are right)"
    return "no difference"


def problem(rel: str, data: bytes) -> str | None:
    """None if ``data`` is the complete content of some version of ``rel``."""
    if is_tiny(rel):
        want = tiny_content(rel)
        if data == want:
            return None
        if not data:
            return f"empty ({len(want)} bytes written)"
        return f"tiny file: {len(data)} bytes ({_what(data)}), {first_difference(data, want)}"
    if not data:
        return "empty file (0 bytes)"
    if len(data) < HDR:
        return f"only {len(data)} bytes ({_what(data)}): no complete header"
    magic, version, length, h, raw = HEADER.unpack_from(data)
    if magic != MAGIC:
        return f"{len(data)} bytes without a header ({_what(data[:HDR])} where it should be)"
    if h != name_hash(rel):
        other = raw.rstrip(b"\0").decode(errors="replace")
        return f"holds the content of ANOTHER file: {other} v{version} ({length} bytes)"
    if length != len(data):
        kind = "SHORT" if len(data) < length else "LONG"
        tail = _what(data[-4096:])
        return f"{kind}: {len(data)} bytes read of v{version}'s {length} (the tail is {tail})"
    want = body(rel, version, length - HDR)
    if data[HDR:] != want:
        return f"v{version}: " + first_difference(data[HDR:], want, HDR)
    return None


def header_of(data: bytes) -> tuple[int, int] | None:
    """(version, length) from a header, None if there is none."""
    if len(data) < HDR:
        return None
    magic, version, length, _, _ = HEADER.unpack_from(data)
    return (version, length) if magic == MAGIC else None


def pread_all(fd: int) -> bytes:
    out = bytearray()
    while chunk := os.pread(fd, 4 * MiB, len(out)):
        out += chunk
    return bytes(out)


def aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, max(-(-size // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE))


def pick_size(rng: random.Random, direct: bool = False) -> int:
    r = rng.random()
    if r < 0.12:
        size = rng.choice([HDR, HDR + 1, 4096, 4097, 65536, 200_001])
    elif r < 0.25:
        size = rng.choice([1_237_720, MiB - 1, MiB, MiB + 1, 2 * MiB])
    elif r < 0.85:
        size = rng.randrange(HDR, 2 * MiB)
    else:
        size = rng.randrange(2 * MiB, 6 * MiB)
    if direct:
        size = max(4096, size // 4096 * 4096)
    return size


def write_all(fd: int, data: bytes, rng: random.Random, style: str) -> None:
    """Write ``data`` from offset 0 of ``fd`` in one of several engine styles."""
    view = memoryview(data)
    if style == "one":
        while view:
            view = view[os.write(fd, view) :]
    elif style == "chunks":
        while view:
            n = rng.choice([1500, 4096, 65536, 300_000, MiB])
            view = view[os.write(fd, view[:n]) :]
    elif style == "pwrite":  # second half first: the file grows sparse, then fills in
        half = len(data) // 2 // 4096 * 4096
        for off, part in ((half, view[half:]), (0, view[:half])):
            done = 0
            while done < len(part):
                done += os.pwrite(fd, part[done:], off + done)
    else:  # "direct": O_DIRECT from an aligned buffer, whole or in 1 MiB pieces
        buf = aligned(len(data))
        try:
            buf[: len(data)] = data
            mv = memoryview(buf)
            step = len(data) if rng.random() < 0.5 else MiB
            off = 0
            while off < len(data):
                off += os.pwrite(fd, mv[off : min(off + step, len(data))], off)
            mv.release()
        finally:
            buf.close()


# ============================================================================ the workload


class Shared:
    """State all threads of this process share (mutated under ``lock``)."""

    def __init__(self, root: Path, deadline: float, seed: int) -> None:
        self.root, self.deadline, self.seed = root, deadline, seed
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.versions = itertools.count(1)
        self.failures: list[tuple[str, str]] = []
        self.first: dict[str, float] = {}  # failure kind -> seconds into the run
        self.subdirs: dict[str, list[str]] = {top: [top, f"{top}/d0"] for top in TOPS}
        self.extra_dirs: list[str] = []  # the writer subprocesses' directories
        self.writing: set[str] = set()  # names being created in place right now
        self.recent: deque[str] = deque(maxlen=300)
        self.rw_locks = {f"rw/r{k}": threading.Lock() for k in range(RW_NAMES)}
        self.inos: dict[int, str] = {}  # inode number -> what was written into it
        self.ino_names: dict[int, str] = {}  # inode number -> the name it was written for

    def fail(self, kind: str, msg: str) -> None:
        with self.lock:
            t = time.monotonic() - self.t0
            self.first.setdefault(kind, t)
            self.failures.append((kind, f"{t:6.1f}s {msg}"))

    def version(self) -> int:
        with self.lock:
            return next(self.versions)

    def dirs(self) -> list[str]:
        with self.lock:
            return [d for top in TOPS for d in self.subdirs[top]] + self.extra_dirs


class Worker:
    def __init__(self, sh: Shared, tid: int) -> None:
        self.sh, self.tid = sh, tid
        self.rng = random.Random(sh.seed * 1000 + tid)
        self.n = Counter[str]()
        self.serial = 0
        reader = tid < READER_THREADS
        ops: list[tuple[str, int]] = [
            ("vllm", 5 if reader else 18),
            ("sglang", 10 if reader else 20),
            ("create", 5 if reader else 10),
            ("rewrite", 1 if reader else 4),
            ("unlink", 2 if reader else 4),
            ("mkdir", 0 if reader else 1),
            ("list", 30 if reader else 8),
            ("read", 40 if reader else 18),
            ("stat", 10 if reader else 5),
        ]
        self.ops = [(o, 0 if o in SKIP else w) for o, w in ops]

    def p(self, rel: str) -> str:
        return os.path.join(self.sh.root, rel)

    def fail(self, kind: str, msg: str) -> None:
        self.n[f"FAIL.{kind}"] += 1
        self.sh.fail(kind, f"t{self.tid}: {msg}")

    def run(self) -> None:
        names = [o for o, _ in self.ops]
        weights = [w for _, w in self.ops]
        while time.monotonic() < self.sh.deadline:
            op = self.rng.choices(names, weights)[0]
            self.n[op] += 1
            try:
                getattr(self, f"op_{op}")()
            except Exception as e:  # a failed syscall nobody expected: record, go on
                self.fail("unexpected-error", f"{op}: {e!r}")

    # ------------------------------------------------------------------ helpers
    def subdir(self, top: str) -> str:
        with self.sh.lock:
            return self.rng.choice(self.sh.subdirs[top])

    def final(self, top: str, d: str | None = None) -> str:
        d = d or self.subdir(top)
        return f"{d}/{'blk' if top == 'vllm' else 'page'}{self.rng.randrange(FINALS):02d}"

    def note_written(self, fd: int, name: str, what: str) -> None:
        ino = os.fstat(fd).st_ino
        with self.sh.lock:
            self.sh.inos[ino] = what
            self.sh.ino_names[ino] = name

    def check_fresh(self, fd: int, rel: str, how: str) -> str | None:
        """``rel`` must not exist: the open must have made a new inode, not opened one
        written before (a stale dentry in the kernel, e.g. planted by readdirplus).
        Returns the name of the file opened instead, if any. kvfs reuses the number
        of an inode the kernel has forgotten (an evicted file's), so a known number
        is a stale open only if the file written before still has it."""
        st = os.fstat(fd)
        with self.sh.lock:
            before = self.sh.inos.get(st.st_ino)
            victim = self.sh.ino_names.get(st.st_ino)
        if before is not None and victim is not None and victim != rel:
            try:
                if os.stat(self.p(victim)).st_ino != st.st_ino:
                    before = victim = None  # that file is gone: its number was reused
            except FileNotFoundError:
                before = victim = None
        if before is not None:
            self.fail(
                "stale-dentry",
                f"open({rel}, {how}) opened inode {st.st_ino}, which holds {before}: this "
                "write overwrites that file",
            )
        return victim

    def store(self, label: str, tmp: str, final: str, flags: int, how: str) -> None:
        """Write a new version of ``final`` into ``tmp``, close it, rename it over ``final``."""
        direct = self.rng.random() < 0.25
        size = pick_size(self.rng, direct)
        version = self.sh.version()
        data = content(final, version, size)
        try:
            fd = os.open(self.p(tmp), flags | (os.O_DIRECT if direct else 0), 0o644)
        except FileExistsError:
            self.fail("stale-dentry", f"open({tmp}, {how}): EEXIST for a name never used")
            return
        except FileNotFoundError:
            self.fail("create-enoent", f"open({tmp}, {how}): ENOENT in an existing directory")
            return
        stale = None
        try:
            if not flags & os.O_EXCL:
                stale = self.check_fresh(fd, tmp, how)
            write_all(
                fd, data, self.rng, "direct" if direct else self.rng.choice(["one", "chunks"])
            )
            self.note_written(fd, final, f"{final} v{version} (written as {tmp})")
        except OSError as e:
            with contextlib.suppress(OSError):
                os.close(fd)
            self.fail("write-error", f"write of {tmp} ({size} bytes): {e!r}")
            with contextlib.suppress(OSError):
                os.unlink(self.p(tmp))
            return
        try:
            os.close(fd)
        except OSError as e:  # close commits: ENOSPC/EIO would show here
            self.fail("write-error", f"close of {tmp} ({size} bytes): {e!r}")
            with contextlib.suppress(OSError):
                os.unlink(self.p(tmp))
            return
        if stale is not None:  # what an engine reading that file gets now
            self.read(stale, "victim-read")
        try:
            os.replace(self.p(tmp), self.p(final))
        except FileNotFoundError:
            if stale is not None:  # the open went to another file: kvfs never had this tmp name
                self.fail(
                    "rename-enoent-after-stale-open",
                    f"rename({tmp} -> {final}): ENOENT (its open hit a stale dentry)",
                )
            else:
                self.fail(
                    "rename-enoent",
                    f"rename({tmp} -> {final}) of a file just closed: ENOENT; "
                    + self.diagnose(tmp),
                )
            return
        self.n[f"{label}.renamed"] += 1
        with self.sh.lock:
            self.sh.recent.append(final)

    def diagnose(self, tmp: str) -> str:
        try:
            st = os.stat(self.p(tmp))
        except OSError as e:
            return (
                f"stat({tmp}) now gives {errno.errorcode.get(e.errno or 0, e.errno)} "
                "(nothing else removes it: kvfs evicted it between its close and its first use)"
            )
        with self.sh.lock:
            before = self.sh.inos.get(st.st_ino)
        return (
            f"stat({tmp}) still finds inode {st.st_ino} ({st.st_size} bytes, holds "
            f"{before}): the kernel holds a stale dentry kvfs does not know"
        )

    # ------------------------------------------------------------------ writers
    def op_vllm(self) -> None:
        final = self.final("vllm")
        tmp = f"{final}_{self.rng.getrandbits(40):010x}.tmp"
        self.store("vllm", tmp, final, os.O_CREAT | os.O_EXCL | os.O_WRONLY, "O_CREAT|O_EXCL")

    def op_sglang(self) -> None:
        d = self.subdir("sglang")
        self.store(
            "sglang",
            f"{d}/t{self.tid}.tmp",
            self.final("sglang", d),
            os.O_CREAT | os.O_TRUNC | os.O_WRONLY,
            "O_CREAT|O_TRUNC",
        )

    def op_create(self) -> None:
        d = self.subdir("misc")
        self.serial += 1
        tag = f"t{self.tid}-{self.serial}"
        if self.rng.random() < 0.15:
            rel = tiny_name(d, self.rng.choice([1, 7, 64, 127]), tag)
            data, style = tiny_content(rel), "one"
        else:
            rel = f"{d}/f{tag}"
            style = self.rng.choice(["one", "one", "chunks", "pwrite", "direct"])
            version = self.sh.version()
            data = content(rel, version, pick_size(self.rng, style == "direct"))
        excl = self.rng.random() < 0.5
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if excl else os.O_TRUNC)
        flags |= os.O_DIRECT if style == "direct" else 0
        how = "O_CREAT|O_EXCL" if excl else "O_CREAT|O_TRUNC"
        with self.sh.lock:
            self.sh.writing.add(rel)
        try:
            try:
                fd = os.open(self.p(rel), flags, 0o644)
            except FileExistsError:
                self.fail("stale-dentry", f"open({rel}, {how}): EEXIST for a name never used")
                return
            try:
                if not excl:
                    self.check_fresh(fd, rel, how)
                write_all(fd, data, self.rng, style)
                self.note_written(fd, rel, f"{rel} ({style})")
            finally:
                os.close(fd)
        finally:
            with self.sh.lock:
                self.sh.writing.discard(rel)
                self.sh.recent.append(rel)
        if self.rng.random() < 0.3:  # read it back at once (eviction may have taken it)
            self.read(rel, "readback")

    def op_rewrite(self) -> None:
        rel = f"rw/r{self.rng.randrange(RW_NAMES)}"
        version = self.sh.version()
        data = content(rel, version, pick_size(self.rng))
        with self.sh.rw_locks[rel]:
            fd = os.open(self.p(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_all(fd, data, self.rng, self.rng.choice(["one", "chunks"]))
                self.note_written(fd, rel, f"{rel} v{version} (in place)")
            finally:
                os.close(fd)
            if self.rng.random() < 0.3:
                self.read(rel, "readback", locked=True)

    def op_unlink(self) -> None:
        rel = self.pick_name()
        if rel is None:
            return
        lock = self.sh.rw_locks.get(rel)
        with lock if lock is not None else contextlib.nullcontext():
            try:
                os.unlink(self.p(rel))
                self.n["unlink.ok"] += 1
            except FileNotFoundError:
                self.n["unlink.enoent"] += 1

    def op_mkdir(self) -> None:
        top = self.rng.choice(TOPS[:3])
        with self.sh.lock:
            n = len(self.sh.subdirs[top]) - 1
        if n >= MAX_SUBDIRS:
            return
        rel = f"{top}/d{n}"
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.p(rel))
            self.n["mkdir.ok"] += 1
        with self.sh.lock:
            if rel not in self.sh.subdirs[top]:
                self.sh.subdirs[top].append(rel)

    # ------------------------------------------------------------------ readers
    def pick_name(self) -> str | None:
        r = self.rng.random()
        with self.sh.lock:
            recent = list(self.sh.recent)
        if r < 0.45 and recent:
            rel = self.rng.choice(recent)
        elif r < 0.85:
            rel = self.final(self.rng.choice(["vllm", "sglang"]))
        else:
            rel = f"rw/r{self.rng.randrange(RW_NAMES)}"
        with self.sh.lock:
            if rel in self.sh.writing:
                return None
        return rel

    def op_read(self) -> None:
        rel = self.pick_name()
        if rel is not None:
            self.read(rel, "read")

    def readable(self, rel: str) -> bool:
        if rel.endswith(".tmp"):
            return False
        with self.sh.lock:
            return rel not in self.sh.writing

    def read(self, rel: str, label: str, locked: bool = False) -> None:
        if not self.readable(rel):
            return
        lock = None if locked else self.sh.rw_locks.get(rel)
        with lock if lock is not None else contextlib.nullcontext():
            mode = self.rng.choice(["buffered", "unbuffered", "readinto", "pread", "direct"])
            try:
                fd = os.open(self.p(rel), os.O_RDONLY | (os.O_DIRECT if mode == "direct" else 0))
            except FileNotFoundError:
                self.n[f"{label}.enoent"] += 1
                return
            ino = -1
            try:
                ino = os.fstat(fd).st_ino
                if mode == "pread":
                    bad = self.pread_check(fd, rel)
                else:
                    bad = problem(rel, self.read_fd(fd, mode))
            except OSError as e:
                bad = f"read failed: {e!r}"
            finally:
                os.close(fd)
        if bad is None:
            self.n[f"{label}.ok"] += 1
            return
        with self.sh.lock:
            written = self.sh.inos.get(ino, "not written by this process")
        bad += self.second_look(rel, ino)
        self.fail(f"bad-{label}", f"{mode} {label} of {rel} (inode {ino}: {written}): {bad}")

    def second_look(self, rel: str, ino: int) -> str:
        """Where the wrong bytes live: O_DIRECT reads come from kvfs itself (no page
        cache), a buffered read after dropping the file's cached pages does too."""
        parts = []
        for how, flags in (("O_DIRECT", os.O_DIRECT), ("after fadvise DONTNEED", 0)):
            try:
                fd = os.open(self.p(rel), os.O_RDONLY | flags)
            except OSError as e:
                parts.append(f"{how}: open {e.strerror}")
                continue
            try:
                if os.fstat(fd).st_ino != ino:
                    parts.append(f"{how}: the name now holds another inode")
                    continue
                if not flags:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                buf = aligned(os.fstat(fd).st_size + 4096)
                try:
                    n = os.preadv(fd, [buf], 0)
                    again = problem(rel, bytes(buf[:n]))
                finally:
                    buf.close()
                parts.append(f"{how}: {again or 'right'}")
            except OSError as e:
                parts.append(f"{how}: {e!r}")
            finally:
                os.close(fd)
        return " [second look: " + "; ".join(parts) + "]"

    def read_fd(self, fd: int, mode: str) -> bytes:
        if mode == "buffered":
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read()
        if mode == "unbuffered":
            out = bytearray()
            while chunk := os.read(fd, self.rng.choice([4096, 131072, MiB, 4 * MiB])):
                out += chunk
            return bytes(out)
        size = os.fstat(fd).st_size
        if mode == "readinto":  # LMCache: ONE readinto of fstat's size must fill it
            buf = bytearray(size)
            n = os.readv(fd, [buf])
            return bytes(buf[:n])
        buf2 = aligned(size + 4096)  # O_DIRECT
        try:
            n = os.preadv(fd, [buf2], 0)
            return bytes(buf2[:n])
        finally:
            buf2.close()

    def pread_check(self, fd: int, rel: str) -> str | None:
        """The header, then three preads at random offsets, against that version."""
        head = os.pread(fd, HDR, 0)
        hv = None if is_tiny(rel) else header_of(head)
        if hv is None or HEADER.unpack_from(head)[3] != name_hash(rel):
            return problem(rel, pread_all(fd))
        version, length = hv
        size = os.fstat(fd).st_size
        if size != length:
            return f"fstat size {size}, the header of v{version} says {length}"
        want = content(rel, version, length)
        for _ in range(3):
            off = self.rng.randrange(length)
            n = self.rng.randrange(1, min(2 * MiB, length - off) + 1)
            got = os.pread(fd, n, off)
            if got != want[off : off + n]:
                return f"pread({n}, {off}) of v{version}: " + first_difference(
                    got, want[off : off + n], off
                )
        if os.pread(fd, 10, length) != b"":
            return f"bytes past v{version}'s end ({length})"
        return None

    def op_stat(self) -> None:
        rel = self.pick_name()
        if rel is None:
            return
        lock = self.sh.rw_locks.get(rel)
        with lock if lock is not None else contextlib.nullcontext():
            try:
                st = os.stat(self.p(rel))
            except FileNotFoundError:
                self.n["stat.enoent"] += 1
                return
        self.check_stat(rel, st, "stat")

    def check_stat(self, rel: str, st: os.stat_result, how: str) -> None:
        if not stat.S_ISREG(st.st_mode):
            self.fail("bad-stat", f"{how} of {rel}: not a regular file ({st.st_mode:o})")
        elif st.st_size == 0:
            with self.sh.lock:
                written = self.sh.inos.get(st.st_ino, "not written by this process")
            self.fail("bad-stat", f"{how} of {rel}: size 0 (inode {st.st_ino}: {written})")
        else:
            self.n[f"{how}.ok"] += 1

    def op_list(self) -> None:
        # half of the listings where tmp names come and go fastest: readdir races renames
        sglang = self.rng.random() < 0.5
        d = self.subdir("sglang") if sglang else self.rng.choice(self.sh.dirs())
        if self.rng.random() < 0.35:
            names = os.listdir(self.p(d))
            self.n["listdir.entries"] += len(names)
            if len(set(names)) != len(names):
                dup = sorted(k for k, v in Counter(names).items() if v > 1)
                self.fail("bad-listing", f"listdir({d}) lists {dup} twice")
            files = [f"{d}/{x}" for x in names if not x.endswith(".tmp") and x[:1] != "d"]
            for rel in self.rng.sample(files, min(len(files), 3)):
                self.read(rel, "listed-read")
            return
        slow = self.rng.random() < 0.5
        seen: set[str] = set()
        with os.scandir(self.p(d)) as it:
            for entry in it:
                if entry.name in seen:
                    self.fail("bad-listing", f"scandir({d}) yields {entry.name} twice")
                seen.add(entry.name)
                if entry.is_dir(follow_symlinks=False):
                    continue
                rel = f"{d}/{entry.name}"
                self.n["scandir.entries"] += 1
                if not self.readable(rel):
                    continue
                lock = self.sh.rw_locks.get(rel)
                try:
                    with lock if lock is not None else contextlib.nullcontext():
                        st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    self.n["scandir.stat.enoent"] += 1
                    continue
                if self.readable(rel):
                    self.check_stat(rel, st, "scandir.stat")
                if slow and self.rng.random() < 0.15:
                    self.read(rel, "scandir-read")
                elif slow:
                    time.sleep(0.001)


# ============================================================================ subprocesses

WRITER_FINALS = 30


def writer_main(mnt: str, top: str, seed: int, seconds: float) -> None:
    """A writer process: vLLM-style stores only (its files are complete whenever they
    carry their final names); prints its counts and failures as JSON."""
    rng = random.Random(seed)
    n = Counter[str]()
    failures: list[str] = []
    deadline = time.monotonic() + seconds
    serial = 0
    os.makedirs(os.path.join(mnt, top), exist_ok=True)
    while time.monotonic() < deadline:
        serial += 1
        if rng.random() < 0.7:
            final = f"{top}/blk{rng.randrange(WRITER_FINALS):02d}"
        else:
            final = f"{top}/u{os.getpid()}-{serial}"
        tmp = f"{final}_{rng.getrandbits(40):010x}.tmp"
        direct = rng.random() < 0.3
        version = (os.getpid() << 32) | serial
        data = content(final, version, pick_size(rng, direct))
        try:
            fd = os.open(
                os.path.join(mnt, tmp),
                os.O_CREAT | os.O_EXCL | os.O_WRONLY | (os.O_DIRECT if direct else 0),
                0o644,
            )
        except OSError as e:
            failures.append(f"[create-error] open({tmp}): {e!r}")
            continue
        n["proc.store"] += 1
        try:
            try:
                write_all(fd, data, rng, "direct" if direct else rng.choice(["one", "chunks"]))
            finally:
                os.close(fd)
        except OSError as e:
            failures.append(f"[write-error] pid {os.getpid()}: write of {tmp}: {e!r}")
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(mnt, tmp))
            continue
        try:
            os.replace(os.path.join(mnt, tmp), os.path.join(mnt, final))
            n["proc.store.renamed"] += 1
        except FileNotFoundError:
            failures.append(
                f"[rename-enoent] pid {os.getpid()}: rename({tmp} -> {final}) "
                "of a file just closed: ENOENT"
            )
        if rng.random() < 0.2:
            try:
                with open(os.path.join(mnt, final), "rb") as f:
                    got = f.read()
            except FileNotFoundError:
                n["proc.readback.enoent"] += 1
                continue
            bad = problem(final, got)
            if bad:
                failures.append(f"[bad-readback] pid {os.getpid()}: {final}: {bad}")
            else:
                n["proc.readback.ok"] += 1
    print(json.dumps({"counts": n, "failures": failures}))


def start_writer(mnt: Path, top: str, seed: int, seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(  # as a module from the repository root: it imports tests.conftest
        [sys.executable, "-m", __name__, "writer", str(mnt), top, str(seed), str(seconds)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_writers(mnt: Path, seed: int, seconds: float, sh: Shared, out: Counter[str]) -> None:
    """WRITER_PROCS slots, each runs two writer processes one after the other."""
    rng = random.Random(seed)
    for gen in range(2):
        procs = [
            start_writer(mnt, f"proc{k}", rng.randrange(1 << 30), seconds / 2)
            for k in range(WRITER_PROCS)
        ]
        for p in procs:
            stdout, stderr = p.communicate(timeout=seconds + 60)
            if p.returncode != 0:
                sh.fail("writer-process", f"gen {gen}: exit {p.returncode}: {stderr[-2000:]}")
                continue
            try:
                report: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                sh.fail("writer-process", f"gen {gen}: no report: {stdout[-500:]!r}")
                continue
            out.update(report["counts"])
            for f in report["failures"]:
                kind, _, msg = f[1:].partition("] ")
                sh.fail(kind, f"writer process: {msg}")


# ============================================================================ the test


@pytest.fixture
def pool_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KvfsMount]:
    """A 136 MiB pool (about 120 data units of 1 MiB): it evicts all the time."""
    require_fuse()
    image = make_image(tmp_path / "pool.img", POOL_SIZE)
    mount = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
    try:
        mount.start("--format", "--meta-size", "8M")
        yield mount
    finally:
        _finish(mount)


def verify_tree(sh: Shared, label: str, n: Counter[str]) -> set[str]:
    """Read every file in the tree; each must be a complete version of its name."""
    present = set()
    for dirpath, _, filenames in os.walk(sh.root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, sh.root)
            if name.endswith(".tmp"):
                sh.fail(f"{label}-leftover-tmp", f"{rel}: a tmp file the workload renamed")
            try:
                with open(path, "rb") as f:
                    data = f.read()
                    ino = os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                n[f"{label}.enoent"] += 1
                continue
            present.add(rel)
            if name.endswith(".tmp"):
                continue
            bad = problem(rel, data)
            if bad is None:
                n[f"{label}.ok"] += 1
            else:
                written = sh.inos.get(ino, "not written by this process")
                sh.fail(f"bad-{label}", f"{rel} (inode {ino}: {written}): {bad}")
    return present


def settle(mount: KvfsMount, timeout: float = 15.0) -> dict[str, Any]:
    """Wait until nothing is dirty or open and eviction has stopped for a second."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while True:
        s: dict[str, Any] = mount.stats()["store"]
        if s["evictions"] != last or s["dirty_bytes"] or s["open_handles"]:
            last, since = s["evictions"], time.monotonic()
        elif time.monotonic() - since > 1.0 or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def test_concurrent_engines_under_eviction_read_exact_bytes_or_clean_misses(
    pool_mount: KvfsMount,
) -> None:
    seed = int(os.environ.get("KVFS_MODEL_SEED") or DEFAULT_SEED)
    print(f"\nmodel test: seed {seed}, {SECONDS:g} s (rerun: KVFS_MODEL_SEED={seed})")
    started = time.monotonic()
    root = pool_mount.path
    sh = Shared(root, started + SECONDS, seed)
    for top in TOPS:
        os.mkdir(root / top)
        os.mkdir(root / top / "d0")
    sh.extra_dirs = [f"proc{k}" for k in range(WRITER_PROCS)]
    for d in sh.extra_dirs:
        os.mkdir(root / d)

    proc_counts = Counter[str]()
    writers = threading.Thread(target=run_writers, args=(root, seed, SECONDS, sh, proc_counts))
    workers = [Worker(sh, t) for t in range(THREADS)]
    threads = [threading.Thread(target=w.run, name=f"model-{w.tid}") for w in workers]
    writers.start()
    for t in threads:
        t.start()
    # the load runs SECONDS, longer while the pool has not yet been under enough
    # pressure (a loaded machine writes less per second): the workload is measured by
    # what it did, never by the clock; 240 s more is only a hang guard
    while any(t.is_alive() for t in threads):
        if sh.deadline - time.monotonic() < 1 and sh.deadline < started + SECONDS + 240:
            s = pool_mount.stats()["store"]
            if not (s["evictions"] > 0 and s["bytes_written"] > 2 * s["capacity_bytes"]):
                sh.deadline += 5
        time.sleep(0.2)
    for t in threads:
        t.join()
    writers.join()
    worked = time.monotonic() - started

    n = Counter[str]()
    for w in workers:
        n.update(w.n)
    n.update(proc_counts)
    s = settle(pool_mount)
    before = verify_tree(sh, "final", n)
    evictions = pool_mount.stats()["store"]["evictions"]
    pool_mount.remount()
    after = verify_tree(sh, "remounted", n)
    # A file closed less than evict.FRESH_GRACE before the end may keep the pool above
    # its high watermark (the background evictor passes over fresh files); the new
    # daemon has no such grace and may then evict orphans at once, legitimately.
    evicted_since = pool_mount.stats()["store"]["evictions"]
    if evictions == s["evictions"] and not evicted_since:  # a clean remount, nothing evicted
        for rel in sorted(before - after)[:20]:
            sh.fail("lost-over-remount", f"{rel} was there before the clean remount")
        for rel in sorted(after - before)[:20]:
            sh.fail("new-over-remount", f"{rel} appeared over the clean remount")

    kinds = Counter(k for k, _ in sh.failures)
    ops = {k: v for k, v in sorted(n.items()) if not k.startswith("FAIL.")}
    print(f"model test: {worked:.1f} s of load, {time.monotonic() - started:.1f} s in all")
    print(
        f"  pool {s['capacity_bytes'] >> 20} MiB: {s['bytes_written'] >> 20} MiB written "
        f"({s['bytes_written'] / s['capacity_bytes']:.1f}x), {s['evictions']} evictions "
        f"({s['orphan_evictions']} orphans), {s['bytes_read'] >> 20} MiB read; "
        f"{len(before)} files at the end"
    )
    print("  operations and outcomes: " + ", ".join(f"{k} {v}" for k, v in ops.items()))
    firsts = [f"{k} {v} (first at {sh.first[k]:.1f} s)" for k, v in kinds.most_common()]
    print("  failures: " + (", ".join(firsts) or "none"))
    shown: Counter[str] = Counter()
    lines = []
    for kind, msg in sh.failures:
        shown[kind] += 1
        if shown[kind] <= 4:
            lines.append(f"[{kind}] {msg}")
    for line in lines:
        print("   ", line)
    assert s["evictions"] > 0 and s["bytes_written"] > 2 * s["capacity_bytes"], (
        f"not enough eviction pressure to test anything: {s}"
    )
    if sh.failures:
        summary = ", ".join(f"{k} x{v}" for k, v in kinds.most_common())
        pytest.fail(
            f"seed {seed}: {len(sh.failures)} violations ({summary}):\n  " + "\n  ".join(lines),
            pytrace=False,
        )


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "writer":
    writer_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
