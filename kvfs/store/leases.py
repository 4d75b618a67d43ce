"""The mount's side of the zero-copy path (:mod:`kvfs.client.direct` is the client's).

A client allowed to open the pool's devices moves a file's bytes itself, by O_DIRECT
on the raw devices; the mount only mediates the metadata, through xattrs of a file
the client holds open (``docs/design.md``, "The direct path"):

- ``getxattr(fd, "user.kvfs.direct.map")``: the file's extent map (JSON): for each
  run of units contiguous on one device its device, byte offset and length, and
  every unit's checksum. The map is a **lease**: a unit the file stops mapping (a
  rewrite, truncate or unlink) is kept from reuse until every handle that was open
  at the file's last map before that has closed (one of them may still be reading
  it), and the open handle keeps the file from eviction. A file with bytes only in
  memory (being written) answers EBUSY: the client reads it through the mount
  instead.
- ``getxattr(fd, "user.kvfs.direct.reserve.<size>.<nonce>")``: room for a new
  ``size``-byte file's bytes, allocated (evicting as a write would) and held by the
  writable handle the caller opened; the answer is where to write. Idempotent per
  nonce (the kernel may ask twice: once for the length).
- ``setxattr(fd, "user.kvfs.direct.commit", {"nonce", "csums"})``: the client wrote
  every reserved byte; the mount maps the units with the client's checksums, commits
  the file and returns once it is durable (a close's guarantee). A reservation that
  is never committed (the client failed, closed or was killed) is freed and its
  file is dropped at its last close: a crashed direct writer leaves nothing.

Trust: only a process that can open the devices can use any of this, and such a
process can read and write every byte of the pool anyway (root or the ``disk``
group); the xattrs give it nothing more. A client's checksums are what later reads
verify, so a client that wrote wrong bytes gets EIO, never wrong bytes.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvfs.common import aware
from kvfs.common.errors import (
    Busy,
    Corruption,
    Incomplete,
    InvalidArgument,
    KvfsError,
    NotPermitted,
    TooBig,
)
from kvfs.devices.alloc import Allocator
from kvfs.devices.device import member_id
from kvfs.devices.pool import Pool
from kvfs.evict.space import Space
from kvfs.format.records import (
    DEV_SHIFT,
    FLAG_QUARANTINED,
    FLAG_WRITING,
    NO_UNIT,
    extent,
    is_fragment,
    phys,
)
from kvfs.index.namespace import Inode, Namespace
from kvfs.log.journal import Journal
from kvfs.store.handles import Handles
from kvfs.store.posix import Caller
from kvfs.store.ring import RingStatistics
from kvfs.store.tickets import READ, WRITE, Run, Ticket, Tickets
from kvfs.store.types import FileState, check_failed
from kvfs.store.writer import Writer

log = logging.getLogger(__name__)

PREFIX = aware.PREFIX.encode()
MAP = aware.MAP.encode()
RESERVE = aware.RESERVE.encode()
COMMIT = aware.COMMIT.encode()
VERSION = aware.VERSION
MAX_REPLY = 65536
"""The kernel's largest xattr value (XATTR_SIZE_MAX): a map that does not fit is
E2BIG, and the client reads that file through the mount."""


@dataclass
class Reservation:
    ino: int
    nonce: bytes
    size: int
    plan: list[tuple[int, int, list[int]]]
    """(device, first unit or fragment field, logical units), as the write-back's."""
    reply: bytes
    ticket: Ticket | None = None
    """The ring's write ticket for it, if the mount serves a ring."""


@dataclass
class Lease:
    """A file mapped while open: who may still read which units it no longer maps."""

    upto: int = 0
    """The newest handle number at the file's last map: a handle opened later was
    not open then, so it holds no map of the units freed since."""
    held: list[tuple[int, list[int]]] = field(default_factory=list)
    """Units the file no longer maps, in batches by the ``upto`` when they were
    freed (oldest first): a batch is kept until no handle of the file numbered up
    to it is open."""


@dataclass
class DirectStatistics:
    maps: int
    reservations: int
    commits: int
    aborts: int
    bytes_mapped: int
    bytes_committed: int
    leased_files: int
    held_units: int
    """Units a leased file no longer maps, kept from reuse while a handle that may
    have mapped them is open."""
    tickets: int = 0
    """Live ring tickets (opens that may move bytes through the ring)."""
    ring: dict[str, float] = field(default_factory=dict)
    """The ring server's counters (:class:`kvfs.store.ring.RingStatistics`): its
    connections, requests, bytes and I/O threads' CPU seconds."""


