"""Wrong bytes on a real mount, round 3: the zero-copy path beside an ``O_TRUNC`` rewrite.

``kvfs.client.direct.read_into`` reads a file's units straight from the devices with the map
the mount leased to it; meanwhile another engine may store the same key again (an
``O_TRUNC`` open and new bytes, through FUSE or ``kvfs.client.direct.write_from``), and
other files take the units the rewrite freed. A read may get the old
bytes, the new bytes or fewer of them (EOF moved), or fail (EIO, ENOENT) -- never bytes
that the file never held: no zeros, no other file's bytes, no old length around new
bytes. The same for O_DIRECT reads through the mount beside direct writes.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvfs.client.direct as direct
from kvfs.testing import harness
from tests.conftest import (
    META_SIZE,
    KvfsMount,
    _expected,
    _finish,
    aligned,
    pattern,
    require_fuse,
    wait_for,
)

MiB = 1 << 20
SIZES = (32 * MiB, 8 * MiB, 32 * MiB - 3, 8 * MiB + 4097)
"""The contents a writer cycles through (odd ones end in a partial unit)."""
CONTENTS = [pattern(("direct-trunc", i), size) for i, size in enumerate(SIZES)]
REWRITES = 24
CHURN = 8 * MiB
"""Each churn file's size: four of them, rewritten in turn, take the units a rewrite of
the chunk freed as soon as the pool lets them."""


@pytest.fixture
def tight_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KvfsMount]:
    """A 128 MiB pool that takes 32 MiB files: a rewrite's freed units are soon reused."""
    require_fuse()
    image = harness.make_image(tmp_path / "tight.img", 128 << 20)
    mount = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
    try:
        mount.start("--format", "--meta-size", META_SIZE, "--max-file-size", "40M")
        yield mount
    finally:
        _finish(mount)


def verdict(got: bytes | memoryview) -> str | None:
    """None if ``got`` is a prefix of ONE content the file held, else what it is."""
    n = len(got)
    if any(n <= len(c) and got == c[:n] for c in CONTENTS):
        return None
    pieces = []
    for i in range(0, n, MiB):
        piece = bytes(got[i : i + MiB])
        owner = [k for k, c in enumerate(CONTENTS) if c[i : i + len(piece)] == piece]
        pieces.append(str(owner[0]) if owner else "z" if not piece.strip(b"\0") else "?")
    return f"{n} bytes matching no content the file held (MiB pieces: {''.join(pieces)})"


def direct_read(path: Path, buf: Any) -> bytes | int:
    """``read_into`` of the whole file, or the errno it failed with."""
    try:
        n = direct.read_into(path, buf)
    except OSError as e:
        return e.errno or -1
    return bytes(memoryview(buf)[:n])


