"""The daemon's side of the aware ring: clients of any user move file bytes between
their shared memory and the devices through the daemon's I/O threads, with no copy
through FUSE and none inside the daemon (``docs/design.md``, "The aware ring"; the
client is :mod:`kvfs.client.ring` behind :mod:`kvfs.client.direct`).

One Unix socket per mount (``SOCK_SEQPACKET``, mode 0666: anyone may connect, what a
connection may do is what its tickets allow). Per connection a thread reads its
messages: HELLO, REGISTER (a sealed memfd, mapped here once), UNREGISTER, SUBMIT (a
batch of whole-file requests). Each request is checked before any I/O -- a live
ticket of the connection's user (``SO_PEERCRED``), of the request's kind, a
registered region that holds the whole file at a page-aligned offset -- then split
into pieces of at most 8 MiB that the I/O threads move with O_DIRECT
(:mod:`kvfs.devices.runs`): a read verifies every unit against the map's checksum and
fails EIO rather than hand over a wrong byte; a write computes the checksums the
commit will store. One completion per request.

A client that dies mid-request: its socket closes, its regions are unmapped once
their last request is done, and the kernel closes its files, which kills their
tickets at the release; units of an uncommitted write are freed only once no
request of that ticket is still writing (:meth:`Ticket.retire`).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import mmap
import os
import socket
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import trio

from kvfs.devices.device import ALIGN
from kvfs.devices.runs import Piece, pieces, read_piece, write_piece
from kvfs.format import ring as wire
from kvfs.store.posix import Caller
from kvfs.store.tickets import READ, WRITE, Run, Ticket, Tickets

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""A region whose pages the client already has (its staging buffers) is mapped at
registration in one call, not a page fault each inside the first transfers; the
daemon never allocates a client's memory that way (the pages exist: ``st_blocks``)."""
PATH_GROUP = 4
"""Files of a path batch opened or created per hop to the trio thread (then their
reads or writes start, while the next group is opened or created)."""
OUTBOX_LIMIT = 4 * wire.MAX_UNREAD
"""Completions a connection may leave unread in the daemon before it is shut down
(a client of this package reads once it has MAX_UNREAD unanswered requests)."""
MAX_REGIONS = 4096
"""Registered regions per connection at most (each is one mapping in the daemon)."""
_SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


NewFiles = Callable[[list[tuple[bytes, int, int]], Caller], Awaitable[list[Ticket | int]]]
"""Creates ``(path, size, mode)`` as a caller, each its write ticket or an errno."""
Commits = Callable[[list[tuple[int, bool]], Caller], Awaitable[list[int]]]
"""Commits ``(handle, written)`` and releases every handle: per file 0 or an errno."""


def _holds(region: Region | None, offset: int, nbytes: int) -> bool:
    """Whether ``region`` holds ``nbytes`` at the page-aligned ``offset``."""
    return region is not None and offset % ALIGN == 0 and offset + nbytes <= len(region.mm)


@dataclass(eq=False)
class Region:
    mm: mmap.mmap
    view: memoryview
    base: int
    users: int = 0
    gone: bool = False


@dataclass
class RingStatistics:
    connections: int = 0
    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    refused: int = 0
    """Requests failed before any I/O: a dead or foreign ticket, a bad region."""
    checksum_failures: int = 0
    created: int = 0
    """Files made by path writes (created, written and committed by the daemon)."""
    creating: int = 0
    """Path-write batches in progress now (their files may still be empty)."""
    device_seconds: float = 0.0
    """Thread time of the I/O threads (device calls and checksums), summed."""


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    uid: int
    pid: int
    gid: int
    regions: dict[int, Region] = field(default_factory=dict)
    send: threading.Lock = field(default_factory=threading.Lock)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    outbox: list[wire.Done] = field(default_factory=list)
    """Completions the client's full socket did not take yet (under ``send``)."""
    writer: threading.Condition | None = None
    """Wakes the connection's writer thread (made at the first full socket)."""
    writer_thread: threading.Thread | None = None
    shut: bool = False
    """Shut down by the daemon (a client that leaves too much unread, a failed
    send): its completions are dropped, its thread hangs it up at the EOF."""


