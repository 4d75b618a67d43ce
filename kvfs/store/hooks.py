"""What the store tells the tiers that follow its files, and what it asks them.

A tier above the store (the cluster tier, :mod:`kvfs.cluster`) subscribes to a store
with :meth:`kvfs.store.facade.Store.subscribe`; the store imports nothing of it. The
store then:

- starts it with its background tasks (:meth:`StoreHooks.run`) and stops it first
  thing at unmount (:meth:`StoreHooks.stop`: local durability never waits on a tier);
- publishes its events, synchronously on the trio thread, after the change is done
  (a subscriber queues what takes time; none may await or raise):
  a file written through a handle was closed and is committed (``closed``), a name
  was renamed (``renamed``) or unlinked by a user (``unlinked``), and local eviction is
  about to take a file (``evicted``, before its names go);
- asks it before answering that a name does not exist (``missed``: the tier may make
  the name local, the store then looks again), and how long such an answer may be
  cached (``negative_timeout``: a tier may make names appear);
- reports its statistics and latency histograms beside its own, under its ``name``.

A subscriber sees files as :class:`~kvfs.store.types.FileView` (read-only) and calls
only the store's public methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import trio

from kvfs.common.timing import Histogram
from kvfs.index.namespace import Inode
from kvfs.store.types import FileView


class StoreHooks(Protocol):
    """A subscriber of a store's events (see the module's docstring)."""

    @property
    def name(self) -> str:
        """The key of its statistics and histograms in the store's reports."""
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Its background tasks, in the store's nursery, until cancelled."""

    def stop(self) -> None:
        """Unmount: stop at once, whatever is in flight."""

    def closed(self, inode: FileView) -> None:
        """A handle that wrote ``inode`` was closed and the file is committed."""

    def renamed(
        self, inode: FileView, old_parent: int, old: bytes, old_dir_path: bytes | None
    ) -> None:
        """``inode`` was renamed from ``old`` in ``old_parent`` (``old_dir_path``: that
        directory's path, taken before the rename; None if it had none)."""

    def unlinked(self, dir_path: bytes | None, name: bytes, parent: int) -> None:
        """A user removed the file ``name`` from ``parent`` (``dir_path``: the path of
        ``parent``, taken before)."""

    def evicted(self, inode: FileView) -> None:
        """Local eviction takes ``inode``; its names are still there."""

    async def missed(self, parent: int, name: bytes) -> None:
        """``name`` is not in ``parent``: make it local if the tier can; the store
        looks it up again once this returns."""

    @property
    def negative_timeout(self) -> float:
        """Seconds a "no such name" may be trusted."""
        ...

    def report(self) -> dict[str, Any]:
        """Its statistics, as ``kvfs stats`` shows them."""
        ...

    def histograms(self) -> dict[str, Histogram]:
        """Its latency histograms, by what they time."""
        ...


class Hooks:
    """The subscribers of one store and the fan-out of its events to them."""

    def __init__(self) -> None:
        self._subscribers: list[StoreHooks] = []

    def add(self, hooks: StoreHooks) -> None:
        self._subscribers.append(hooks)

    def __bool__(self) -> bool:
        return bool(self._subscribers)

    async def start(self, nursery: trio.Nursery) -> None:
        for s in self._subscribers:
            await nursery.start(s.run)

    def stop(self) -> None:
        for s in self._subscribers:
            s.stop()

    def closed(self, inode: FileView) -> None:
        for s in self._subscribers:
            s.closed(inode)

    def renamed(
        self, inode: FileView, old_parent: int, old: bytes, old_dir_path: bytes | None
    ) -> None:
        for s in self._subscribers:
            s.renamed(inode, old_parent, old, old_dir_path)

    def unlinked(self, dir_path: bytes | None, name: bytes, parent: int) -> None:
        for s in self._subscribers:
            s.unlinked(dir_path, name, parent)

    def evicted(self, inode: FileView) -> None:
        for s in self._subscribers:
            s.evicted(inode)

    async def missed(
        self, parent: int, name: bytes, lookup: Callable[[int, bytes], Inode | None]
    ) -> Inode | None:
        """Ask the subscribers in turn about a name not here, until ``lookup`` finds it."""
        for s in self._subscribers:
            await s.missed(parent, name)
            found = lookup(parent, name)
            if found is not None:
                return found
        return None

    def negative_timeout(self, default: float) -> float:
        """How long a miss may be cached: ``default`` with no subscriber, else the
        shortest a subscriber allows."""
        if not self._subscribers:
            return default
        return min(s.negative_timeout for s in self._subscribers)

    def reports(self) -> dict[str, dict[str, Any]]:
        return {s.name: s.report() for s in self._subscribers}

    def histograms(self) -> dict[str, dict[str, Histogram]]:
        return {s.name: s.histograms() for s in self._subscribers}
