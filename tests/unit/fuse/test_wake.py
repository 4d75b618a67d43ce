"""The wake-up timer of the FUSE reader (:mod:`kvfs.fuse.wake`): a blocking read on
the thread that armed it ends with EINTR, and nothing is left once it is stopped."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import threading
import time

from kvfs.fuse.wake import SIGNAL, Waker


def _timers() -> str:
    with open("/proc/self/timers") as f:
        return f.read()


def _wchan(tid: int) -> str:
    """Where thread ``tid`` of this process sleeps in the kernel."""
    with open(f"/proc/self/task/{tid}/wchan") as f:
        return f.read()


def test_a_read_with_nothing_to_read_ends_with_eintr_on_the_armed_thread() -> None:
    """As pyfuse3's read of /dev/fuse would, a C-level ``read`` of a pipe nobody
    writes blocks on this thread (the GIL released, as a stuck daemon's other threads
    cannot rely on): the timer's signal ends it with EINTR, again and again."""
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    waker = Waker(period=0.05)
    try:
        assert waker.start()
        assert f"tid.{threading.get_native_id()}" in _timers()
        buf = ctypes.create_string_buffer(8)
        for _ in range(3):
            assert libc.read(r, buf, 8) == -1
            assert ctypes.get_errno() == errno.EINTR
    finally:
        waker.stop()
        os.close(r)
        os.close(w)
    assert f"signal: {int(SIGNAL)}/" not in _timers()
    assert signal.getsignal(SIGNAL) == signal.SIG_IGN  # a late signal is dropped, not fatal


def test_only_the_armed_thread_is_signalled() -> None:
    """Another thread's blocking read is never interrupted: the ring's and trio's
    worker threads run their system calls undisturbed."""
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    got: list[tuple[int, int]] = []
    tids: list[int] = []

    def reader() -> None:
        tids.append(threading.get_native_id())
        buf = ctypes.create_string_buffer(8)
        n = libc.read(r, buf, 8)
        got.append((n, ctypes.get_errno()))

    waker = Waker(period=0.02)
    t = threading.Thread(target=reader)
    try:
        assert waker.start()
        t.start()
        deadline = time.monotonic() + 60  # a hang guard: it waits in its read at once
        while not tids or "pipe_read" not in _wchan(tids[0]):
            assert time.monotonic() < deadline, "the other thread never reached its read"
            time.sleep(0.01)
        main = ctypes.create_string_buffer(8)
        r2, w2 = os.pipe()
        try:
            for _ in range(10):  # ten signals on this thread while the other waits
                assert libc.read(r2, main, 8) == -1
        finally:
            os.close(r2)
            os.close(w2)
        assert not got  # still waiting: no signal reached it
        os.write(w, b"x")
        t.join()
    finally:
        waker.stop()
        os.close(r)
        os.close(w)
    assert [n for n, _ in got] == [1]
