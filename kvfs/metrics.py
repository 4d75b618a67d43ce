"""Prometheus metrics of a mounted pool (being written): ``kvfs mount --metrics``."""

from __future__ import annotations

import socket
from typing import Any

from kvfs.errors import UserError


class Exporter:
    """A bound listening socket; :meth:`serve` answers ``/metrics`` on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def serve(self, store: Any, ops: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()


def bind(address: str) -> Exporter:
    raise UserError("--metrics is not written yet")