class RingServer:
    """Serves the ring of one mount: ``start`` on the trio thread (with a way to run a
    callback there), ``stop`` at the unmount."""

    def __init__(
        self,
        tickets: Tickets,
        fds: list[int],
        socket_path: str,
        threads: int,
        opener: Callable[[list[bytes], Caller], Awaitable[list[Ticket | int]]] | None = None,
        releaser: Callable[[list[int]], Awaitable[None]] | None = None,
        token: trio.lowlevel.TrioToken | None = None,
        allow_other: bool = False,
        creator: NewFiles | None = None,
        committer: Commits | None = None,
    ) -> None:
        self.tickets = tickets
        self.opener, self.releaser, self.token = opener, releaser, token
        self.creator, self.committer = creator, committer
        self.allow_other = allow_other
        self.fds = fds
        self.path = socket_path
        self.stats = RingStatistics()
        self._stats_lock = threading.Lock()
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="kvfs-ring-io")
        self._listener: socket.socket | None = None
        self._conns: set[Connection] = set()
        self._conns_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.bind(self.path)
        os.chmod(self.path, 0o666)  # anyone may connect: tickets say what they may do
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, name="kvfs-ring-accept", daemon=True).start()
        log.info("aware ring listening at %s", self.path)

    def stop(self) -> None:
        s, self._listener = self._listener, None
        if s is not None:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
        self._io.shutdown(wait=True)

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            pid, uid, gid = (int.from_bytes(creds[i : i + 4], "little") for i in (0, 4, 8))
            conn = Connection(sock, uid, pid, gid)
            with self._conns_lock:
                self._conns.add(conn)
            with self._stats_lock:
                self.stats.connections += 1
            threading.Thread(
                target=self._serve, args=(conn,), name="kvfs-ring-conn", daemon=True
            ).start()

    # ------------------------------------------------------------------ one client
    def _serve(self, conn: Connection) -> None:
        try:
            while True:
                msg, fds = self._receive(conn.sock)
                if not msg:
                    return
                try:
                    self._message(conn, msg, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
        except (OSError, ValueError) as e:
            log.info("aware ring: client pid %d dropped: %s", conn.pid, e)
        finally:
            self._hang_up(conn)

    @staticmethod
    def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
        fds = array.array("i")
        msg, anc, _, _ = sock.recvmsg(wire.MAX_PATH_MESSAGE, socket.CMSG_SPACE(4 * 4))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        return msg, list(fds)

    def _message(self, conn: Connection, msg: bytes, fds: list[int]) -> None:
        kind, version, _ = wire.kind(msg)
        if version != wire.RING_VERSION:
            raise ValueError(f"ring version {version}, this daemon speaks {wire.RING_VERSION}")
        if kind == wire.MSG_HELLO:
            return
        if kind == wire.MSG_REGISTER:
            region, nbytes = wire.region_of(msg)
            if len(fds) == 1:
                self._register(conn, region, nbytes, fds[0])
            return
        if kind == wire.MSG_UNREGISTER:
            region, _ = wire.region_of(msg)
            self._unregister(conn, region)
            return
        if kind == wire.MSG_SUBMIT:
            for r in wire.requests_of(msg):
                self._start(conn, r)
            return
        if kind == wire.MSG_SUBMIT_PATHS:
            self._paths(conn, wire.path_requests_of(msg))
            return
        if kind == wire.MSG_WRITE_PATHS:
            self._write_paths(conn, wire.path_requests_of(msg))
            return
        raise ValueError(f"unknown ring message {kind}")

    def _register(self, conn: Connection, region: int, nbytes: int, fd: int) -> None:
        """Map a client's sealed memfd (a registration that fails is simply not made:
        requests naming it fail EINVAL)."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & _SEALED != _SEALED or nbytes <= 0 or os.fstat(fd).st_size < nbytes:
                raise OSError(errno.EINVAL, "not a sealed memfd of that size")
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if os.fstat(fd).st_blocks * 512 >= nbytes:  # pages the client has: map them
                with contextlib.suppress(OSError, ValueError):
                    mm.madvise(MADV_POPULATE_WRITE)
        except OSError as e:
            log.info("aware ring: pid %d: region %d refused: %s", conn.pid, region, e)
            return
        probe = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(probe)
        del probe
        with conn.lock:
            if len(conn.regions) >= MAX_REGIONS or region in conn.regions or conn.closed:
                mm.close()
                return
            conn.regions[region] = Region(mm, memoryview(mm), base)

    def _unregister(self, conn: Connection, region: int) -> None:
        with conn.lock:
            r = conn.regions.pop(region, None)
            if r is None:
                return
            r.gone = True
            idle = r.users == 0
        if idle:
            self._unmap(r)

    @staticmethod
    def _unmap(r: Region) -> None:
        try:
            r.view.release()
            r.mm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            log.warning("aware ring: a region is still in use at its unmap")

    def _hang_up(self, conn: Connection) -> None:
        """Forget a connection (on its own thread, at its end). Its socket is shut
        down first, which ends a send its writer may be waiting in, and closed only
        once the writer is gone: a closed descriptor's number is soon another
        connection's, and a late send must not reach that client."""
        with self._conns_lock:
            self._conns.discard(conn)
        with conn.lock:
            conn.closed = True
            regions = list(conn.regions)
        with conn.send:
            writer = conn.writer_thread
            if conn.writer is not None:
                conn.writer.notify()
        _shut(conn)
        if writer is not None:
            writer.join()
        for region in regions:
            self._unregister(conn, region)
        conn.sock.close()

    # ------------------------------------------------------------------ requests
    def _refuse(self, conn: Connection, tag: int, error: int) -> None:
        with self._stats_lock:
            self.stats.refused += 1
        self._complete(conn, wire.Done(tag, error, 0))

    def _complete(self, conn: Connection, done: wire.Done) -> None:
        """Send ``done`` without ever waiting for the client: a socket it has not
        drained (a client still sending its batch's next message, a slow or a
        stopped one) keeps the completion in the connection's outbox, which its
        own writer thread sends. An I/O thread that waited there would hold every
        client's requests, and a client sending while the daemon waits to send
        would wait for ever (a path batch of 1,500 files did). A client that
        leaves more than OUTBOX_LIMIT completions unread is shut down: the
        daemon's memory is not its to fill."""
        with conn.send:
            if conn.closed or conn.shut:
                return
            if not conn.outbox:
                try:
                    conn.sock.send(wire.done([done]), socket.MSG_DONTWAIT)
                    return
                except BlockingIOError:
                    pass
                except OSError as e:  # the client is gone: nobody to tell
                    _shut(conn, e)
                    return
            if len(conn.outbox) >= OUTBOX_LIMIT:
                _shut(conn, f"{len(conn.outbox)} completions left unread", logging.WARNING)
                return
            conn.outbox.append(done)
            if conn.writer is None:
                wake = threading.Condition(conn.send)
                thread = threading.Thread(
                    target=_write_out, args=(conn, wake), name="kvfs-ring-out", daemon=True
                )
                try:
                    thread.start()
                except RuntimeError as e:  # no thread to be had: the client hears EPIPE
                    _shut(conn, e)
                    return
                conn.writer, conn.writer_thread = wake, thread
            conn.writer.notify()

    def _start(self, conn: Connection, r: wire.Request) -> None:
        kind = {wire.OP_READ: READ, wire.OP_WRITE: WRITE}.get(r.op)
        t = self.tickets.find(r.ticket, conn.uid)
        if kind is None or t is None or t.kind != kind:
            self._refuse(conn, r.tag, errno.EBADF)
            return
        self._launch(conn, t, r.region, r.offset, r.length, r.tag, inline=True)

    def _launch(
        self,
        conn: Connection,
        t: Ticket,
        region_id: int,
        offset: int,
        length: int,
        tag: int,
        inline: bool,
        finished: Callable[[], None] | None = None,
        answer: Callable[[int], None] | None = None,
    ) -> bool:
        """Start ticket ``t``'s request into region ``region_id`` at ``offset``; False
        (and its completion sent) when it may not start. ``answer``: called with the
        request's errno (0: done) instead of sending its completion."""
        with conn.lock:
            region = conn.regions.get(region_id)
            fits = length >= t.size and _holds(region, offset, t.size)
            if region is None or not fits:
                region = None
            else:
                region.users += 1
        if region is None:
            self._failed(conn, tag, errno.EINVAL, answer)
            return False
        if not t.enter():
            self._release(conn, region)
            self._failed(conn, tag, errno.EBADF, answer)
            return False
        _Job(self, conn, region, t, tag, offset, finished, answer).launch(inline)
        return True

    def _failed(
        self, conn: Connection, tag: int, error: int, answer: Callable[[int], None] | None
    ) -> None:
        if answer is None:
            self._refuse(conn, tag, error)
        else:
            with self._stats_lock:
                self.stats.refused += 1
            answer(error)

    def _path_batch(self, conn: Connection, reqs: list[wire.PathRequest], op: int) -> bool:
        """Whether a path batch may run at all (else every request is refused)."""
        error = 0
        if (
            self.opener is None
            or self.releaser is None
            or self.token is None
            or (op == wire.OP_WRITE and (self.creator is None or self.committer is None))
        ):
            error = errno.EOPNOTSUPP
        elif not self.allow_other and conn.uid not in (0, os.getuid()):
            error = errno.EACCES  # as FUSE itself refuses other users without allow_other
        elif any(r.op != op for r in reqs):
            error = errno.EINVAL
        for r in reqs if error else ():
            self._refuse(conn, r.tag, error)
        return not error

    def _fits(self, conn: Connection, r: wire.PathRequest) -> bool:
        """Whether ``r``'s region holds ``r.length`` bytes at a page-aligned offset."""
        with conn.lock:
            return r.length > 0 and _holds(conn.regions.get(r.region), r.offset, r.length)

    def _write_paths(self, conn: Connection, reqs: list[wire.PathRequest]) -> None:
        """A batch of new files by path: created, opened and their room reserved as
        the connection's user (one hop to the trio thread), written from the region
        on the I/O threads, then committed together (a second hop; the commits
        share the journal's flushes) and every handle released; each completion is
        sent once its file is durable, or dropped."""
        if not self._path_batch(conn, reqs, wire.OP_WRITE):
            return
        fit = [self._fits(conn, r) for r in reqs]
        for r, ok in zip(reqs, fit, strict=True):
            if not ok:
                self._refuse(conn, r.tag, errno.EINVAL)
        todo = [r for r, ok in zip(reqs, fit, strict=True) if ok]
        if not todo:
            return
        with self._stats_lock:
            self.stats.creating += 1
        try:
            self._create_write_commit(conn, todo)
        finally:
            with self._stats_lock:
                self.stats.creating -= 1

    def _create_write_commit(self, conn: Connection, todo: list[wire.PathRequest]) -> None:
        """Create ``todo`` a few files per hop to the trio thread, each group's writes
        started on the I/O threads before the next group is created (the device work
        of one overlaps the trio thread's of the next), then commit every file written
        in one hop and answer each."""
        assert self.creator is not None and self.committer is not None and self.token
        caller = Caller(conn.uid, conn.gid, conn.pid)
        written: list[tuple[wire.PathRequest, Ticket]] = []
        errors: list[int] = []  # by position: a client's tags need not be distinct
        left = [0]
        idle = threading.Condition()

        def answer(k: int, error: int) -> None:
            with idle:
                errors[k] = error
                left[0] -= 1
                idle.notify_all()

        creator = self.creator
        for group, made, final in self._in_groups(
            conn, todo, lambda g: creator([(r.path, r.length, r.mode) for r in g], caller)
        ):
            for j, (r, t) in enumerate(zip(group, made, strict=True)):
                if isinstance(t, int):
                    self._refuse(conn, r.tag, t)
                    continue
                with idle:
                    k = len(written)
                    written.append((r, t))
                    errors.append(0)
                    left[0] += 1
                inline = final and j == len(group) - 1  # this thread waits next anyway
                self._launch(
                    conn, t, r.region, r.offset, r.length, r.tag, inline,
                    answer=functools.partial(answer, k),
                )  # fmt: skip
        if not written:
            return
        with idle:
            idle.wait_for(lambda: left[0] == 0)
        outcome = [(t.fh, not errors[k]) for k, (_, t) in enumerate(written)]
        try:
            committed = trio.from_thread.run(self.committer, outcome, caller, trio_token=self.token)
        except Exception as e:  # the mount is stopping: nothing was made durable
            log.info("aware ring: path writes not committed: %r", e)
            committed = [errno.EIO] * len(written)
        for k, ((r, t), error) in enumerate(zip(written, committed, strict=True)):
            error = errors[k] or error
            if not error:
                with self._stats_lock:
                    self.stats.created += 1
            self._complete(conn, wire.Done(r.tag, error, 0 if error else t.size))

    def _paths(self, conn: Connection, reqs: list[wire.PathRequest]) -> None:
        """A batch of path reads: the files opened as the connection's user (on the
        trio thread, PATH_GROUP per hop), each group's reads started at once (the
        batch's last on this thread, which would only wait for it: one hand-off to
        an I/O thread less, ~0.1 ms of a 2 MiB ``read_into``), and every handle
        released once the batch's reads are done."""
        opener, releaser, token = self.opener, self.releaser, self.token
        if not self._path_batch(conn, reqs, wire.OP_READ):
            return
        assert opener is not None and releaser is not None and token is not None
        caller = Caller(conn.uid, conn.gid, conn.pid)
        fhs: list[int] = []
        pending = [0]
        idle = threading.Condition()

        def finished() -> None:
            with idle:
                pending[0] -= 1
                idle.notify_all()

        # opened a few at a time, each group's reads started before the next group
        # is opened: the device work of one overlaps the trio thread's of the next
        for group, opened, final in self._in_groups(
            conn, reqs, lambda g: opener([r.path for r in g], caller)
        ):
            fhs += [t.fh for t in opened if isinstance(t, Ticket)]
            for j, (r, t) in enumerate(zip(group, opened, strict=True)):
                if isinstance(t, int):
                    self._refuse(conn, r.tag, t)
                    continue
                with idle:
                    pending[0] += 1
                inline = final and j == len(group) - 1
                if not self._launch(conn, t, r.region, r.offset, r.length, r.tag, inline, finished):
                    finished()
        with idle:
            idle.wait_for(lambda: pending[0] == 0)
        if fhs:
            self._release_later(fhs, releaser, token)

    def _in_groups(
        self,
        conn: Connection,
        reqs: list[wire.PathRequest],
        call: Callable[[list[wire.PathRequest]], Awaitable[list[Ticket | int]]],
    ) -> Iterator[tuple[list[wire.PathRequest], list[Ticket | int], bool]]:
        """``reqs`` PATH_GROUP at a time, each group's ``call`` made on the trio thread
        (one hop): (group, its tickets or errnos, whether it is the last group). A
        group the stopping mount refuses gets EIO and is not yielded."""
        for k in range(0, len(reqs), PATH_GROUP):
            group = reqs[k : k + PATH_GROUP]
            try:
                got = trio.from_thread.run(call, group, trio_token=self.token)
            except Exception as e:  # the mount is stopping (it closes every handle)
                log.info("aware ring: path requests refused: %r", e)
                for r in group:
                    self._refuse(conn, r.tag, errno.EIO)
                continue
            yield group, got, k + PATH_GROUP >= len(reqs)

    @staticmethod
    def _release_later(
        fhs: list[int],
        releaser: Callable[[list[int]], Awaitable[None]],
        token: trio.lowlevel.TrioToken,
    ) -> None:
        """Release a read batch's handles on the trio thread without waiting for it:
        the completions went out already, and the connection goes on to its next
        message a hop sooner. A mount that is stopping closes every handle itself."""

        async def release() -> None:
            try:
                await releaser(fhs)
            except Exception as e:  # the mount is stopping: its handles are closed
                log.info("aware ring: handles %s not released: %r", fhs, e)

        def spawn() -> None:  # on the trio thread, outside any task: must not raise
            try:
                trio.lowlevel.spawn_system_task(release, name="kvfs-ring-release")
            except Exception as e:  # the run is ending
                log.info("aware ring: handles %s not released: %r", fhs, e)

        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(spawn)

    def _release(self, conn: Connection, region: Region) -> None:
        with conn.lock:
            region.users -= 1
            idle = region.gone and region.users == 0
        if idle:
            self._unmap(region)

    def _count(self, t: Ticket, ok: bool, seconds: float) -> None:
        with self._stats_lock:
            s = self.stats
            s.device_seconds += seconds
            if not ok:
                if t.kind == READ:
                    s.checksum_failures += 1
                return
            if t.kind == READ:
                s.reads += 1
                s.bytes_read += t.size
            else:
                s.writes += 1
                s.bytes_written += t.size


def _shut(conn: Connection, why: object = None, level: int = logging.INFO) -> None:
    """Shut ``conn``'s socket down from the daemon's side (any thread): the client
    sees its end (and falls back to the mount), the connection's thread its EOF,
    at which it hangs the connection up; its completions from now on are dropped."""
    if why is not None and not conn.shut:
        log.log(level, "aware ring: client pid %d shut out: %s", conn.pid, why)
    conn.shut = True
    with contextlib.suppress(OSError):
        conn.sock.shutdown(socket.SHUT_RDWR)


def _write_out(conn: Connection, wake: threading.Condition) -> None:
    """A connection's writer: its outbox, MAX_BATCH completions a message, waiting
    for the client as long as it takes (only this thread waits for it)."""
    while True:
        with wake:
            wake.wait_for(lambda: bool(conn.outbox) or conn.closed or conn.shut)
            if conn.closed or conn.shut:
                conn.outbox.clear()
                return
            batch = conn.outbox[: wire.MAX_BATCH]
            del conn.outbox[: wire.MAX_BATCH]
        try:
            conn.sock.sendall(wire.done(batch))
        except OSError as e:  # gone, or shut down: either way the client hears EPIPE
            _shut(conn, None if conn.closed else e)
            with wake:
                conn.outbox.clear()
            return


class _Job:
    """One request in flight: its pieces on the I/O threads, one completion."""

    def __init__(
        self,
        server: RingServer,
        conn: Connection,
        region: Region,
        t: Ticket,
        tag: int,
        offset: int,
        finished: Callable[[], None] | None,
        answer: Callable[[int], None] | None = None,
    ) -> None:
        self.server, self.conn, self.region, self.t = server, conn, region, t
        self.tag, self.finished, self.answer = tag, finished, answer
        self.view = region.view[offset : offset + t.size]
        self.base = region.base + offset
        self.left = 0
        self.error = 0
        self.seconds = 0.0
        self.lock = threading.Lock()

    def launch(self, inline: bool) -> None:
        t = self.t
        work = [p for run in t.runs for p in self._pieces(run)]
        if t.kind == READ:
            self._zero_holes(work)
        self.left = len(work)
        if not work:
            self._finish()
            return
        for p in work[1 if inline else 0 :]:
            self.server._io.submit(self._piece, p)
        if inline:
            self._piece(work[0])  # on the connection's thread: one hand-off less

    def _pieces(self, run: Run) -> list[Piece]:
        spec = (run.device, run.offset, run.length, run.first, run.n)
        return pieces(spec, self.server.fds, self.t.unit, self.t.size)

    def _zero_holes(self, work: list[Piece]) -> None:
        """Units of the file no run maps (holes) read as zeros."""
        covered = bytearray(-(-self.t.size // self.t.unit))
        for p in work:
            covered[p.first : p.first + p.n] = b"\1" * p.n
        unit, size = self.t.unit, self.t.size
        for u, c in enumerate(covered):
            if not c:
                lo, hi = u * unit, min((u + 1) * unit, size)
                self.view[lo:hi] = bytes(hi - lo)

    def _piece(self, p: Piece) -> None:
        t, error = self.t, 0
        start = time.thread_time()
        try:
            if t.kind == READ:
                ok, _ = read_piece(p, self.view, self.base, t.unit, t.size, t.csums)
                error = 0 if ok else errno.EIO
            else:
                write_piece(p, self.view, self.base, t.unit, t.sums)
                t.written[p.first : p.first + p.n] = b"\1" * p.n
        except OSError as e:
            error = e.errno or errno.EIO
            log.warning("aware ring: inode %d: device I/O failed: %s", t.ino, e)
        except Exception as e:  # never lose a completion: the client would wait forever
            error = errno.EIO
            log.exception("aware ring: inode %d: %s", t.ino, e)
        seconds = time.thread_time() - start
        with self.lock:
            self.seconds += seconds
            self.error = self.error or error
            self.left -= 1
            last = self.left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        del self.view
        then = self.t.leave()
        if then is not None:
            then()
        self.server._release(self.conn, self.region)
        self.server._count(self.t, not self.error, self.seconds)
        if self.answer is not None:
            self.answer(self.error)
        else:
            nbytes = 0 if self.error else self.t.size
            self.server._complete(self.conn, wire.Done(self.tag, self.error, nbytes))
        if self.finished is not None:
            self.finished()


__all__ = ["RingServer", "RingStatistics"]
