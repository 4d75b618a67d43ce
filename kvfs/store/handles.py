"""The open handles of one store: what each handle opened, which handles have
written, and what each user holds open (its pins: an open file cannot be evicted,
so what a user holds open counts against it; see :mod:`kvfs.evict.space`). Runs on the
trio thread, as the store that owns it."""

from __future__ import annotations

from collections.abc import ItemsView, Iterable

from kvfs.store.types import Handle


class Handles:
    """Handles by number (numbers are never reused while the store runs)."""

    def __init__(self) -> None:
        self._handles: dict[int, Handle] = {}
        self.wrote: set[int] = set()
        """Handles that have written: a killed opener's close of one of them means
        an incomplete file, whatever commits a FLUSH or fsync made meanwhile."""
        self._pins: dict[int, dict[int, int]] = {}  # uid -> {inode: its open handles}
        self._next_fh = 1

    def __getitem__(self, fh: int) -> Handle:
        return self._handles[fh]

    def __contains__(self, fh: object) -> bool:
        return fh in self._handles

    def __len__(self) -> int:
        return len(self._handles)

    def items(self) -> ItemsView[int, Handle]:
        return self._handles.items()

    @property
    def newest(self) -> int:
        """The number of the newest handle opened so far (0 before any): numbers
        grow, so a handle opened after this moment has a larger one."""
        return self._next_fh - 1

    def add(self, h: Handle) -> int:
        """Register ``h``; its number."""
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = h
        pins = self._pins.setdefault(h.uid, {})
        pins[h.ino] = pins.get(h.ino, 0) + 1
        return fh

    def replace(self, fh: int, h: Handle) -> None:
        """Handle ``fh`` is now ``h`` (same inode and user)."""
        assert self._handles[fh].ino == h.ino and self._handles[fh].uid == h.uid
        self._handles[fh] = h

    def remove(self, fh: int) -> Handle:
        """Forget handle ``fh`` (closed); what it was."""
        h = self._handles.pop(fh)
        self.wrote.discard(fh)
        self._unpin(h)
        return h

    def pinned(self, uid: int) -> Iterable[int]:
        """The inodes user ``uid`` holds open."""
        return self._pins.get(uid, ())

    def _unpin(self, h: Handle) -> None:
        pins = self._pins.get(h.uid)
        if pins is not None and h.ino in pins:
            pins[h.ino] -= 1
            if not pins[h.ino]:
                del pins[h.ino]
                if not pins:
                    del self._pins[h.uid]
