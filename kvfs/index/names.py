"""The directory tree: names in the (parent, name) index, listings, extra hard
links (``Names``, a mixin of :class:`kvfs.index.namespace.Namespace`)."""

from __future__ import annotations

from array import array

from kvfs.common.errors import InvalidArgument, NameTooLong
from kvfs.index.state import F_NAMED, State

NAME_MAX = 255


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise NameTooLong(f"name of {len(name)} bytes")
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise InvalidArgument(f"invalid name {name!r}")


class Names(State):
    """A row's names: the indexed one (in the name index and its parent's listing)
    and extra hard-link names (per directory)."""

    def _find(self, parent: int, name: bytes) -> int:
        ino = self._index.find(parent, name)
        if ino:
            return ino
        d = self._dirs.get(parent)
        if d is not None and d.links:
            return d.links.get(name, 0)
        return 0

    def _add_name(self, parent: int, name: bytes, ino: int) -> None:
        """Record a name known to be absent from ``parent``."""
        if not self._flags[ino] & F_NAMED:
            self._parent[ino] = parent
            self._set_name(ino, name)
            self._flags[ino] |= F_NAMED
            self._index.insert(parent, name, ino)
            children = self._dirs[parent].own_children()
            self._cpos[ino] = len(children)
            children.append(ino)
            return
        d = self._dirs[parent]
        if d.links is None:
            d.links = {}
        d.links[name] = ino
        self._extra.setdefault(ino, []).append((parent, name))

    def _del_name(self, parent: int, name: bytes) -> int:
        """Remove a name; KeyError if it does not exist. Returns its inode."""
        ino = self._index.find(parent, name)
        if ino:
            self._index.remove(parent, name, ino)
            children = self._dirs[parent].own_children()
            i = self._child_pos(children, ino)
            last = children.pop()
            if i < len(children):
                children[i] = last
                self._cpos[last] = i
            self._flags[ino] &= ~F_NAMED
            extra = self._extra.get(ino)
            if extra:  # another hard link becomes the indexed name
                p, n = extra.pop()
                if not extra:
                    del self._extra[ino]
                self._drop_link(p, n)
                self._add_name(p, n, ino)
            return ino
        d = self._dirs.get(parent)
        if d is None or not d.links or name not in d.links:
            raise KeyError(name)
        ino = self._drop_link(parent, name)
        extra = self._extra[ino]
        extra.remove((parent, name))
        if not extra:
            del self._extra[ino]
        return ino

    def _child_pos(self, children: array[int], ino: int) -> int:
        """Where ``ino`` is in ``children`` (its parent's listing): O(1) from the
        position column. Positions are not in checkpoints: after a load (or anything
        else that filled a listing without them) the first miss in a directory
        recomputes its positions once."""
        i = self._cpos[ino]
        if i < len(children) and children[i] == ino:
            return i
        for j, child in enumerate(children):
            self._cpos[child] = j
        i = self._cpos[ino]
        if i < len(children) and children[i] == ino:
            return i
        return children.index(ino)  # ValueError: not listed (a broken index)

    def _drop_link(self, parent: int, name: bytes) -> int:
        d = self._dirs[parent]
        assert d.links is not None
        ino = d.links.pop(name)
        if not d.links:
            d.links = None
        return ino

    def _names(self, ino: int) -> list[tuple[int, bytes]]:
        out = [(p, n) for p, n in self._extra.get(ino, ())]
        if self._flags[ino] & F_NAMED:
            out.append((self._parent[ino], self._name(ino)))
        return out
