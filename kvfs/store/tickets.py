"""Tickets: what an open of a file allows an aware client to move through the
daemon's ring (:mod:`kvfs.store.ring`), and nothing more.

The mount hands out a ticket with a map (``user.kvfs.direct.map``) or a reservation
(``user.kvfs.direct.reserve.*``) asked through a handle the caller opened: 16
unguessable bytes (the daemon's keyed BLAKE2b of a counter) bound to that handle,
its user, the file's runs on the devices and, for a read, every unit's checksum. A
ticket is the only thing a ring request names, so a client reaches exactly the units
its own open was given:

- a read ticket reads the units of the map it came with (a lease, as for a client that
  opens the devices itself, :mod:`kvfs.store.leases`), verified against its checksums;
- a write ticket writes the units reserved for its handle, and the daemon computes
  their checksums itself (a client cannot make later reads trust bytes it did not
  write);
- a ticket dies with its handle (the last close, a killed client's too) and a write
  ticket at its commit; a request on a dead ticket fails (EBADF) before any I/O.

Requests run on the ring's threads while the store runs on the trio thread, so the
table and each ticket's count of requests in flight are guarded by locks. Units a
dead ticket may still be writing are freed only once its last request is done
(:meth:`Ticket.retire`): a late device write can never land in units given to
another file.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfs.format.ring import TICKET_BYTES

READ = "read"
WRITE = "write"


@dataclass(frozen=True)
class Run:
    """Units ``first`` .. ``first + n - 1`` of the file: ``length`` bytes at byte
    ``offset`` of member ``device`` (a fragment tail stores fewer than a unit)."""

    device: int
    offset: int
    length: int
    first: int
    n: int


@dataclass(eq=False)
class Ticket:
    token: bytes
    kind: str
    fh: int
    ino: int
    uid: int
    size: int
    unit: int
    runs: tuple[Run, ...]
    csums: tuple[int, ...] = ()
    """A read ticket's: each unit's checksum, as the map said."""
    sums: list[int] = field(default_factory=list)
    """A write ticket's: each unit's checksum, as the daemon wrote it (0 until then)."""
    written: bytearray = field(default_factory=bytearray)
    """A write ticket's: 1 for each unit the daemon has written."""
    inflight: int = 0
    dead: bool = False
    _then: Callable[[], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.kind == WRITE:
            n = -(-self.size // self.unit)
            self.sums = [0] * n
            self.written = bytearray(n)

    def enter(self) -> bool:
        """One more request in flight; False if the ticket is dead."""
        with self._lock:
            if self.dead:
                return False
            self.inflight += 1
            return True

    def leave(self) -> Callable[[], None] | None:
        """A request is done; what to run now that the last request of a dead ticket
        is done (see :meth:`retire`), else None."""
        with self._lock:
            self.inflight -= 1
            if self.dead and self.inflight == 0 and self._then is not None:
                then, self._then = self._then, None
                return then
            return None

    def retire(self, then: Callable[[], None] | None = None) -> bool:
        """Kill the ticket: no request starts on it any more. ``then`` runs once no
        request is in flight: now (True is returned) or when the last one finishes
        (False; on the thread that finishes it, so ``then`` must be thread-safe)."""
        with self._lock:
            self.dead = True
            if self.inflight == 0:
                idle = True
            else:
                idle = False
                self._then = then
        if idle and then is not None:
            then()
        return idle

    def finish_write(self) -> list[int] | None:
        """At the commit: kill the ticket and return the units' checksums, or None when
        a request is still in flight or a unit was never written."""
        with self._lock:
            if self.inflight or not all(self.written):
                return None
            self.dead = True
            return list(self.sums)


class Tickets:
    """The live tickets of one mount, by token (and by handle, to kill them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_token: dict[bytes, Ticket] = {}
        self._by_fh: dict[int, list[Ticket]] = {}
        self.issued = 0  # and the counter the tokens are made of
        self._key = secrets.token_bytes(32)  # this daemon's: tokens are its keyed
        # BLAKE2b of a counter, unguessable without it and never repeated

    def _token(self, n: int) -> bytes:
        """Token number ``n``: a PRF of the counter, not ``os.urandom`` per ticket (a
        system call that lets the GIL go on the trio thread, per file, while the I/O
        threads want it)."""
        return hashlib.blake2b(
            n.to_bytes(8, "little"), key=self._key, digest_size=TICKET_BYTES
        ).digest()

    def issue(
        self,
        kind: str,
        fh: int,
        ino: int,
        uid: int,
        size: int,
        unit: int,
        runs: list[Run],
        csums: list[int] | None = None,
    ) -> Ticket:
        with self._lock:
            self.issued += 1
            t = Ticket(
                self._token(self.issued), kind, fh, ino, uid, size, unit,
                tuple(runs), tuple(csums or ()),
            )  # fmt: skip
            self._by_token[t.token] = t
            self._by_fh.setdefault(fh, []).append(t)
        return t

    def find(self, token: bytes, uid: int) -> Ticket | None:
        """The live ticket ``token`` if user ``uid`` may use it (its own user's, or
        root's: a root daemon's helper may act for others), else None."""
        with self._lock:
            t = self._by_token.get(token)
        if t is None or t.dead or (uid != t.uid and uid != 0):
            return None
        return t

    def drop(self, t: Ticket) -> None:
        """Forget ``t`` (it is dead: committed, or its handle closed)."""
        with self._lock:
            self._by_token.pop(t.token, None)
            mine = self._by_fh.get(t.fh)
            if mine is not None:
                if t in mine:
                    mine.remove(t)
                if not mine:
                    del self._by_fh[t.fh]

    def of_handle(self, fh: int) -> list[Ticket]:
        with self._lock:
            return list(self._by_fh.get(fh, ()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_token)