def fuse_read(path: Path) -> bytes | int:
    """One O_DIRECT read of the whole file through the mount, or the errno."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        return e.errno or -1
    buf = aligned(max(SIZES) + MiB)
    try:
        return bytes(buf[: os.preadv(fd, [buf], 0)])
    except OSError as e:
        return e.errno or -1
    finally:
        buf.close()
        os.close(fd)


def store(path: Path, data: bytes, how: int) -> None:
    """Store ``data`` as ``path`` again, as an engine does: through FUSE (an O_TRUNC
    open and a write) or with ``write_from`` (odd ``how``)."""
    if how % 2:
        direct.write_from(path, data)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def test_direct_reads_beside_o_trunc_rewrites_never_get_wrong_bytes(
    tight_mount: KvfsMount,
) -> None:
    mnt = tight_mount.path
    path = mnt / "chunk.pt"
    direct.write_from(path, CONTENTS[0])
    stop = threading.Event()
    bad: list[str] = []
    reads = {"direct": 0, "fuse": 0, "errors": 0, "churned": 0, "full": 0}
    before = direct.stats()

    def reader(kind: str) -> None:
        buf: Any = direct.aligned(max(SIZES))
        if kind == "unaligned":  # bounced through an aligned buffer
            buf = memoryview(bytearray(max(SIZES) + 1))[1:]
        try:
            while not stop.is_set():
                got = fuse_read(path) if kind == "fuse" else direct_read(path, buf)
                if isinstance(got, int):
                    if got not in (errno.ENOENT, errno.EIO):
                        bad.append(f"{kind} read: errno {got}")
                    reads["errors"] += 1
                    continue
                reads["fuse" if kind == "fuse" else "direct"] += 1
                why = verdict(got)
                if why is not None:
                    bad.append(f"{kind} read: {why}")
        except BaseException as e:
            bad.append(f"{kind} reader: {e!r}")

    def churn() -> None:
        """Other files rewritten all the time: freed units go to them at once."""
        i = 0
        try:
            while not stop.is_set():
                other = mnt / f"other{i % 4}"
                data = pattern(("other", i % 7), CHURN)
                store(other, data, i)
                reads["churned"] += 1
                i += 1
        except OSError as e:  # a full pool: the chunk's readers hold its old units
            if e.errno != errno.ENOSPC:
                bad.append(f"churn: {e!r}")

    threads = [threading.Thread(target=reader, args=(k,)) for k in ("aligned", "unaligned", "fuse")]
    threads.append(threading.Thread(target=churn))
    for t in threads:
        t.start()
    try:
        for i in range(1, REWRITES + 1):
            store(path, CONTENTS[i % len(CONTENTS)], i // len(CONTENTS))
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not bad, f"{len(bad)} wrong reads of {sum(reads.values())}: {bad[:5]}"
    after = direct.stats()
    assert reads["direct"] and reads["fuse"] and reads["churned"], reads
    assert after["direct_reads"] > before["direct_reads"], (before, after)
    final = CONTENTS[REWRITES % len(CONTENTS)]  # the last store: O_TRUNC through FUSE
    buf = direct.aligned(max(SIZES))
    assert direct_read(path, buf) == final
    assert fuse_read(path) == final
    wait_for(lambda: tight_mount.stats()["direct"]["held_units"] == 0, what="leases to end")
    tight_mount.remount()
    assert direct_read(path, buf) == final
    assert fuse_read(path) == final


def test_a_lease_holds_freed_units_only_for_handles_that_may_read_them(
    tight_mount: KvfsMount,
) -> None:
    """A chunk read all the time (its readers' opens overlap, so it never closes for
    good) and stored again: each rewrite's old units are kept while a handle that
    mapped them is open, not until the file's last close -- else every rewrite of a
    hot chunk would keep its old units from the pool (ENOSPC soon after)."""
    path = tight_mount.path / "hot.pt"
    direct.write_from(path, CONTENTS[0])

    def held() -> int:
        return int(tight_mount.stats()["direct"]["held_units"])

    def mapped(fd: int) -> None:
        os.getxattr(fd, direct.MAP)

    first = os.open(path, os.O_RDONLY)
    mapped(first)
    store(path, CONTENTS[1], 0)
    assert held() == 32  # the first reader may still read the old 32 MiB
    second = os.open(path, os.O_RDONLY)
    mapped(second)  # the new 8 MiB
    os.close(first)
    wait_for(lambda: held() == 0, what="the first reader's units to go back")
    for i in range(2, 8):  # readers overlap: the file stays open throughout
        store(path, CONTENTS[i % len(CONTENTS)], 1)
        nxt = os.open(path, os.O_RDONLY)
        mapped(nxt)
        os.close(second)
        second = nxt
        wait_for(lambda: held() == 0, what="the older reader's units to go back")
    buf = direct.aligned(max(SIZES))
    assert direct_read(path, buf) == CONTENTS[7 % len(CONTENTS)]
    os.close(second)
    assert tight_mount.stats()["direct"]["leased_files"] == 0
