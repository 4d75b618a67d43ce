"""Names kept by their form: the longest run of lowercase hex digits of a name as
nibbles, the rest of it (the form) interned once for the whole pool.

Engines name chunks by a hash in a fixed frame: LMCache's ``local_disk``
``<model>@<world>@<worker>@<hash>@<dtype>.pt`` (~58 bytes, 16 of them the hash),
SGLang's and vLLM's hex digests with a prefix or suffix. Kept whole, the frame is
most of every name's arena bytes; kept once, a name costs its digits' nibbles and
a 4-byte head. A form is interned at its second name (the first is kept whole),
so names that share no frame do not fill the table. Nothing here is specific to
one engine: any name whose longest lowercase hex run is long enough to pay for
the head is kept this way, any other whole.

An entry in the arena is either the name itself (a name never holds a NUL byte)
or ``FORM_HEAD`` (0, form id, digit count) and the digits two to a byte, high
nibble first, the last low nibble 0 for an odd count. An entry by form is always
shorter than its name, so a lookup compares a candidate row's entry with the name
directly when it is as long, and decodes it when it is shorter
(:meth:`kvfs.index.state.State._is_named`): the same name may be kept whole in
one row and by its form in another (the first name of a form, a pool written
by a release before forms, a full table), and both are found.
"""

from __future__ import annotations

import re
from binascii import hexlify, unhexlify

from kvfs.common.errors import Corruption
from kvfs.format.nsparts import FORM_HEAD, GRANULE

MAX_FORMS = 1 << 16
"""Form ids are 16 bits; while that many forms are in use, names of a new form are
kept whole. A form costs ~0.2 KiB of the daemon's memory and up to ~0.26 KiB of
each checkpoint."""
MAX_SEEN = 1 << 16
"""Forms seen once, remembered (~4 MiB at most)."""
_RUN = re.compile(rb"[0-9a-f]+")


def _granules(n: int) -> int:
    return -(-n // GRANULE)


class NameForms:
    """The pool's interned forms (prefix, suffix) by id, how many arena entries use
    each, and a name's entry. A form lives while an entry uses it: the namespace
    calls :meth:`hold` for each entry it puts in the arena and :meth:`drop` for each
    it releases, and the last drop frees the form's id for another form (so frames
    that come and go, a request id in every name, do not fill the table or the
    image)."""

    __slots__ = ("counts", "free", "ids", "parts", "seen")

    def __init__(self) -> None:
        self.parts: list[tuple[bytes, bytes] | None] = []
        """By id; None: a free id (in ``free``)."""
        self.counts: list[int] = []
        """By id: the arena entries that use the form."""
        self.free: list[int] = []
        self.ids: dict[tuple[bytes, bytes], int] = {}
        self.seen: set[int] = set()
        """Hashes of forms stored once, whole (a form is interned at its second
        name: names that share nothing but their digits, ``<hash>-<seq>``, never
        fill the table); forgotten at ``MAX_SEEN``."""

    def __len__(self) -> int:
        return len(self.ids)

    def load(self, fid: int, count: int, prefix: bytes, suffix: bytes) -> None:
        """Install a form of an image at its id, used by ``count`` entries."""
        if count <= 0 or fid >= MAX_FORMS or (prefix, suffix) in self.ids:
            raise ValueError(f"name form {fid}: {count} entries, or twice")
        while len(self.parts) <= fid:
            self.free.append(len(self.parts))
            self.parts.append(None)
            self.counts.append(0)
        if self.parts[fid] is not None:
            raise ValueError(f"name form {fid} twice")
        self.free.remove(fid)
        self.parts[fid] = prefix, suffix
        self.counts[fid] = count
        self.ids[prefix, suffix] = fid

    def in_use(self) -> list[tuple[int, int, bytes, bytes]]:
        """Each form in use: id, entries that use it, prefix, suffix (O(forms))."""
        return sorted((fid, self.counts[fid], *key) for key, fid in self.ids.items())

    def hold(self, entry: bytes) -> None:
        """An arena entry was put: count it against its form."""
        if entry[:1] == b"\0":
            self.counts[FORM_HEAD.unpack_from(entry)[1]] += 1

    def drop(self, head: bytes) -> None:
        """An arena entry (its first ``FORM_HEAD.size`` bytes or all of it, if
        shorter) is released: the form's last one frees its id."""
        if head[:1] != b"\0":
            return
        fid = FORM_HEAD.unpack_from(head)[1]
        left = self.counts[fid] - 1
        self.counts[fid] = left
        if left == 0:
            part = self.parts[fid]
            assert part is not None
            del self.ids[part]
            self.parts[fid] = None
            self.free.append(fid)

    def entry(self, name: bytes, intern: bool = True) -> bytes:
        """The arena entry of ``name``: by its form when that is known (or
        ``intern`` and there is room for it) and takes fewer granules, else
        ``name``."""
        runs = _RUN.findall(name)
        if not runs:
            return name
        run = max(runs, key=len)  # the first longest
        digits = len(run)
        if _granules(FORM_HEAD.size + (digits + 1) // 2) >= _granules(len(name)):
            return name
        start = name.find(run)  # (any occurrence lies in a run as long: this one)
        end = start + digits
        key = (name[:start], name[end:])
        fid = self.ids.get(key)
        if fid is None:
            if not intern or len(self.ids) >= MAX_FORMS:
                return name
            h = hash(key)
            if h not in self.seen:
                if len(self.seen) >= MAX_SEEN:
                    self.seen.clear()
                self.seen.add(h)
                return name
            self.seen.discard(h)
            if self.free:
                fid = self.free.pop()
                self.parts[fid] = key
            else:
                fid = len(self.parts)
                self.parts.append(key)
                self.counts.append(0)
            self.ids[key] = fid
        return FORM_HEAD.pack(0, fid, digits) + unhexlify(run + b"0" if digits & 1 else run)

    def name(self, entry: bytes) -> bytes:
        """The name an arena entry holds."""
        if entry[:1] != b"\0":
            return entry
        _, fid, digits = FORM_HEAD.unpack_from(entry)
        part = self.parts[fid] if fid < len(self.parts) else None
        if part is None:  # a damaged image: EIO, never another name
            raise Corruption(f"a name of form {fid}, which is not in use")
        prefix, suffix = part
        whole: bytes = prefix + hexlify(entry[FORM_HEAD.size :])[:digits] + suffix
        return whole
