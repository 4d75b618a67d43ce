"""A kernel timer that interrupts the trio thread, so that a read of ``/dev/fuse``
that found nothing to read ends instead of freezing the daemon.

pyfuse3 (3.4) waits for ``/dev/fuse`` to be readable in trio, then reads it with a
blocking ``read(2)`` on the trio thread, holding the GIL. What made the device
readable can be gone by the time of that read: a FUSE INTERRUPT the kernel queued for
a request the daemon answers meanwhile is withdrawn with its answer, and a killed
process's request that was still queued is withdrawn with the process (libfuse
issue 1194 is the same race in C). The read then sleeps until the next request
arrives. Every thread of the daemon waits behind the GIL the read holds -- the ring's
I/O and connection threads, trio's worker threads -- so a killed client whose last
request the daemon had already read cannot finish exiting, and with nothing else
asking, nothing ever arrives: the CI run of ``test_ring.py``'s killed clients found a
client that SIGKILL never ended.

No Python thread can end that read (each would need the GIL), so the kernel does: a
POSIX timer (``timer_create`` with ``SIGEV_THREAD_ID``) sends the trio thread a
signal every :data:`PERIOD`. The signal's handler does nothing; its arrival makes a
waiting ``read`` of ``/dev/fuse`` return ``EINTR``, which pyfuse3 answers by waiting
for readability again. A stall is bounded by the period; a busy or idle daemon pays
one signal per period (trio's own waits retry ``EINTR``, PEP 475). Only the trio
thread is signalled, never an I/O thread: the calls that would not retry an
``EINTR`` (the ctypes ``fallocate`` and the ``BLKDISCARD`` ioctl of
:mod:`kvfs.devices.device`) run on worker threads and must stay there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import signal
import threading

log = logging.getLogger(__name__)

PERIOD = 0.1
"""Seconds between two signals: the longest a read with nothing to read can hold the
daemon."""
SIGNAL = signal.SIGRTMIN + 3
"""A real-time signal nothing else in the daemon uses (glibc keeps the first two)."""
_CLOCK_MONOTONIC = 1
_SIGEV_THREAD_ID = 4


class _Sigevent(ctypes.Structure):
    # struct sigevent (64 bytes on Linux): the value union, signo, notify, then
    # the union whose first member is the thread id for SIGEV_THREAD_ID
    _fields_ = [
        ("value", ctypes.c_void_p),
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("tid", ctypes.c_int),
        ("_pad", ctypes.c_int * 11),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


def _libc() -> ctypes.CDLL:
    """The C library with ``timer_create`` (glibc 2.34+; librt before)."""
    for name in (None, ctypes.util.find_library("rt") or "librt.so.1"):
        lib = ctypes.CDLL(name, use_errno=True)
        if hasattr(lib, "timer_create"):
            return lib
    raise OSError("no timer_create in the C library")


class Waker:
    """Signal the calling thread every ``period`` seconds until :meth:`stop`
    (``start`` on the main thread: only it may install a signal handler)."""

    def __init__(self, period: float = PERIOD, signo: int = SIGNAL) -> None:
        self.period = period
        self.signo = signo
        self._timer: ctypes.c_void_p | None = None
        self._lib: ctypes.CDLL | None = None

    def start(self) -> bool:
        """Arm the timer; False (and a warning) where the system cannot, the daemon
        then serving as before."""
        try:
            lib = _libc()
            signal.signal(self.signo, _nothing)
            ev = _Sigevent(None, self.signo, _SIGEV_THREAD_ID, threading.get_native_id())
            timer = ctypes.c_void_p()
            if lib.timer_create(_CLOCK_MONOTONIC, ctypes.byref(ev), ctypes.byref(timer)):
                raise OSError(ctypes.get_errno(), "timer_create")
            sec, frac = divmod(self.period, 1.0)
            tick = _Timespec(int(sec), int(frac * 1e9))
            if lib.timer_settime(timer, 0, ctypes.byref(_Itimerspec(tick, tick)), None):
                err = ctypes.get_errno()
                lib.timer_delete(timer)
                raise OSError(err, "timer_settime")
        except (OSError, ValueError) as e:
            log.warning("no wake-up timer for the FUSE reader (%s): a rare race can stall it", e)
            return False
        self._lib, self._timer = lib, timer
        return True

    def stop(self) -> None:
        """Disarm; a signal already on its way is discarded (SIG_IGN), never the
        default action (which would end the process)."""
        lib, timer, self._lib, self._timer = self._lib, self._timer, None, None
        if lib is not None and timer is not None:
            lib.timer_delete(timer)
            signal.signal(self.signo, signal.SIG_IGN)


def _nothing(signo: int, frame: object) -> None:
    """The signal's only work is to have arrived (see the module's docstring)."""
