"""Serving one mount: the pyfuse3 session around :class:`~kvfs.fuse.ops.Operations`,
from FUSE INIT to the unmount, with the mount's readahead raised and the metrics
exporter (if any) served in the same trio loop.

Signals end the session (SIGTERM, SIGINT) or only reopen the log (SIGHUP); what the
daemon does around them (its log files, systemd's notifications) is the caller's,
passed in as callbacks.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

import pyfuse3
import trio

from kvfs.fuse.metrics import Exporter
from kvfs.fuse.ops import Operations
from kvfs.fuse.wake import Waker
from kvfs.store.facade import Store
from kvfs.store.ring import RingServer

log = logging.getLogger(__name__)


async def tune_readahead(mountpoint: str, kib: int) -> None:
    """Raise the mount's readahead once FUSE INIT is done (earlier writes are clamped
    back): 1 MiB read requests instead of 128 KiB (docs: fuse-performance)."""
    for _ in range(100):
        try:
            st = await trio.to_thread.run_sync(os.stat, mountpoint)
        except OSError:
            st = None
        if st is not None and os.major(st.st_dev) == 0:
            path = f"/sys/class/bdi/0:{os.minor(st.st_dev)}/read_ahead_kb"
            try:
                with open(path, "w") as f:  # noqa: ASYNC230 - sysfs write, instantaneous
                    f.write(str(kib))
                log.debug("set %s to %d", path, kib)
            except OSError as e:
                log.info("could not raise readahead (%s): %s", path, e)
            return
        await trio.sleep(0.05)


PREFAULT_LIMIT = 256 << 20
"""At most this much of the read cache is faulted in before the mount serves."""


def prefault_read_buffers(store: Store, limit: int = PREFAULT_LIMIT) -> int:
    """Fault in the one-unit buffers the read cache will hold (up to ``limit``
    bytes) before the first request, and leave them free in the unit-size pool.

    Every unit a read brings in stays in the cache until it is full, so without
    this every device read of a fresh mount lands in a fresh mapping: an O_DIRECT
    read into fresh pages costs ~0.5 ms of CPU per MiB (page allocation and
    zeroing), into pages already there ~0.05 ms (``docs/performance.md``, issue 29
    item 4: paired 1.09-1.36x on ``bench.py --ceiling``'s cold reads). The pool
    already keeps the cache's worth of free buffers once a mount has run a while;
    this only reaches that state at the mount instead of over the first
    cache-full of reads. Returns the number of buffers faulted in."""
    unit = store.pool.unit_size
    pool = store.writer.buffer_pool(unit)
    count = min(store.cfg.cache_bytes, limit) // unit
    zeros = bytes(unit)
    bufs = [pool.take(zeroed=False) for _ in range(count)]
    for i in range(count):
        bufs[i][:] = zeros  # the page faults happen here, not inside a device read
    bufs.clear()  # no reference left: reap() takes every one back as free
    pool.reap()
    return count


async def serve(
    store: Store,
    mountpoint: str,
    options: set[str],
    ready: Callable[[], None] = lambda: None,
    exporter: Exporter | None = None,
    readahead_kib: int = 4096,
    reopen_logs: Callable[[], None] = lambda: None,
    stopping: Callable[[], object] = lambda: None,
    ring_path: str | None = None,
    ring_threads: int = 8,
) -> None:
    """Mount, serve until unmounted or signalled, then commit and checkpoint.
    ``reopen_logs`` runs on SIGHUP; ``stopping`` once, when a signal starts the
    unmount. ``ring_path``: where the aware ring listens (none if None)."""
    ops = Operations(store)
    prefault_read_buffers(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        pyfuse3.init(ops, mountpoint, options)
        ring = _start_ring(store, ring_path, ring_threads, "allow_other" in options)
        try:
            nursery.start_soon(_on_signals, reopen_logs, stopping)
            nursery.start_soon(tune_readahead, mountpoint, readahead_kib)
            if exporter is not None:
                nursery.start_soon(exporter.serve, store, ops.requests)
            ready()
            waker = Waker()  # a read of /dev/fuse with nothing to read must end
            waker.start()
            try:
                await pyfuse3.main()
            finally:
                waker.stop()
        finally:
            if ring is not None:
                store.direct.ring = None  # no new tickets; the live ones die with their files
                ring.stop()
            try:
                await store.close()
            finally:
                pyfuse3.close(unmount=True)
                nursery.cancel_scope.cancel()


def _start_ring(
    store: Store, path: str | None, threads: int, allow_other: bool
) -> RingServer | None:
    """Serve the aware ring at ``path`` (:mod:`kvfs.store.ring`); None where it
    cannot listen (the mount still serves every engine through FUSE)."""
    if path is None:
        return None
    fds = [getattr(d, "fd", -1) for d in store.pool.devices]
    ring = RingServer(
        store.direct.tickets,
        fds,
        path,
        threads,
        opener=store.ring_open_reads,
        releaser=store.release_all,
        creator=store.ring_open_writes,
        committer=store.ring_commit_writes,
        token=trio.lowlevel.current_trio_token(),
        allow_other=allow_other,
    )
    try:
        ring.start()
    except OSError as e:
        log.warning("no aware ring at %s: %s", path, e)
        return None
    store.direct.soon = trio.lowlevel.current_trio_token().run_sync_soon
    store.direct.ring_stats = ring.stats
    store.direct.ring = path
    return ring


async def _on_signals(reopen_logs: Callable[[], None], stopping: Callable[[], object]) -> None:
    """SIGTERM and SIGINT unmount (cleanly: final commit and checkpoint); SIGHUP only
    reopens the log file (logrotate). Still listening while the unmount runs, so a
    late SIGHUP cannot kill the final checkpoint."""
    done = False
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                reopen_logs()
                log.info("SIGHUP: log file reopened")
            elif not done:
                done = True
                log.info("signal %d received: unmounting", signum)
                stopping()
                pyfuse3.terminate()


__all__ = ["prefault_read_buffers", "serve", "tune_readahead"]
