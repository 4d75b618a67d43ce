"""Tickets (:mod:`kvfs.store.tickets`): found only by their own user (or root), dead
once retired, and a retired write ticket's units freed only after its last request."""

from __future__ import annotations

import threading

from kvfs.store.tickets import READ, WRITE, Run, Tickets


def test_a_ticket_is_its_users_and_dies_with_its_handle() -> None:
    t = Tickets()
    a = t.issue(READ, fh=1, ino=5, uid=1000, size=10, unit=4096, runs=[Run(0, 0, 4096, 0, 1)])
    assert t.find(a.token, 1000) is a
    assert t.find(a.token, 0) is a  # root acts for anyone
    assert t.find(a.token, 1001) is None
    assert t.find(bytes(16), 1000) is None
    assert t.of_handle(1) == [a] and len(t) == 1
    assert a.retire()
    t.drop(a)
    assert t.find(a.token, 1000) is None and len(t) == 0 and t.of_handle(1) == []
    assert not a.enter()


def test_units_of_a_retired_write_go_only_after_its_last_request() -> None:
    t = Tickets()
    w = t.issue(WRITE, fh=2, ino=6, uid=0, size=3 * 4096, unit=4096, runs=[])
    assert w.enter() and w.enter()
    freed: list[str] = []
    assert not w.retire(lambda: freed.append(threading.current_thread().name))
    assert not w.enter()  # dead: no new request
    assert w.leave() is None and not freed
    then = w.leave()
    assert then is not None
    then()
    assert len(freed) == 1


def test_a_commit_takes_the_daemons_checksums_only_when_every_unit_is_written() -> None:
    t = Tickets()
    w = t.issue(WRITE, fh=3, ino=7, uid=0, size=2 * 4096 + 1, unit=4096, runs=[])
    assert len(w.sums) == 3
    w.written[0:2] = b"\1\1"
    assert w.finish_write() is None  # a unit never written
    w.written[2] = 1
    assert w.enter()
    assert w.finish_write() is None  # a request in flight
    w.leave()
    w.sums[:] = [7, 8, 9]
    assert w.finish_write() == [7, 8, 9]
    assert w.dead and not w.enter()
