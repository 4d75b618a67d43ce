"""``--cluster mooncake://HOST:PORT?metadata=URL&knob=value...``: the tier's settings,
parsed and checked once (a bad URL is one line of UserError), and the key scheme."""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass
from typing import Any

from kvfs.common import sizes
from kvfs.common.errors import UserError

SCHEME = "mooncake"
PUBLISH_MODES = ("on-close", "on-evict")


@dataclass
class ClusterConfig:
    """``--cluster mooncake://HOST:PORT?metadata=URL&knob=value...``"""

    master: str
    metadata: str
    segment: int = 512 << 20
    """Memory this node lends to the store (Mooncake's global segment)."""
    buffer: int = 128 << 20
    """The client's transfer buffer: an object (a part of a file) must fit in it."""
    part: int = 0
    """Largest object a file is cut into (default: a quarter of ``buffer``)."""
    publish: str = "on-close"
    timeout: float = 1.0
    """Deadline of a metadata call (existence, header, delete), seconds."""
    fetch_timeout: float = 10.0
    """Deadline of fetching one file's bytes, seconds."""
    negative: float = 2.0
    """Seconds a cluster miss is trusted (kvfs's own cache and the kernel's entry)."""
    retry: float = 1.0
    """Seconds between reconnection attempts while the cluster is down."""
    queue: int = 256
    """Publishes and deletes waiting at most; more are dropped (counted)."""
    workers: int = 4
    namespace: str = "kvfs"
    protocol: str = "tcp"
    device: str = ""
    local: str = ""
    """This node's address for the transfer engine (default: the one that reaches the
    master): its name in the cluster and the address it announces to peers."""

    def __post_init__(self) -> None:
        if not self.part:
            self.part = max(1 << 20, self.buffer // 4)
        if self.part > self.buffer:
            raise UserError(f"--cluster: part={self.part} is larger than buffer={self.buffer}")
        if self.publish not in PUBLISH_MODES:
            raise UserError(f"--cluster: publish must be one of {', '.join(PUBLISH_MODES)}")
        for name in ("timeout", "fetch_timeout", "negative", "retry"):
            if getattr(self, name) <= 0:
                raise UserError(f"--cluster: {name} must be positive")
        if self.queue < 1 or self.workers < 1:
            raise UserError("--cluster: queue and workers must be at least 1")

    def key(self, kind: str, path: bytes) -> str:
        """The Mooncake key of ``path``'s object ``kind`` (``f`` its header, ``p<i>``
        its parts, ``d`` a directory's marker), in this node's namespace."""
        quoted = urllib.parse.quote_from_bytes(path, safe="/@-_.~+=,:")
        return f"{self.namespace}/{kind}/{quoted}"


_SIZES = {"segment", "buffer", "part"}
_SECONDS = {"timeout", "fetch_timeout", "negative", "retry"}
_INTS = {"queue", "workers"}
_STRINGS = {"metadata", "publish", "namespace", "protocol", "device", "local"}


def parse_url(url: str) -> ClusterConfig:
    """``mooncake://HOST:PORT?metadata=URL[&knob=value...]`` -> the config (UserError
    with one line for anything else)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != SCHEME or not parts.netloc:
        raise UserError(f"--cluster {url!r}: expected {SCHEME}://MASTER_HOST:PORT?metadata=URL")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise UserError(f"--cluster {url!r}: the master needs HOST:PORT")
    values: dict[str, Any] = {}
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        key = key.replace("-", "_")
        try:
            if key in _SIZES:
                values[key] = sizes.parse_size(value)
            elif key in _SECONDS:
                values[key] = _seconds(value)
            elif key in _INTS:
                values[key] = int(value)
            elif key in _STRINGS:
                values[key] = value
            else:
                known = ", ".join(sorted(_SIZES | _SECONDS | _INTS | _STRINGS))
                raise UserError(f"--cluster: unknown knob {key!r} (known: {known})")
        except (ValueError, sizes.SizeError) as e:
            raise UserError(f"--cluster: {key}={value!r}: {e}") from None
    if not values.get("metadata"):
        raise UserError(f"--cluster {url!r}: needs ?metadata=URL (the metadata server)")
    return ClusterConfig(master=f"{parts.hostname}:{port}", **values)


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("not a positive number of seconds")
    return value
