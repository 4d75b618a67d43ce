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
import struct
from binascii import hexlify, unhexlify

from kvfs.format.nsparts import GRANULE

FORM_HEAD = struct.Struct("<BHB")
"""0 (no name starts with NUL), the form's id, the count of hex digits."""
MAX_FORMS = 1 << 16
"""Form ids are 16 bits; past that many distinct forms, new names are kept whole.
A form costs ~0.2 KiB of the daemon's memory, so the table is at most ~13 MiB."""
MAX_SEEN = 1 << 16
"""Forms seen once, remembered (~4 MiB at most)."""
_RUN = re.compile(rb"[0-9a-f]+")


def _granules(n: int) -> int:
    return -(-n // GRANULE)


class NameForms:
    """The pool's interned forms (prefix, suffix) by id, and a name's entry."""

    __slots__ = ("ids", "parts", "seen")

    def __init__(self) -> None:
        self.parts: list[tuple[bytes, bytes]] = []
        self.ids: dict[tuple[bytes, bytes], int] = {}
        self.seen: set[int] = set()
        """Hashes of forms stored once, whole (a form is interned at its second
        name: names that share nothing but their digits, ``<hash>-<seq>``, never
        fill the table); forgotten at ``MAX_SEEN``."""

    def __len__(self) -> int:
        return len(self.parts)

    def add(self, prefix: bytes, suffix: bytes) -> None:
        """Intern a form loaded from an image, as the next id."""
        self.ids[prefix, suffix] = len(self.parts)
        self.parts.append((prefix, suffix))

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
            if not intern or len(self.parts) >= MAX_FORMS:
                return name
            h = hash(key)
            if h not in self.seen:
                if len(self.seen) >= MAX_SEEN:
                    self.seen.clear()
                self.seen.add(h)
                return name
            self.seen.discard(h)
            fid = self.ids[key] = len(self.parts)
            self.parts.append(key)
        return FORM_HEAD.pack(0, fid, digits) + unhexlify(run + b"0" if digits & 1 else run)

    def name(self, entry: bytes) -> bytes:
        """The name an arena entry holds."""
        if entry[:1] != b"\0":
            return entry
        _, fid, digits = FORM_HEAD.unpack_from(entry)
        prefix, suffix = self.parts[fid]
        whole: bytes = prefix + hexlify(entry[FORM_HEAD.size :])[:digits] + suffix
        return whole
