"""The aware ring's messages: what a client and the mount's daemon exchange over the
daemon's Unix socket (``docs/design.md``, "The aware ring").

A client registers shared memory (a sealed memfd, passed with ``SCM_RIGHTS``), then
submits batches of whole-file reads and writes, each naming a ticket (what the mount
gave its open of the file, see :mod:`kvfs.store.tickets`), a registered region and an
offset in it. The daemon answers each request with one completion. The socket is
``SOCK_SEQPACKET``: one message per datagram, in order, never split.

Pure: encode/decode only. Every record is one ``struct.Struct`` with a size assert.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

RING_VERSION = 1
"""Sent in every HELLO; a daemon refuses a client of another version."""
TICKET_BYTES = 16
"""A ticket is 16 random bytes (128 bits): unguessable, so knowing one is holding it."""

MSG_HELLO = 1
MSG_REGISTER = 2
MSG_UNREGISTER = 3
MSG_SUBMIT = 4
MSG_DONE = 5
MSG_SUBMIT_PATHS = 6
"""A batch of whole-file reads named by path (the daemon opens each as the
connection's user would, :class:`PathRequest`), one completion each."""
MSG_WRITE_PATHS = 7
"""A batch of new files named by path, each created as the connection's user would
create it, written from the region and committed (durable) before its completion.
Sent only to a daemon whose map answers say ``ring_writes`` (an older one drops the
connection on a kind it does not know)."""

OP_READ = 1
OP_WRITE = 2

_HEAD = struct.Struct("<BBHI")  # kind, version, reserved, count or region
assert _HEAD.size == 8
_REGION = struct.Struct("<IQ")  # region id, bytes
assert _REGION.size == 12
_REQUEST = struct.Struct("<BxxxIQ16sQQ")  # op, region, tag, ticket, offset, length
assert _REQUEST.size == 48
_DONE = struct.Struct("<QiQ")  # tag, errno (0: done), bytes moved
assert _DONE.size == 20

_PATH_REQUEST = struct.Struct("<BxHIQQQ")  # op, path bytes, region, tag, offset, length
assert _PATH_REQUEST.size == 32
_PATH_WRITE = struct.Struct("<BxHIQQQI4x")  # the same, then the new file's mode
assert _PATH_WRITE.size == 40
MAX_PATH = 4096
"""The longest path a request may name (PATH_MAX)."""

MAX_BATCH = 1024
"""Requests in one SUBMIT message at most (48 KiB: under any socket's message limit)."""
MAX_MESSAGE = _HEAD.size + MAX_BATCH * _REQUEST.size
MAX_UNREAD = 4 * MAX_BATCH
"""Requests a client keeps unanswered at most: past them it reads completions before
it sends more (the daemon keeps what a full socket does not take, up to a limit)."""
MAX_PATH_BATCH = 64
"""Path requests in one SUBMIT_PATHS message at most (under 256 KiB with their paths)."""
MAX_PATH_MESSAGE = _HEAD.size + MAX_PATH_BATCH * (_PATH_WRITE.size + MAX_PATH)


@dataclass(frozen=True)
class Request:
    op: int
    region: int
    tag: int
    ticket: bytes
    offset: int
    """Where in the region the file's first byte goes (reads) or comes from (writes)."""
    length: int
    """Bytes of the region the request may touch: at least the file's size."""


@dataclass(frozen=True)
class Done:
    tag: int
    error: int
    """0, or the errno the request failed with (its buffer then holds no result)."""
    nbytes: int


@dataclass(frozen=True)
class PathRequest:
    op: int
    region: int
    tag: int
    offset: int
    length: int
    path: bytes
    """Relative to the filesystem's root, components separated by ``/``."""
    mode: int = 0
    """A write's: the new file's permission bits (the client's umask applied)."""


def submit_paths(requests: list[PathRequest]) -> bytes:
    """A SUBMIT_PATHS (reads) or, when every request is a write, a WRITE_PATHS."""
    if not 0 < len(requests) <= MAX_PATH_BATCH:
        raise ValueError(f"a path batch holds 1 to {MAX_PATH_BATCH} requests")
    writes = requests[0].op == OP_WRITE
    if any((r.op == OP_WRITE) != writes for r in requests):
        raise ValueError("a path batch is all reads or all writes")
    msg = MSG_WRITE_PATHS if writes else MSG_SUBMIT_PATHS
    out = [_HEAD.pack(msg, RING_VERSION, 0, len(requests))]
    for r in requests:
        if not 0 < len(r.path) <= MAX_PATH:
            raise ValueError("a path of 1 to 4096 bytes")
        head = (r.op, len(r.path), r.region, r.tag, r.offset, r.length)
        out.append(_PATH_WRITE.pack(*head, r.mode) if writes else _PATH_REQUEST.pack(*head))
        out.append(r.path)
    return b"".join(out)


def path_requests_of(message: bytes) -> list[PathRequest]:
    kind_, _, count = kind(message)
    if count > MAX_PATH_BATCH:
        raise ValueError("a path batch too long")
    record = _PATH_WRITE if kind_ == MSG_WRITE_PATHS else _PATH_REQUEST
    at, out = _HEAD.size, []
    for _ in range(count):
        if at + record.size > len(message):
            raise ValueError("a path batch cut short")
        op, n, region, tag, offset, length, *mode = record.unpack_from(message, at)
        at += record.size
        if not 0 < n <= MAX_PATH or at + n > len(message):
            raise ValueError("a path of the wrong length")
        path = message[at : at + n]
        out.append(PathRequest(op, region, tag, offset, length, path, *mode))
        at += n
    if at != len(message):
        raise ValueError("a path batch with trailing bytes")
    return out


def hello() -> bytes:
    return _HEAD.pack(MSG_HELLO, RING_VERSION, 0, 0)


def register(region: int, nbytes: int) -> bytes:
    return _HEAD.pack(MSG_REGISTER, RING_VERSION, 0, 1) + _REGION.pack(region, nbytes)


def unregister(region: int) -> bytes:
    return _HEAD.pack(MSG_UNREGISTER, RING_VERSION, 0, 1) + _REGION.pack(region, 0)


def submit(requests: list[Request]) -> bytes:
    if not 0 < len(requests) <= MAX_BATCH:
        raise ValueError(f"a batch holds 1 to {MAX_BATCH} requests")
    out = [_HEAD.pack(MSG_SUBMIT, RING_VERSION, 0, len(requests))]
    for r in requests:
        if len(r.ticket) != TICKET_BYTES:
            raise ValueError("a ticket is 16 bytes")
        out.append(_REQUEST.pack(r.op, r.region, r.tag, r.ticket, r.offset, r.length))
    return b"".join(out)


def done(items: list[Done]) -> bytes:
    out = [_HEAD.pack(MSG_DONE, RING_VERSION, 0, len(items))]
    out.extend(_DONE.pack(d.tag, d.error, d.nbytes) for d in items)
    return b"".join(out)


def kind(message: bytes) -> tuple[int, int, int]:
    """A message's kind, version and count; ValueError for a malformed header."""
    if len(message) < _HEAD.size:
        raise ValueError("a message shorter than its header")
    k, version, _, count = _HEAD.unpack_from(message)
    return k, version, count


def region_of(message: bytes) -> tuple[int, int]:
    """The region id and size of a REGISTER or UNREGISTER."""
    if len(message) != _HEAD.size + _REGION.size:
        raise ValueError("a region message of the wrong length")
    region, nbytes = _REGION.unpack_from(message, _HEAD.size)
    return region, nbytes


def requests_of(message: bytes) -> list[Request]:
    _, _, count = kind(message)
    if count > MAX_BATCH or len(message) != _HEAD.size + count * _REQUEST.size:
        raise ValueError("a batch of the wrong length")
    return [
        Request(*_REQUEST.unpack_from(message, _HEAD.size + i * _REQUEST.size))
        for i in range(count)
    ]


def done_of(message: bytes) -> list[Done]:
    _, _, count = kind(message)
    if len(message) != _HEAD.size + count * _DONE.size:
        raise ValueError("a completion message of the wrong length")
    return [Done(*_DONE.unpack_from(message, _HEAD.size + i * _DONE.size)) for i in range(count)]
