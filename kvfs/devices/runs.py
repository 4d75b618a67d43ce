"""Moving a file's runs of units between a device and memory, O_DIRECT, with xxh3
per unit: the one piece of device I/O that both aware routes share, the engine's
process that opens the devices itself (:mod:`kvfs.client.direct`) and the daemon
serving a ring client (:mod:`kvfs.store.ring`).

A run (as the mount's map or reservation gives it) is ``[device, byte offset, stored
length, first unit, units]``. It moves in pieces of at most :data:`PIECE` bytes, on
several threads, so the checksums of one piece overlap the I/O of the next (the
reads, writes and xxh3 release the GIL). A piece moves in place when its memory is
page-aligned and its units are whole; a file's partial last unit and a fragment tail
go through an aligned scratch buffer (a bounce, counted by the caller).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvfs.devices.device import ALIGN, aligned_buffer

PIECE = 8 << 20
"""Bytes per device request at most."""


@dataclass(frozen=True)
class Piece:
    """Units ``first``.. (``n`` of them) of one run: at ``offset`` on descriptor
    ``fd``, ``stored`` bytes there (less than ``n`` units for a fragment tail).
    ``whole``: every unit lies within the file's size and is stored whole, so it can
    move in place."""

    fd: int
    offset: int
    first: int
    n: int
    stored: int
    whole: bool


def pieces(run: Sequence[int], fds: Sequence[int], unit: int, size: int) -> list[Piece]:
    """A run as pieces of at most PIECE bytes; a file's partial last unit is a piece of
    its own (a fragment tail is a run of its own already)."""
    fd, offset, length, first, n = fds[run[0]], run[1], run[2], run[3], run[4]
    if length < n * unit:  # a fragment tail (n == 1): its stored bytes only
        return [Piece(fd, offset, first, 1, length, False)]
    full = min(n, max(size // unit - first, 0))
    per = max(PIECE // unit, 1)
    out = []
    for i in range(0, full, per):
        k = min(per, full - i)
        out.append(Piece(fd, offset + i * unit, first + i, k, k * unit, True))
    if full < n:
        k = n - full
        out.append(Piece(fd, offset + full * unit, first + full, k, k * unit, False))
    return out


def unit_sums(data: memoryview, n: int, unit: int) -> list[int]:
    """xxh3-64 of each of ``n`` units of ``data`` (what the mount stores per unit)."""
    return [xxhash.xxh3_64_intdigest(data[i * unit : (i + 1) * unit]) for i in range(n)]


def in_place(piece: Piece, base: int | None, unit: int) -> bool:
    """Whether ``piece`` moves straight to/from memory starting at address ``base``
    (None: unknown, a read-only buffer's; tried, and bounced on EINVAL)."""
    return piece.whole and (base is None or (base + piece.first * unit) % ALIGN == 0)


def pread_all(fd: int, target: memoryview, offset: int) -> None:
    done = 0
    while done < len(target):
        n = os.preadv(fd, [target[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"short device read at {offset + done}")
        done += n


def pwrite_all(fd: int, source: memoryview, offset: int) -> None:
    done = 0
    while done < len(source):
        n = os.pwritev(fd, [source[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short device write at {offset + done}")
        done += n


def read_piece(
    p: Piece, view: memoryview, base: int | None, unit: int, size: int, csums: Sequence[int]
) -> tuple[bool, int]:
    """Read piece ``p`` of a ``size``-byte file into ``view`` (the file's bytes from 0,
    at address ``base``) and verify it against ``csums``: (verified, bytes bounced).
    A piece that fails its checksum leaves ``view`` holding no verified bytes of it."""
    expected = list(csums[p.first : p.first + p.n])
    if in_place(p, base, unit):
        target = view[p.first * unit : (p.first + p.n) * unit]
        pread_all(p.fd, target, p.offset)
        return unit_sums(target, p.n, unit) == expected, 0
    scratch = aligned_buffer(p.n * unit)  # zero-filled: a fragment tail's unit ends in zeros
    try:
        whole = memoryview(scratch)[: p.n * unit]
        pread_all(p.fd, whole[: -(-p.stored // ALIGN) * ALIGN], p.offset)
        ok = unit_sums(whole, p.n, unit) == expected
        start = p.first * unit
        end = min(start + p.n * unit, size)
        if ok:
            view[start:end] = whole[: end - start]
        del whole
        return ok, end - start if ok else 0
    finally:
        scratch.close()


def write_piece(p: Piece, view: memoryview, base: int | None, unit: int, sums: list[int]) -> int:
    """Write piece ``p`` of the file whose bytes are ``view`` (at address ``base``)
    and fill its units' entries of ``sums``; the bytes bounced."""
    if in_place(p, base, unit):
        source = view[p.first * unit : (p.first + p.n) * unit]
        sums[p.first : p.first + p.n] = unit_sums(source, p.n, unit)
        try:
            pwrite_all(p.fd, source, p.offset)
            return 0
        except OSError as e:  # a read-only buffer's alignment shows only here
            if e.errno != errno.EINVAL or not view.readonly:
                raise
    start = p.first * unit
    end = min(start + p.n * unit, len(view))
    scratch = aligned_buffer(p.n * unit)  # zero-filled: a partial last unit is padded
    try:
        whole = memoryview(scratch)[: p.n * unit]
        whole[: end - start] = view[start:end]
        sums[p.first : p.first + p.n] = unit_sums(whole, p.n, unit)
        pwrite_all(p.fd, whole[: -(-p.stored // ALIGN) * ALIGN], p.offset)
        del whole
        return end - start
    finally:
        scratch.close()
