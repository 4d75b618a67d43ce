"""Wrong bytes on a real mount, round 2: a reader beside an ``O_TRUNC`` rewrite.

LMCache's ``local_disk`` opens a chunk with ``O_TRUNC`` when it stores a key again, and
two engines on one node share a directory, so one process may read a chunk while
another truncates it and writes new content. The reader may get the old bytes, the new
bytes, or fewer bytes (EOF moved) -- never the old length with ranges of zeros, which
the file never held (a fetch that waited for another fetch of a unit that a truncate
removed meanwhile once served the zero unit, the reply length taken from the old size).
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import KvfsMount, aligned, pattern

MiB = 1 << 20
SIZES = (32 * MiB, 8 * MiB, 32 * MiB, 8 * MiB)
"""The contents a writer cycles through: a 32 MiB chunk, rewritten as 8 MiB, ..."""
CONTENTS = [pattern(("trunc-rewrite", i), size) for i, size in enumerate(SIZES)]
REWRITES = 24


PAGE = 4096


def verdict(got: bytes, whole: bool) -> str | None:
    """None if ``got`` is what a reader may get, else what it is. An O_DIRECT read
    (``whole``) must be a prefix of ONE content the file held. A buffered read is
    served by the kernel's page cache, which kvfs does not see: as on ext4 it may
    join the old content's first pages to the new content's next ones when the
    reader is slow across a truncate and a rewrite, so each page must be the bytes
    some content held at that offset (never zeros or foreign bytes)."""
    fits = [c for c in CONTENTS if len(got) <= len(c)]
    if any(got == c[: len(got)] for c in fits):
        return None
    if not whole and all(
        any(got[i : i + PAGE] == c[i : i + PAGE] for c in fits) for i in range(0, len(got), PAGE)
    ):
        return None
    pieces = []
    for i in range(0, len(got), MiB):
        piece = got[i : i + MiB]
        owner = [k for k, c in enumerate(CONTENTS) if c[i : i + len(piece)] == piece]
        pieces.append(str(owner[0]) if owner else "z" if not piece.strip(b"\0") else "?")
    return f"{len(got)} bytes matching no content the file held (MiB pieces: {''.join(pieces)})"


def read_whole(path: Path, direct: bool) -> bytes | int:
    """One read of the whole file as LMCache does it (O_DIRECT into an aligned buffer,
    or a buffered read), or the errno."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError as e:
        return e.errno or -1
    try:
        if not direct:
            return os.read(fd, max(SIZES) + MiB)
        buf = aligned(max(SIZES) + MiB)
        try:
            return bytes(buf[: os.preadv(fd, [buf], 0)])
        finally:
            buf.close()
    except OSError as e:
        return e.errno or -1
    finally:
        os.close(fd)


@pytest.mark.mount_options("--cache", "4M")
def test_reader_beside_an_o_trunc_rewrite_never_gets_zeros(kvfs_mount: KvfsMount) -> None:
    path = kvfs_mount.path / "chunk.pt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, CONTENTS[0])
    os.close(fd)
    stop = threading.Event()
    bad: list[str] = []
    reads = {"direct": 0, "buffered": 0, "errors": 0}

    def reader(direct: bool) -> None:
        while not stop.is_set():
            got = read_whole(path, direct)
            if isinstance(got, int):
                if got not in (errno.ENOENT, errno.EIO):
                    bad.append(f"{'O_DIRECT' if direct else 'buffered'} read: errno {got}")
                reads["errors"] += 1
                continue
            reads["direct" if direct else "buffered"] += 1
            why = verdict(got, whole=direct)
            if why is not None:
                bad.append(f"{'O_DIRECT' if direct else 'buffered'} read: {why}")

    threads = [threading.Thread(target=reader, args=(d,)) for d in (True, True, False)]
    for t in threads:
        t.start()
    try:
        for i in range(1, REWRITES + 1):
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, CONTENTS[i % len(CONTENTS)])
            finally:
                os.close(fd)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert reads["direct"] and reads["buffered"], reads
    assert not bad, f"{len(bad)} wrong reads of {sum(reads.values())}: {bad[:5]}"
    final = CONTENTS[REWRITES % len(CONTENTS)]
    assert read_whole(path, direct=True) == final
    kvfs_mount.remount()
    assert read_whole(path, direct=True) == final


