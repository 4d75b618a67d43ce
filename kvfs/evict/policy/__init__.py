"""Eviction policies: pure, synchronous bookkeeping of which files to evict first.

A policy never does I/O and never evicts anything itself.  The interface follows
CacheLib Navy's ``EvictionPolicy`` (track / touch / evict / reset / persist /
recover); the store reports events and asks for an order:

- ``track(key, size, stream)``: a file was written (created, or its size changed);
- ``touch(key, stream)``: a file was opened or read;
- ``remove(key)``: a file is gone (unlinked, evicted or forgotten);
- ``victims()``: keys in eviction order, best victim first (Navy's ``evict``, as an
  iterator, because the store may skip a victim that is open);
- ``reset()``, ``persist()``, ``recover(image)``: forget everything; encode the whole
  state; replace it by an encoded one (``docs/format.md``, "Eviction policy image").

Keys are non-negative ints (inode numbers), sizes are bytes and ``stream`` is any
hashable naming the accessing process and directory, e.g. ``(pid, dir_ino)``.
Every call is O(1) amortized (``victims()`` is O(1) per yielded key) and none awaits,
so under trio a sequence of calls is atomic.

One policy per module: :mod:`~kvfs.evict.policy.lru`, :mod:`~kvfs.evict.policy.fifo`,
:mod:`~kvfs.evict.policy.prefix` (``"kvfs"``, the prefix-aware segmented policy),
:mod:`~kvfs.evict.policy.prefix_lru` (``"prefix-lru"``) and :mod:`~kvfs.evict.policy.adaptive`
(``"adaptive"``, which follows the better of the last two); the slot table they
share is :mod:`~kvfs.evict.slots` and the image codec :mod:`~kvfs.format.policy_image`.  Design and
measurements: ``docs/eviction.md``.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "AdaptivePolicy",
    "EvictionPolicy",
    "FIFOPolicy",
    "KvfsPolicy",
    "LRUPolicy",
    "PolicyStatistics",
    "PrefixLRUPolicy",
    "make_policy",
]


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
    """The uniform verbs every eviction policy implements (see module docstring)."""

    name: str

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record that ``key`` was written with ``size`` bytes by ``stream``."""

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read of ``key`` by ``stream``; unknown keys are ignored."""

    def remove(self, key: int) -> None:
        """Forget ``key``; unknown keys are ignored.  O(1)."""

    def victims(self) -> Iterator[int]:
        """Yield tracked keys best victim first; ``remove()`` of the yielded key is allowed."""

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def statistics(self) -> PolicyStatistics:
        """Return a snapshot of the counters."""

    def reset(self) -> None:
        """Forget every key and counter."""

    def persist(self) -> bytes:
        """Encode the whole state (order, sizes, learned chains) as bytes."""

    def recover(self, data: bytes) -> None:
        """Replace the state by one from ``persist()``; raise ValueError on bad data."""

    def keys(self) -> set[int]:
        """Return the tracked keys (a new set, in no particular order)."""

    def remove_many(self, keys: Collection[int]) -> None:
        """``remove()`` each of ``keys`` in the order a fresh ``victims()`` lists them
        (what collecting them from ``victims()`` and then removing them does)."""

    def take_ghost(self, key: int) -> int | None:
        """Hand over what the policy remembers of the gone ``key`` (its ghost, a
        remembered eviction) as one opaque int, and forget it under ``key``; None if
        nothing is kept. On a mount a chunk written again after its eviction is a
        new inode, and the gone inode's number goes to whatever file comes next: the
        evictor takes the ghost when a file goes, keeps it under the file's name and
        puts it back (:meth:`put_ghost`) when a file of that name is written, after
        taking (and dropping) whatever is still kept under the new file's number: it
        was another file's. Without that no ghost ever hits on a mount, and a reused
        number hits another file's."""

    def put_ghost(self, key: int, ghost: int) -> None:
        """``key`` (holding no state) is the gone file that ``take_ghost`` handed over
        (the same chunk written again under its name): remember ``ghost`` for it."""

    def persist_pieces(self) -> Iterator[bytes]:
        """Freeze the state now and return an iterator over the pieces of its image
        (``persist()`` is their concatenation), encoded as they are consumed."""

    def recover_pieces(self, pieces: list[bytes]) -> None:
        """``recover`` of an image given as the pieces ``persist_pieces`` yielded."""

    def adopt(
        self, keys: array[int], sizes: array[int], spans: list[tuple[int, int]] | None = None
    ) -> None:
        """``track(key, size, None)`` for each of ``keys`` (distinct, untracked) in
        order, in bulk where the policy can (a first mount)."""

    def resident_mask(self, n: int) -> bytes | None:
        """``n`` bytes, 1 where key ``i`` is tracked; None if the policy cannot say
        at C speed (the caller then uses ``keys()``)."""

    def recover_foreign(self, data: bytes) -> bool:
        """Adopt what it can from another policy's valid image (resident keys, their
        sizes and order); return False, changing nothing, if it cannot.  ``recover``
        is tried first: this is for an image of another kind (e.g. a pool written
        when another policy was the default)."""


# The policies import the names above from this package: import them last.
from kvfs.evict.policy.adaptive import AdaptivePolicy  # noqa: E402
from kvfs.evict.policy.fifo import FIFOPolicy  # noqa: E402
from kvfs.evict.policy.lru import LRUPolicy  # noqa: E402
from kvfs.evict.policy.prefix import KvfsPolicy  # noqa: E402
from kvfs.evict.policy.prefix_lru import PrefixLRUPolicy  # noqa: E402

_FACTORIES: dict[str, type[EvictionPolicy]] = {
    "kvfs": KvfsPolicy,
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "prefix-lru": PrefixLRUPolicy,
    "adaptive": AdaptivePolicy,
}
POLICY_NAMES = tuple(_FACTORIES)
DEFAULT_POLICY = "adaptive"
"""The policy of a mount that names none (``kvfs mount --eviction``)."""


def make_policy(name: str) -> EvictionPolicy:
    """Return a new policy by name (one of ``POLICY_NAMES``); ValueError otherwise."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {POLICY_NAMES}")
    return factory()
