"""Giving freed heap back to the kernel (glibc ``malloc_trim``), once after recovery
and then whenever enough has gathered while serving.

Memory the daemon frees stays mapped in malloc's heap unless it is trimmed: glibc
returns only the heap's top on its own. Decoding a checkpoint's pieces leaves
hundreds of MiB free at 10^7 files, and a cache that turns over leaves about as
much again: its column chunks widen and are copied, names and listing arrays grow
and move. ``tools/nsmem.py 1000000 --turnover`` measured ~86 B per file of free heap kept
mapped after a full turnover (~130 with LMCache's names), all of it given back by
a trim (``docs/performance.md``, "The heap after a turnover"). Small
Python objects live in pymalloc's own arenas, which go back to the kernel whole
when empty; what this trims is the larger blocks (arrays, bytes) malloc holds.

No-op without glibc (``malloc_trim``/``mallinfo2`` missing): nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from dataclasses import dataclass

import trio

log = logging.getLogger(__name__)

TRIM_EVERY = 30.0
"""Seconds between two looks at the free heap while serving."""
TRIM_FREE = 64 << 20
"""Free bytes in malloc's heap from which a look trims; under this the free heap is
what the next allocations reuse. The count includes pages a trim already gave back
(a trimmed free block is still a free block), so a heap that keeps this much free
is trimmed at every look: the first trim after a turnover of 10^6 files took 6-10
ms, the next ones 0.3 ms (``tools/nsmem.py --turnover``)."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()
_TRIM = getattr(_LIBC, "malloc_trim", None)
_INFO = getattr(_LIBC, "mallinfo2", None)  # glibc >= 2.33
if _INFO is not None:
    _INFO.restype = _MallInfo2


def release_free_heap() -> None:
    """Give every free page of malloc's heap back to the kernel (``malloc_trim(0)``)."""
    if _TRIM is not None:
        _TRIM(0)


def free_heap_bytes() -> int | None:
    """Bytes free in malloc's arenas (``mallinfo2().fordblks``), None where unknown."""
    if _INFO is None:
        return None
    return int(_INFO().fordblks)


def resident_bytes() -> int:
    """This process's resident set (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class HeapStatistics:
    trims: int = 0
    """Trims run while serving."""
    released_bytes: int = 0
    """Resident bytes they gave back (the resident set before minus after)."""


def trim_if_worth(least: int = TRIM_FREE) -> int | None:
    """Trim if at least ``least`` bytes are free in the heap: the resident bytes
    given back (0 or more), None if nothing was trimmed. Blocking: callers on the
    event loop run it in a thread (the foreign call releases the GIL; malloc's lock
    is taken an arena at a time)."""
    free = free_heap_bytes()
    if free is None or free < least:
        return None
    before = resident_bytes()
    release_free_heap()
    return max(before - resident_bytes(), 0)


async def trim_loop(
    stats: HeapStatistics, every: float = TRIM_EVERY, least: int = TRIM_FREE
) -> None:
    """While serving: every ``every`` seconds, trim in a worker thread if at least
    ``least`` bytes are free in the heap."""
    while True:
        await trio.sleep(every)
        released = await trio.to_thread.run_sync(trim_if_worth, least)
        if released is not None:
            stats.trims += 1
            stats.released_bytes += released
            log.debug("heap trimmed: %d MiB given back", released >> 20)
