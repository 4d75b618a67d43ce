"""The Mooncake Store client as the tier uses it: what kvfs needs of it
(:class:`Client`), the real one set up for this node (:class:`MooncakeClient`), the
error codes kvfs reads, and why the client is never closed (:data:`_KEPT`).

The client is blocking C++: the tier calls it only from worker threads that a deadline
abandons (:mod:`kvfs.cluster.link`)."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Sequence
from typing import Any, Protocol

from kvfs.cluster.config import ClusterConfig
from kvfs.common.errors import KvfsError, UserError

TCP_ANNOUNCE_ENV = "MC_TCP_BIND_ADDRESS"
"""Mooncake's transfer engine (0.3.x, its "new RPC mapping") announces this address to
peers; only the address, its listeners bind the wildcard whatever it says."""

# Mooncake's error codes (mooncake-store/include/types.h) that kvfs reads
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSPORT_ERRORS = range(-999, -899)  # RPC_FAIL and its kin: the master is unreachable


_KEPT: list[Any] = []
"""Every Mooncake store set up in this process, referenced until the process ends.
Its ``close()``, its destructor and the teardown it registers with ``atexit`` all
unregister the node at the master and join the client's heartbeat thread while
holding the interpreter lock: with the master dead that froze the daemon for 13 s
(the thread retries the master) after its unmount. So kvfs never closes it: the
mount command ends the process with ``os._exit`` once the unmount is done (see
:func:`clients_made`), and the master drops the node's segment when the client's
lease there ends (its ``client_ttl``)."""


def clients_made() -> bool:
    """Whether a Mooncake client was set up here: the process must then end with
    ``os._exit`` (after flushing what it writes), never through the interpreter's
    exit, which would destroy the client (see :data:`_KEPT`)."""
    return bool(_KEPT)


class ClusterError(KvfsError):
    """A cluster call failed or missed its deadline (the tier goes down)."""

    errno = errno.EIO


def check_client() -> None:
    """UserError (one line) when the Mooncake client cannot be imported here."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"--cluster needs the Mooncake client ({e}): pip install 'kvfs[cluster]' "
            "and apt-get install libibverbs1 librdmacm1 libnuma1"
        ) from None


def local_address(master: str) -> str:
    """The address of this host that routes to the master (no packet is sent)."""
    host = master.rsplit(":", 1)[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            addr: str = s.getsockname()[0]
            return addr
    except OSError:
        return "127.0.0.1"


class Client(Protocol):
    """What kvfs needs of a Mooncake Store client (blocking calls; rc < 0 = error)."""

    def exist(self, keys: Sequence[str]) -> list[int]: ...
    def get(self, key: str) -> bytes: ...
    def put(self, key: str, value: bytes) -> int: ...
    def remove(self, key: str) -> int: ...
    def health(self) -> int: ...


class MooncakeClient:
    """``mooncake.store.MooncakeDistributedStore``, set up for one node."""

    def __init__(self, cfg: ClusterConfig) -> None:
        from mooncake.store import (
            MooncakeDistributedStore,
        )

        # setup can hold the GIL while it retries an absent master (a daemon froze for
        # 90 s once): only once the master's port answers
        host, _, port = cfg.master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=cfg.timeout).close()
        except OSError as e:
            raise ClusterError(f"master {cfg.master}: {e}") from None
        local = cfg.local or local_address(cfg.master)
        # the transfer engine announces its RPC address from this variable, else from
        # the first interface that is not loopback, whatever local_hostname says
        os.environ.setdefault(TCP_ANNOUNCE_ENV, local)
        self._s = MooncakeDistributedStore()
        rc = self._s.setup(
            local, cfg.metadata, cfg.segment, cfg.buffer, cfg.protocol, cfg.device, cfg.master
        )
        if rc != 0:
            raise ClusterError(f"Mooncake setup with master {cfg.master} failed ({rc})")
        _KEPT.append(self._s)  # before anything can drop it (an abandoned connect)

    def exist(self, keys: Sequence[str]) -> list[int]:
        return list(self._s.batch_is_exist(list(keys)))

    def get(self, key: str) -> bytes:
        value: bytes = self._s.get(key)
        return value

    def put(self, key: str, value: bytes) -> int:
        rc: int = self._s.upsert(key, value)
        return rc

    def remove(self, key: str) -> int:
        rc: int = self._s.remove(key)
        return rc

    def health(self) -> int:
        rc: int = self._s.health_check()
        return rc
