"""What the cluster tier counts (``kvfs stats``' ``cluster``, the ``kvfs_cluster_*``
metrics read these names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ClusterStatistics:
    state: str = "connecting"
    master: str = ""
    publish_mode: str = ""
    hits: int = 0
    """Lookups answered by fetching a file (or directory) from the cluster."""
    misses: int = 0
    """Lookups the cluster was asked and did not have."""
    negative_hits: int = 0
    """Lookups answered from the cache of recent cluster misses."""
    skipped_down: int = 0
    """Local misses not asked because the cluster was down."""
    fetch_failed: int = 0
    """Fetches that failed: unreachable, late, or bytes that did not verify."""
    checksum_failures: int = 0
    bytes_fetched: int = 0
    published: int = 0
    bytes_published: int = 0
    publish_dropped: int = 0
    publish_skipped: int = 0
    """Queued files that changed, went or could not be read before their turn."""
    publish_failed: int = 0
    publish_queue: int = 0
    """Publishes and deletes queued or being sent."""
    deleted: int = 0
    delete_failed: int = 0
    failures: int = 0
    """Times the cluster went down."""
    reconnects: int = 0
    fetch_seconds: dict[str, Any] = field(default_factory=dict)
    publish_seconds: dict[str, Any] = field(default_factory=dict)
