"""The aware client's wire protocol: the xattr names through which a process that may
open the pool's devices (:mod:`kvfs.client.direct`) and the mount
(:mod:`kvfs.store.leases`) exchange extent maps, reservations and commits
(``docs/design.md``, "The direct path"). Both sides import them from here, so neither
imports the other."""

from __future__ import annotations

PREFIX = "user.kvfs.direct."
"""Every name of the protocol starts with this."""
MAP = PREFIX + "map"
"""getxattr: the open file's extent map (a lease)."""
RESERVE = PREFIX + "reserve."
"""getxattr of ``RESERVE + "<size>.<nonce>"``: room for a new file's bytes."""
COMMIT = PREFIX + "commit"
"""setxattr of ``{"nonce", "csums"}`` (JSON): the reserved bytes are written."""
VERSION = 1
"""The version every answer of the mount carries (its ``v`` field)."""