class DirectPath:
    """Leases and reservations of one store (runs on the trio thread).

    It is given the store's parts it works on and the store's rules it follows as
    callbacks: ``check_readable`` raises for a file with data on a missing member,
    ``begin_change`` marks a file WRITING before its data changes, ``ensure_space``
    makes room for new units (may evict), ``commit`` makes a file durable (a close's
    guarantee)."""

    def __init__(
        self,
        pool: Pool,
        ns: Namespace,
        alloc: Allocator,
        journal: Journal,
        space: Space,
        handles: Handles,
        writer: Writer,
        files: dict[int, FileState],
        *,
        check_readable: Callable[[Inode], None],
        begin_change: Callable[[Inode], None],
        ensure_space: Callable[[Inode, int], Awaitable[None]],
        commit: Callable[[Inode, int], Awaitable[None]],
    ) -> None:
        self.pool, self.ns, self.alloc, self.journal = pool, ns, alloc, journal
        self.space, self.handles, self.writer, self._files = space, handles, writer, files
        self._check_readable = check_readable
        self._begin_change = begin_change
        self._ensure_space = ensure_space
        self._commit = commit
        self.unit = pool.unit_size
        self._leases: dict[int, Lease] = {}
        """Files mapped since their last close (by inode)."""
        self._reservations: dict[int, Reservation] = {}  # by handle
        self._devices = [self._describe(d) for d in pool.devices]
        self.tickets = Tickets()
        """What each open may move through the ring (:mod:`kvfs.store.tickets`)."""
        self.ring: str | None = None
        """The ring's socket, once :mod:`kvfs.store.ring` serves one: every answer
        names it, with a ticket for the caller's open."""
        self.soon: Callable[[Callable[[], None]], None] = lambda fn: fn()
        self.ring_stats: RingStatistics | None = None
        """The ring server's counters, while it serves."""
        """Runs a callback on the trio thread (from any thread); the ring sets it."""
        self._maps = self._commits = self._aborts = self._reserved = 0
        self._bytes_mapped = self._bytes_committed = 0

    @staticmethod
    def _describe(device: object) -> dict[str, object]:
        """What a client needs to open a member and make sure it opened that one."""
        path = str(getattr(device, "path", ""))
        fd = getattr(device, "fd", -1)
        if fd < 0:  # a missing member or an in-memory test device: not openable
            return {"path": path, "id": None, "direct": False}
        ident = member_id(os.fstat(fd))
        return {"path": path, "id": ident, "direct": bool(getattr(device, "direct", False))}

    def _reply(self, ino: int, **fields: Any) -> bytes:
        """An answer: the protocol version, unit size and members, then ``fields``."""
        info = {"v": VERSION, "unit": self.unit, "devices": self._devices, **fields}
        if self.ring is not None:
            info["ring"] = self.ring
            info["ring_writes"] = 1  # new files by path (kvfs.format.ring.MSG_WRITE_PATHS)
        reply = json.dumps(info, separators=(",", ":")).encode()
        if len(reply) > MAX_REPLY:
            raise TooBig(f"inode {ino}: the answer is {len(reply)} bytes, over 64 KiB")
        return reply

    def _where(self, dev: int, field: int, units: int) -> tuple[int, int]:
        """Byte offset and length on member ``dev`` of ``units`` units from ``field``
        (a whole unit, or one fragment tail)."""
        unit, skip, length = extent(field, self.unit)
        return self.pool.unit_offset(dev, unit) + skip, length * units

    # ------------------------------------------------------------------ unit frees
    def free_later(self, ino: int, p: int) -> None:
        """A unit ``ino`` no longer maps: kept aside while a handle that may hold a
        map of it is open."""
        lease = self._leases.get(ino)
        if lease is None:
            self.space.defer_free(p)
        elif lease.held and lease.held[-1][0] == lease.upto:
            lease.held[-1][1].append(p)
        else:
            lease.held.append((lease.upto, [p]))

    def closed(self, fh: int, inode: Inode) -> None:
        """Handle ``fh`` of ``inode`` closed: an uncommitted reservation it held is
        freed; the units no open handle may have mapped go back (all of them, and
        the lease, at the file's last close)."""
        self.abandon(fh)
        for t in self.tickets.of_handle(fh):
            t.retire()  # a read in flight verifies what it reads: it needs no wait
            self.tickets.drop(t)
        lease = self._leases.get(inode.ino)
        if lease is None:
            return
        if inode.opens == 0:
            del self._leases[inode.ino]
        if not lease.held:
            return
        # per close, and only while a rewritten file is leased: a scan of the handles
        ino = inode.ino
        oldest = min((n for n, h in self.handles.items() if h.ino == ino), default=None)
        while lease.held and (oldest is None or lease.held[0][0] < oldest):
            for p in lease.held.pop(0)[1]:
                self.space.defer_free(p)

    def abandon(self, fh: int) -> None:
        """The handle closed before its direct write's commit: the room is freed and
        the file fails (removed at its last close)."""
        r = self._reservations.pop(fh, None)
        if r is not None:
            self._abort(r, "closed before its commit")

    def pending(self, fh: int) -> bool:
        return fh in self._reservations

    def _abort(self, r: Reservation, why: str) -> None:
        self._aborts += 1

        def free() -> None:
            for dev, start, lus in r.plan:
                self.alloc.free(dev, start, len(lus))

        t, r.ticket = r.ticket, None
        if t is None or t.retire():
            free()
        else:  # a ring write of it is still in flight: its units go once it is done
            t.retire(lambda: self.soon(free))
            log.info("inode %d: units of an abandoned ring write freed after it", r.ino)
        if t is not None:
            self.tickets.drop(t)
        inode = self.ns.inodes.get(r.ino)
        log.warning("direct write of inode %d abandoned: %s", r.ino, why)
        if inode is not None:
            st = self.writer.state(r.ino)
            self.writer.fail(st, Incomplete(f"inode {r.ino}: direct write {why}"))
            if not inode.flags & FLAG_WRITING:  # another handle's close committed it
                inode.flags |= FLAG_WRITING  # empty: uncommitted again, its last close
                self.ns.commit(inode)  # removes it and recovery drops it

    # ------------------------------------------------------------------ requests
    async def getxattr(self, ino: int, name: bytes, caller: Caller) -> bytes:
        if name == MAP:
            return self._map(ino, caller)
        if name.startswith(RESERVE):
            return await self._reserve(ino, name[len(RESERVE) :], caller)
        raise NotPermitted(f"{name!r} is not a direct-path request")

    def _live(self, ino: int) -> Inode:
        inode = self.ns.get(ino)
        if inode.is_dir:
            raise InvalidArgument(f"inode {ino} is a directory")
        if inode.flags & FLAG_QUARANTINED:
            raise Corruption(f"inode {ino} is quarantined")
        self._check_readable(inode)
        return inode

    def _map(self, ino: int, caller: Caller) -> bytes:
        if self.ns.get(ino).is_dir:  # where a client may write: the members only
            return self._reply(ino)
        inode, runs, csums = self._mapped(ino)
        extra = {}
        fh = self._opener(ino, caller, writable=False)
        if self.ring is not None and fh is not None:
            t = self.tickets.issue(
                READ, fh, ino, caller.uid, inode.size, self.unit, [Run(*r) for r in runs], csums
            )
            extra["ticket"] = t.token.hex()
        reply = self._reply(ino, size=inode.size, runs=runs, csums=csums, **extra)
        self._leased(inode)
        return reply

    def read_ticket(self, ino: int, fh: int, caller: Caller) -> Ticket:
        """A read ticket of open handle ``fh`` (the ring's path reads: the daemon
        opened the file for ``caller``), the file leased as by a map."""
        inode, runs, csums = self._mapped(ino)
        t = self.tickets.issue(
            READ, fh, ino, caller.uid, inode.size, self.unit, [Run(*r) for r in runs], csums
        )
        self._leased(inode)
        return t

    def _leased(self, inode: Inode) -> None:
        """Leased from now: to the handles open now, until the file's last close."""
        self._leases.setdefault(inode.ino, Lease()).upto = self.handles.newest
        self._maps += 1
        self._bytes_mapped += inode.size

    def _mapped(self, ino: int) -> tuple[Inode, list[list[int]], list[int]]:
        """An open file's runs ``[member, offset, bytes, first unit, units]`` and
        every unit's checksum; Busy while it has bytes in memory only."""
        inode = self._live(ino)
        if not inode.opens:
            raise NotPermitted(f"inode {ino}: a map is leased to an open file only")
        st = self._files.get(ino)
        if st is not None:
            check_failed(st)
            if st.dirty or st.inflight or st.busy:
                raise Busy(f"inode {ino} has bytes in memory only")
        runs: list[list[int]] = []
        csums = []
        extendable = False
        for u in range(inode.nunits):
            p = inode.unit(u)
            csums.append(inode.csum(u) if p != NO_UNIT else 0)
            if p == NO_UNIT:
                extendable = False
                continue
            dev, frag = p >> DEV_SHIFT, is_fragment(p)
            offset, length = self._where(dev, p, 1)
            last = runs[-1] if runs else None
            if (
                extendable
                and not frag
                and last is not None
                and last[0] == dev
                and last[1] + last[2] == offset
            ):
                last[2] += length
                last[4] += 1
            else:
                runs.append([dev, offset, length, u, 1])
            extendable = not frag
        return inode, runs, csums

    def _opener(self, ino: int, caller: Caller, writable: bool) -> int | None:
        """The caller's newest handle of ``ino`` that reads (or writes, if
        ``writable``), opened by the calling thread; None if it has none."""
        found = [
            fh
            for fh, h in self.handles.items()
            if h.ino == ino and h.pid == caller.pid and (h.writable if writable else h.readable)
        ]
        return max(found, default=None)

    def _writer(self, ino: int, caller: Caller) -> int:
        """The caller's newest writable handle of ``ino``."""
        fh = self._opener(ino, caller, writable=True)
        if fh is None:
            raise NotPermitted(f"inode {ino}: open it for writing before reserving")
        return fh

    async def _reserve(self, ino: int, args: bytes, caller: Caller) -> bytes:
        try:
            size_s, nonce = args.split(b".", 1)
            size = int(size_s)
        except ValueError:
            raise InvalidArgument(f"bad reservation request {args!r}") from None
        if size <= 0 or not nonce:
            raise InvalidArgument("a reservation needs a size > 0 and a nonce")
        fh = self._writer(ino, caller)
        r = self._reservations.get(fh)
        if r is not None:
            if r.nonce == nonce:
                return r.reply  # the kernel's second ask (the first was for the length)
            raise Busy(f"inode {ino}: this handle has a direct write in progress")
        return (await self._reserve_for(ino, fh, size, nonce, caller)).reply

    async def write_ticket(self, ino: int, fh: int, size: int, caller: Caller) -> Ticket:
        """Room for the ``size`` bytes of the empty file ``ino`` the daemon opened as
        handle ``fh`` for ``caller`` (the ring's path writes), and its write ticket;
        committed by :meth:`commit_ticket`, or freed at the handle's release."""
        if self.ring is None:
            raise NotPermitted("the mount serves no ring")
        if size <= 0:
            raise InvalidArgument("a path write of no bytes")
        r = await self._reserve_for(ino, fh, size, b"ring", caller, answer=False)
        assert r.ticket is not None
        return r.ticket

    async def _reserve_for(
        self, ino: int, fh: int, size: int, nonce: bytes, caller: Caller, answer: bool = True
    ) -> Reservation:
        """Room for ``size`` bytes of the empty file ``ino`` through handle ``fh``;
        ``answer``: with the reply a client reads (not for the ring's path writes,
        whose ticket the daemon keeps)."""
        inode = self._live(ino)
        st = self.writer.state(ino)
        check_failed(st)
        if inode.size or inode.nunits or st.dirty or st.inflight or st.busy:
            raise Busy(f"inode {ino} is not empty: open it with O_TRUNC")
        # from here the file is this write's: if it fails, so does the file (dropped
        # at its last close, as a write that found no room), never left empty
        self._begin_change(inode)
        units = list(range(-(-size // self.unit)))
        try:
            self.writer.check_size(inode, size)
            await self._ensure_space(inode, len(units))
            # no await since the room was checked
            inode = self._live(ino)
            if fh not in self.handles:
                raise Busy(f"inode {ino}: closed while room was made")
            if fh in self._reservations or inode.size or inode.nunits or st.dirty or st.busy:
                raise Busy(f"inode {ino} changed while room was made")
            plan = self.writer.allocate(inode, units, size)
        except KvfsError as e:
            self.writer.fail(st, e)
            raise
        runs = []
        for dev, start, lus in plan:
            offset, length = self._where(dev, start, len(lus))  # a fragment tail: 1 unit
            runs.append([dev, offset, length, lus[0], len(lus)])
        ticket = None
        if self.ring is not None:
            ticket = self.tickets.issue(
                WRITE, fh, ino, caller.uid, size, self.unit, [Run(*r) for r in runs]
            )
            reply = b""
            if answer:
                reply = self._reply(ino, size=size, runs=runs, ticket=ticket.token.hex())
        else:
            reply = self._reply(ino, size=size, runs=runs)
        r = self._reservations[fh] = Reservation(ino, nonce, size, plan, reply, ticket)
        self._reserved += 1
        return r

    async def commit(self, ino: int, value: bytes, caller: Caller) -> None:
        try:
            msg = json.loads(value)
            nonce = str(msg["nonce"]).encode()
            given = msg.get("csums")
            csums = None if given is None else [int(c) for c in given]
        except (ValueError, KeyError, TypeError):
            raise InvalidArgument("a direct commit is JSON with a nonce and checksums") from None
        await self._commit_handle(ino, self._writer(ino, caller), nonce, csums, caller)

    async def commit_ticket(self, fh: int, caller: Caller) -> None:
        """Commit the ring's path write held by handle ``fh`` (its bytes all written by
        the daemon, which computed their checksums), durable when it returns."""
        if fh not in self.handles:
            raise InvalidArgument(f"handle {fh}: closed before its commit")
        await self._commit_handle(self.handles[fh].ino, fh, b"ring", None, caller)

    async def _commit_handle(
        self, ino: int, fh: int, nonce: bytes, csums: list[int] | None, caller: Caller
    ) -> None:
        r = self._reservations.get(fh)
        if r is None or r.nonce != nonce or r.ino != ino:
            raise InvalidArgument(f"inode {ino}: no such direct write in progress")
        del self._reservations[fh]
        nunits = -(-r.size // self.unit)
        inode = self.ns.inodes.get(ino)
        csums, why = self._checksums(r, csums, caller)
        why = why or self._refusal(inode, len(csums) == nunits)
        if why:
            self._abort(r, why)
            raise InvalidArgument(f"inode {ino}: direct write refused: {why}")
        assert inode is not None
        self._begin_change(inode)
        inode.size = r.size
        self.writer.grow_map(inode, r.size)
        units, sums = self.ns.edit_map(inode)
        for dev, start, lus in r.plan:
            for i, u in enumerate(lus):
                units[u] = phys(dev, start + i)
                sums[u] = csums[u]
            self.journal.note_data_write(dev)  # flushed before the commit record
        self.space.charge(inode, nunits)
        inode.touch()
        self.ns.commit(inode)
        self._commits += 1
        self._bytes_committed += r.size
        await self._commit(inode, caller.pid)

    def _checksums(
        self, r: Reservation, given: list[int] | None, caller: Caller
    ) -> tuple[list[int], str]:
        """The checksums to commit and why not ("" if they may be): the daemon's own,
        when the ring wrote the bytes; the client's only when the client may open the
        devices (it wrote them itself), never an ordinary user's word."""
        t = r.ticket
        if t is not None and (any(t.written) or given is None):
            sums = t.finish_write()
            if sums is None:
                return [], "a ring write of it is unfinished"
            self.tickets.drop(t)
            r.ticket = None
            return sums, ""
        if t is not None:  # unused: the client wrote the devices itself
            t.retire()
            self.tickets.drop(t)
            r.ticket = None
        if given is None:
            return [], "no checksums and no ring write"
        if not self._may_open_devices(caller):
            return [], "checksums from a user who cannot write the devices"
        return given, ""

    def _may_open_devices(self, caller: Caller) -> bool:
        """Whether ``caller`` could open every member for writing (root, the owner,
        or a group with write access)."""
        if caller.uid == 0:
            return True
        for device in self.pool.devices:
            fd = getattr(device, "fd", -1)
            if fd < 0:
                return False
            st = os.fstat(fd)
            if st.st_uid == caller.uid:
                may = bool(st.st_mode & stat.S_IWUSR)
            elif caller.in_group(st.st_gid):
                may = bool(st.st_mode & stat.S_IWGRP)
            else:
                may = bool(st.st_mode & stat.S_IWOTH)
            if not may:
                return False
        return True

    def _refusal(self, inode: Inode | None, covered: bool) -> str:
        """Why a reservation cannot be committed ("" when it can)."""
        if not covered:
            return "its checksums do not cover its units"
        if inode is None:
            return "the file is gone"
        st = self._files.get(inode.ino)
        if inode.size or inode.nunits or (st is not None and (st.dirty or st.busy)):
            return "the file changed meanwhile"
        if st is not None and st.error is not None:
            return "its earlier failure"
        return ""

    def statistics(self) -> DirectStatistics:
        return DirectStatistics(
            self._maps,
            self._reserved,
            self._commits,
            self._aborts,
            self._bytes_mapped,
            self._bytes_committed,
            len(self._leases),
            sum(len(units) for lease in self._leases.values() for _, units in lease.held),
            len(self.tickets),
            asdict(self.ring_stats) if self.ring_stats is not None else {},
        )
