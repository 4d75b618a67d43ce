"""What an eviction policy answers (:class:`EvictionPolicy`), and what every policy
offers the evictor beyond it with generic defaults (:class:`Policy`).

A policy is pure, synchronous bookkeeping of which files to evict first: it never
does I/O and never evicts anything itself. The protocol follows CacheLib Navy's
``EvictionPolicy`` (track / touch / evict / remove / reset / persist / recover /
statistics): the evictor reports events and asks for an order. Keys are
non-negative ints (inode numbers), sizes are bytes and ``stream`` is any hashable
naming the accessing process and directory, e.g. ``(pid, dir_ino)``. Every call is
O(1) amortized (``victims()`` is O(1) per yielded key) and none awaits, so under
trio a sequence of calls is atomic.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvfs.format import policy_image as img


@dataclass(frozen=True)
class PolicyStatistics:
    """Counters of one policy; segment fields are 0 for policies without segments."""

    name: str
    keys: int
    bytes: int
    probation_keys: int
    main_keys: int
    main_bytes: int
    dead_keys: int
    ghost_keys: int
    tracks: int
    touches: int
    removes: int
    promotions: int
    chain_links: int
    horizon: int


@runtime_checkable
class EvictionPolicy(Protocol):
    """What a policy must answer: events in, an eviction order and its state out."""

    name: str
    """The policy's name (``kvfs mount --eviction``)."""

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """A file was written (created, or its size changed): ``size`` bytes by ``stream``."""

    def touch(self, key: int, stream: Hashable) -> None:
        """A file was opened or read by ``stream``; unknown keys are ignored."""

    def remove(self, key: int) -> None:
        """A file is gone (unlinked, evicted or forgotten); unknown keys are ignored."""

    def victims(self) -> Iterator[int]:
        """Tracked keys best victim first (Navy's ``evict``, lazily: the evictor may
        skip an open file); ``remove()`` of the yielded key is allowed."""

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""

    def __len__(self) -> int:
        """How many keys are tracked."""

    def statistics(self) -> PolicyStatistics:
        """A snapshot of the counters."""

    def reset(self) -> None:
        """Forget every key and counter."""

    def persist_pieces(self) -> Iterator[bytes]:
        """Freeze the state now and return an iterator over the pieces of its image
        (``docs/format.md``, "Eviction policy image"), encoded as they are consumed."""

    def recover_pieces(self, pieces: list[bytes]) -> None:
        """Replace the state by the image ``persist_pieces`` yielded; ValueError on
        bad data, and then nothing changed."""


class Policy(EvictionPolicy):
    """The base of every policy: the protocol's verbs (each policy's own), and what
    the evictor also asks at mount and checkpoint, answered here from those verbs
    (a policy overrides what it can do faster, or knows more about). Not part of the
    protocol: a policy needs none of it to be one."""

    # -- beyond the protocol: whole images, bulk calls, ghosts -------------------------

    def persist(self) -> bytes:
        """The image :meth:`persist_pieces` yields, joined."""
        return b"".join(self.persist_pieces())

    def recover(self, data: bytes) -> None:
        """:meth:`recover_pieces` of a joined image (a policy that read older
        versions of its image reads them here too)."""
        self.recover_pieces(img.split_pieces(data))

    def recover_foreign(self, data: bytes) -> bool:
        """Adopt what it can from another policy's valid image (resident keys, their
        sizes and order); return False, changing nothing, if it cannot. ``recover``
        is tried first: this is for an image of another kind (e.g. a pool written
        when another policy was the default). Here: nothing."""
        return False

    def keys(self) -> set[int]:
        """The tracked keys (a new set, in no particular order)."""
        return set(self.victims())

    def resident_mask(self, n: int) -> bytes | None:
        """``n`` bytes, 1 where key ``i`` is tracked; None if the policy cannot say
        at C speed (the caller then uses ``keys()``). Here: None."""
        return None

    def adopt(
        self, keys: array[int], sizes: array[int], spans: list[tuple[int, int]] | None = None
    ) -> None:
        """``track(key, size, None)`` for each of ``keys`` (distinct, untracked) in
        order, in bulk where the policy can (a first mount); ``spans``: the runs of
        consecutive keys (``slots.runs(keys)``), if the caller knows them."""
        for key, size in zip(keys, sizes, strict=True):
            self.track(key, size, None)

    def remove_many(self, keys: Collection[int]) -> None:
        """``remove()`` each of ``keys`` in the order a fresh ``victims()`` lists them
        (what collecting them from ``victims()`` and then removing them does)."""
        for key in [k for k in self.victims() if k in keys]:
            self.remove(key)

    def identify(self, key: int, chunk: int) -> None:
        """The file ``key`` holds chunk ``chunk`` now (a non-negative id that stays
        the same when the chunk is written again as another inode: on a mount, its
        name's hash), told before each ``track`` and ``touch`` of a mounted file.
        A policy that compares what other orders would have held across rewrites
        keys that comparison by it (``adaptive``'s shadows); here: nothing."""

    def take_ghost(self, key: int) -> int | None:
        """Hand over what the policy remembers of the gone ``key`` (its ghost, a
        remembered eviction) as one opaque int, and forget it under ``key``; None if
        nothing is kept (here: no ghosts). On a mount a chunk written again after its
        eviction is a new inode, and the gone inode's number goes to whatever file
        comes next: the evictor takes the ghost when a file goes, keeps it under the
        file's name and puts it back (:meth:`put_ghost`) when a file of that name is
        written, after taking (and dropping) whatever is still kept under the new
        file's number: it was another file's. Without that no ghost ever hits on a
        mount, and a reused number hits another file's."""
        return None

    def put_ghost(self, key: int, ghost: int) -> None:
        """``key`` (holding no state) is the gone file that ``take_ghost`` handed over
        (the same chunk written again under its name): remember ``ghost`` for it
        (here: nothing)."""
