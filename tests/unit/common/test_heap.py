"""The heap trim (``kvfs.common.heap``): freed blocks left mapped in malloc's heap
are given back to the kernel, while serving only once enough has gathered."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import trio

from kvfs.common import heap

pytestmark = pytest.mark.skipif(heap.free_heap_bytes() is None, reason="needs glibc mallinfo2")

_FRAGMENT = textwrap.dedent(
    """
    import json, sys
    from kvfs.common import heap
    # 256 MiB in 8 KiB blocks (malloc's, not pymalloc's), then every block freed but
    # one in 64 (they pin the pages between them) and one allocated last (the top):
    # glibc gives nothing back by itself
    blocks = [bytearray(8192) for _ in range(32768)]
    for b in blocks:
        b[::4096] = b"x" * len(b[::4096])  # touched: resident
    kept = blocks[::64]
    del blocks
    top = bytearray(8192)
    before = heap.resident_bytes()
    free = heap.free_heap_bytes()
    unworthy = heap.trim_if_worth(free + 1)
    idle = heap.resident_bytes()
    released = heap.trim_if_worth(1 << 20)
    after = heap.resident_bytes()
    print(json.dumps(dict(before=before, free=free, unworthy=unworthy, idle=idle,
                          released=released, after=after, kept=len(kept) + len(top) // 8192)))
    """
)


def _fragmented() -> dict[str, int]:
    import json

    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENT], capture_output=True, text=True, check=True
    ).stdout
    result: dict[str, int] = json.loads(out)
    return result


def test_a_trim_gives_the_freed_pages_back_and_only_past_its_threshold() -> None:
    r = _fragmented()
    assert r["free"] > 200 << 20  # the freed blocks are free heap, still mapped
    assert r["unworthy"] is None  # under the threshold: no trim
    assert r["idle"] >= r["before"] - (8 << 20)  # ... and nothing went back
    assert r["released"] is not None and r["released"] > 150 << 20
    assert r["after"] <= r["before"] - (150 << 20)


async def test_the_serving_loop_trims_and_counts() -> None:
    stats = heap.HeapStatistics()
    blocks = [bytearray(8192) for _ in range(4096)]  # 32 MiB, then freed but a few
    kept = blocks[::64]
    del blocks
    async with trio.open_nursery() as nursery:
        nursery.start_soon(heap.trim_loop, stats, 0.01, 1)
        for _ in range(3000):  # (30 s at most)
            if stats.trims:
                break
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert stats.trims >= 1 and stats.released_bytes >= 0
    assert kept
