"""BufferPool: a buffer is reused only when nothing else can still see it."""

from __future__ import annotations

import mmap

from kvfs.devices.device import ALIGN, BufferPool

SIZE = 64 * 1024


def _address(buf: mmap.mmap) -> int:
    import ctypes

    c = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def test_dropped_buffer_is_reused_zeroed_and_aligned() -> None:
    pool = BufferPool(SIZE, keep=4)
    buf = pool.take()
    buf[:] = b"\xff" * SIZE
    first = _address(buf)
    del buf
    again = pool.take()
    assert _address(again) == first and pool.reused == 1
    assert again[:] == bytes(SIZE)
    assert first % ALIGN == 0


def test_unzeroed_take_skips_the_fill() -> None:
    pool = BufferPool(SIZE, keep=4)
    buf = pool.take()
    buf[:4] = b"data"
    del buf
    assert pool.take(zeroed=False)[:4] == b"data"


def test_held_buffer_is_never_handed_out() -> None:
    pool = BufferPool(SIZE, keep=4)
    held = {1: pool.take()}
    other = pool.take()
    assert other is not held[1]


def test_live_view_or_slice_keeps_its_buffer() -> None:
    pool = BufferPool(SIZE, keep=4)
    buf = pool.take()
    buf[:] = b"\x01" * SIZE
    view = memoryview(buf).toreadonly()[100:200]  # a reader's slice of a cached view
    del buf
    fresh = pool.take()
    assert view[:] == b"\x01" * 100 and pool.reused == 0
    fresh[:] = b"\x02" * SIZE
    assert view[:] == b"\x01" * 100
    del view
    pool.take()
    assert pool.reused == 1


def test_keep_bounds_the_free_list() -> None:
    pool = BufferPool(SIZE, keep=2)
    bufs = [pool.take() for _ in range(5)]
    del bufs
    pool.reap()
    taken = [pool.take() for _ in range(3)]
    assert pool.reused == 2 and pool.fresh == 6
    assert len({id(b) for b in taken}) == 3
