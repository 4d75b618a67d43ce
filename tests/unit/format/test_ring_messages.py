"""The aware ring's messages (:mod:`kvfs.format.ring`): what goes in comes out, and a
malformed message is refused rather than misread."""

from __future__ import annotations

import pytest

from kvfs.format import ring as wire


def test_a_batch_round_trips() -> None:
    reqs = [
        wire.Request(wire.OP_READ, 3, 1 << 40, bytes(range(16)), 4096, 32 << 20),
        wire.Request(wire.OP_WRITE, 7, 2, b"\xff" * 16, 0, 1),
    ]
    msg = wire.submit(reqs)
    assert wire.kind(msg) == (wire.MSG_SUBMIT, wire.RING_VERSION, 2)
    assert wire.requests_of(msg) == reqs
    done = [wire.Done(1 << 40, 0, 32 << 20), wire.Done(2, 5, 0)]
    assert wire.done_of(wire.done(done)) == done
    assert wire.region_of(wire.register(9, 1 << 30)) == (9, 1 << 30)
    assert wire.region_of(wire.unregister(9)) == (9, 0)


def test_malformed_messages_are_refused() -> None:
    msg = wire.submit([wire.Request(wire.OP_READ, 1, 1, bytes(16), 0, 1)])
    with pytest.raises(ValueError):
        wire.requests_of(msg[:-1])  # truncated
    with pytest.raises(ValueError):
        wire.requests_of(msg + b"x")  # trailing bytes
    with pytest.raises(ValueError):
        wire.kind(b"abc")
    with pytest.raises(ValueError):
        wire.region_of(wire.register(1, 2) + b"\0")
    with pytest.raises(ValueError):
        wire.submit([wire.Request(wire.OP_READ, 1, 1, bytes(15), 0, 1)])  # short ticket
    with pytest.raises(ValueError):
        wire.submit([])
    with pytest.raises(ValueError):
        wire.done_of(wire.done([wire.Done(1, 0, 0)])[:-3])


def test_a_path_batch_round_trips_and_refuses_what_is_malformed() -> None:
    reqs = [
        wire.PathRequest(wire.OP_READ, 2, 7, 4096, 2 << 20, b"vllm/a/b.bin"),
        wire.PathRequest(wire.OP_READ, 2, 8, 0, 1, "é/x".encode()),
    ]
    msg = wire.submit_paths(reqs)
    assert wire.kind(msg) == (wire.MSG_SUBMIT_PATHS, wire.RING_VERSION, 2)
    assert wire.path_requests_of(msg) == reqs
    for bad in (msg[:-1], msg + b"x", msg[:40]):
        with pytest.raises(ValueError):
            wire.path_requests_of(bad)
    with pytest.raises(ValueError):
        wire.submit_paths([wire.PathRequest(wire.OP_READ, 1, 1, 0, 1, b"")])
    with pytest.raises(ValueError):
        wire.submit_paths([wire.PathRequest(wire.OP_READ, 1, 1, 0, 1, b"x" * 4097)])
    too_many = [wire.PathRequest(wire.OP_READ, 1, i, 0, 1, b"p") for i in range(65)]
    with pytest.raises(ValueError):
        wire.submit_paths(too_many)


def test_a_path_write_batch_carries_each_files_mode_and_is_never_mixed() -> None:
    reqs = [
        wire.PathRequest(wire.OP_WRITE, 3, 9, 4096 * i, 5000 + i, b"d/f%d" % i, 0o640 + i)
        for i in range(5)
    ]
    msg = wire.submit_paths(reqs)
    assert wire.kind(msg)[0] == wire.MSG_WRITE_PATHS
    assert wire.path_requests_of(msg) == reqs
    for cut in (1, 9, len(msg) - 1):
        with pytest.raises(ValueError):
            wire.path_requests_of(msg[:cut])
    read = wire.PathRequest(wire.OP_READ, 3, 9, 0, 1, b"r")
    with pytest.raises(ValueError):
        wire.submit_paths([reqs[0], read])
    reads = wire.submit_paths([read])
    assert wire.kind(reads)[0] == wire.MSG_SUBMIT_PATHS
    assert wire.path_requests_of(reads) == [read]  # a read carries no mode
