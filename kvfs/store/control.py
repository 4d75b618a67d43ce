"""The mount's control xattrs on its root: names the daemon answers itself, never
stored. Here, below both the FUSE adapter that serves them and the commands that use
them (``kvfs stats``), so that neither imports the other."""

from __future__ import annotations

STATS_XATTR = b"user.kvfs.stats"
"""Read-only xattr on the root: the mount's statistics as JSON (``kvfs stats``)."""
CHECKPOINT_XATTR = b"user.kvfs.checkpoint"
"""Write-only xattr on the root, for root or the daemon's user: setting it (any value)
starts a metadata checkpoint and returns at once (tests, ``tools/ckptlatency.py``)."""

__all__ = ["CHECKPOINT_XATTR", "STATS_XATTR"]