def test_descriptor_opened_before_another_truncate_reads_eio_until_reopened(
    kvfs_mount: KvfsMount,
) -> None:
    """The contract behind the test above: the pieces of one read(2) are separate FUSE
    requests, so a descriptor that straddles another descriptor's shrinking truncate
    could join two contents. It answers EIO instead; a new open reads the new content,
    and a descriptor that shrank the file itself (ftruncate) goes on reading it, as do
    the descriptors of a thread that truncates by path (``test_mount_semantics``)."""
    path = kvfs_mount.path / "chunk.pt"
    path.write_bytes(CONTENTS[0])
    old = os.open(path, os.O_RDONLY)
    own = os.open(path, os.O_RDWR)
    try:
        assert os.pread(old, MiB, 0) == CONTENTS[0][:MiB]

        def rewrite() -> None:  # another engine's thread: O_TRUNC, then 8 MiB
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, CONTENTS[1])
            finally:
                os.close(fd)

        other = threading.Thread(target=rewrite)
        other.start()
        other.join()
        with pytest.raises(OSError) as e:
            os.pread(old, MiB, 0)
        assert e.value.errno == errno.EIO
        assert read_whole(path, direct=True) == CONTENTS[1]
        os.ftruncate(own, 2 * MiB)  # through the same descriptor that reads next
        assert os.pread(own, 4 * MiB, 0) == CONTENTS[1][: 2 * MiB]
    finally:
        os.close(old)
        os.close(own)
    assert read_whole(path, direct=False) == CONTENTS[1][: 2 * MiB]


ROUNDS_WITHIN = 90.0
"""Seconds after which the truncator starts no new round (a bound on the work, not a
check: the verdict is on the bytes read)."""


@contextmanager
def cpu_hogs(n: int) -> Iterator[None]:
    """``n`` CPU-bound processes (``yes``) for the duration: a thread at the lowest
    priority beside them waits long for a CPU each time it blocks and wakes."""
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield
    finally:
        for p in hogs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    "rounds,slow_truncator", [(40, False), (100, True)], ids=["plain", "slow-truncator"]
)
def test_reader_beside_a_truncate_by_path_never_gets_zeros(
    kvfs_mount: KvfsMount, rounds: int, slow_truncator: bool
) -> None:
    """A truncate's new size is set in the kernel by the truncating thread, once it
    runs again after kvfs answered. Meanwhile an O_DIRECT read, asked up to the old
    size, got the new, shorter content; the kernel read the rest through the page
    cache (on the same handle), kvfs answered that short too, and the kernel zero-
    filled the pages and returned the old length with zeros past the cut: 17 of 267
    reads before rule 3 (reads wait until the shrink is answered), then 2 of 903 in a
    loaded CI run, and 7, 13 and 20 of ~60 000 in three runs of ``slow-truncator``
    (the truncating thread at the lowest priority beside two CPU-bound processes,
    which widens the window after the answer). O_DIRECT opens that read are now answered
    ``direct_io``, so no direct read falls back to the page cache (rule 6)."""
    path = kvfs_mount.path / "chunk.pt"
    full = CONTENTS[1]  # 8 MiB
    cut = 4 * MiB + 5
    path.write_bytes(full)
    stop = threading.Event()
    bad: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            got = read_whole(path, direct=True)
            if isinstance(got, int):
                if got not in (errno.ENOENT, errno.EIO):
                    bad.append(f"errno {got}")
                continue
            reads[0] += 1
            if got != full[: len(got)]:
                zeros = not got[cut:].strip(b"\0")
                bad.append(f"{len(got)} bytes, not a prefix (zeros past the cut: {zeros})")

    def truncator() -> None:
        if slow_truncator:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        # fewer rounds on a machine too loaded to run them all in a while: fewer
        # chances to meet the window, never another verdict
        stop_by = time.monotonic() + ROUNDS_WITHIN
        for _ in range(rounds):
            path.write_bytes(full)
            os.truncate(path, cut)
            if time.monotonic() > stop_by:
                break

    threads = [threading.Thread(target=reader) for _ in range(3 if slow_truncator else 2)]
    for t in threads:
        t.start()
    try:
        with cpu_hogs(2 if slow_truncator else 0):
            writer = threading.Thread(target=truncator)
            writer.start()
            writer.join()
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert reads[0], "no read succeeded"
    assert not bad, f"{len(bad)} wrong reads of {reads[0]}: {bad[:5]}"
    assert read_whole(path, direct=True) == full[:cut]
