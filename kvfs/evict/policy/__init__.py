"""Eviction policies: pure, synchronous bookkeeping of which files to evict first,
and their registry (:func:`make_policy`, :data:`POLICY_NAMES`, :data:`DEFAULT_POLICY`).

What a policy answers is :class:`~kvfs.evict.policy.protocol.EvictionPolicy` (after
CacheLib Navy's ``EvictionPolicy``: track / touch / remove / victims / reset /
persist / recover / statistics); :class:`~kvfs.evict.policy.protocol.Policy` is the
base every policy here derives from, which also answers the evictor's bulk and
whole-image questions. The evictor (:mod:`kvfs.evict.evictor`) reports events to it
and asks it for an order; the eviction driver evicts.

One policy per module: :mod:`~kvfs.evict.policy.lru`, :mod:`~kvfs.evict.policy.fifo`,
:mod:`~kvfs.evict.policy.prefix` (``"kvfs"``, the prefix-aware segmented policy),
:mod:`~kvfs.evict.policy.prefix_lru` (``"prefix-lru"``) and :mod:`~kvfs.evict.policy.adaptive`
(``"adaptive"``, which follows the better of the last two); what the slot-table
policies share is :mod:`~kvfs.evict.policy.base`, their slot table
:mod:`~kvfs.evict.slots` and the image codec :mod:`~kvfs.format.policy_image`. Design
and measurements: ``docs/eviction.md``.
"""

from __future__ import annotations

from kvfs.evict.policy.adaptive import AdaptivePolicy
from kvfs.evict.policy.fifo import FIFOPolicy
from kvfs.evict.policy.lru import LRUPolicy
from kvfs.evict.policy.prefix import KvfsPolicy
from kvfs.evict.policy.prefix_lru import PrefixLRUPolicy
from kvfs.evict.policy.protocol import EvictionPolicy, Policy, PolicyStatistics

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "AdaptivePolicy",
    "EvictionPolicy",
    "FIFOPolicy",
    "KvfsPolicy",
    "LRUPolicy",
    "Policy",
    "PolicyStatistics",
    "PrefixLRUPolicy",
    "make_policy",
]

_FACTORIES: dict[str, type[Policy]] = {
    "kvfs": KvfsPolicy,
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "prefix-lru": PrefixLRUPolicy,
    "adaptive": AdaptivePolicy,
}
POLICY_NAMES = tuple(_FACTORIES)
DEFAULT_POLICY = "adaptive"
"""The policy of a mount that names none (``kvfs mount --eviction``)."""


def make_policy(name: str) -> Policy:
    """Return a new policy by name (one of ``POLICY_NAMES``); ValueError otherwise."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {POLICY_NAMES}")
    return factory()
