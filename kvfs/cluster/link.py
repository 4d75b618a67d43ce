"""The node's link to the Mooncake master: every client call runs in a worker thread
under a deadline, and a failed or late call marks the link down; the prober connects,
and reconnects while down, every ``retry`` seconds (``docs/cluster.md``, "Failure").
Runs on the trio thread, as the store does."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

import trio

from kvfs.cluster.client import TRANSPORT_ERRORS, Client, ClusterError
from kvfs.cluster.config import ClusterConfig
from kvfs.cluster.statistics import ClusterStatistics

log = logging.getLogger(__name__)
T = TypeVar("T")


class Link:
    """Up or down, with the client while there is one. ``on_down`` is told when the
    link goes down (the tier forgets what it cached of the cluster)."""

    def __init__(
        self,
        cfg: ClusterConfig,
        connect: Callable[[ClusterConfig], Client],
        stats: ClusterStatistics,
        on_down: Callable[[], None],
    ) -> None:
        self.cfg, self._connect, self.stats, self._on_down = cfg, connect, stats, on_down
        self.client: Client | None = None
        self.up = False
        self._limiter = trio.CapacityLimiter(2 * cfg.workers + 4)
        self._wake_prober = trio.Event()
        self._closing = False

    def stop(self) -> None:
        """No more calls nor reconnects; the client is left as it is (see
        :data:`kvfs.cluster.client._KEPT`)."""
        self._closing = True
        self.up = False
        self.client = None

    async def call(self, fn: Callable[[], T], deadline: float) -> T:
        """A client call in a worker thread; a late or failed transport marks the tier
        down (ClusterError)."""
        if not self.up or self.client is None:
            raise ClusterError("cluster down")
        with trio.move_on_after(deadline):
            try:
                return await trio.to_thread.run_sync(
                    fn, limiter=self._limiter, abandon_on_cancel=True
                )
            except Exception as e:  # the binding raised: treat as a transport failure
                self.down(f"{type(e).__name__}: {e}")
                raise ClusterError(str(e)) from None
        self.down(f"a call missed its {deadline:g} s deadline")
        raise ClusterError("deadline")

    def check(self, rc: int, what: str) -> int:
        if rc in TRANSPORT_ERRORS:
            self.down(f"{what}: error {rc}")
            raise ClusterError(f"{what}: {rc}")
        return rc

    def down(self, reason: str) -> None:
        if self.up:
            self.up = False
            self.stats.failures += 1
            log.warning(
                "cluster %s unreachable (%s): serving local data only, retrying every %g s",
                self.cfg.master,
                reason,
                self.cfg.retry,
            )
            self._on_down()
            self._wake_prober.set()

    async def run_prober(self) -> None:
        """Connect, and reconnect while down: a new client when there is none, a
        health check of the one there is otherwise (Mooncake's client reconnects by
        itself once its master is back)."""
        while not self._closing:
            if not self.up:
                await self._try_connect()
            if self.up:
                self._wake_prober = trio.Event()
                with trio.move_on_after(5 * self.cfg.retry):
                    await self._wake_prober.wait()
                if self.up:
                    await self._health()
            await trio.sleep(self.cfg.retry)  # down (just now, or still): not at once

    def _probe(self) -> int:
        """0 when the master answers (in a worker thread): the client's health check
        alone stayed 0 for seconds after its master was killed, so an existence check
        of one key makes the round trip too."""
        client = self.client
        if client is None:
            return -1
        rc = client.health()
        if rc != 0:
            return rc
        found = client.exist([f"{self.cfg.namespace}/probe"])
        return found[0] if found and found[0] < 0 else 0

    async def _try_connect(self) -> None:
        try:
            with trio.fail_after(max(10.0, 5 * self.cfg.timeout)):
                if self.client is None:
                    cfg, connect = self.cfg, self._connect
                    self.client = await trio.to_thread.run_sync(
                        lambda: connect(cfg), abandon_on_cancel=True
                    )
                rc = await trio.to_thread.run_sync(self._probe, abandon_on_cancel=True)
        except Exception as e:  # unreachable, refused, late: try again later
            if self.stats.reconnects == 0 and self.stats.failures == 0:
                log.warning("cluster %s not reachable yet (%s); retrying", self.cfg.master, e)
                self.stats.failures += 1
            return
        if rc == 0 and not self._closing:
            self.up = True
            self.stats.reconnects += 1
            log.info("cluster %s up (node %s)", self.cfg.master, self.cfg.local or "auto")

    async def _health(self) -> None:
        client = self.client
        if client is None:
            return
        with contextlib.suppress(ClusterError):  # call marked the tier down
            rc = await self.call(self._probe, self.cfg.timeout)
            if rc != 0:
                self.down(f"health check: error {rc}")
