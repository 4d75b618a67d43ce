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


def test_tokens_are_distinct_and_no_other_daemons() -> None:
    """A token is 16 bytes no one can guess: never repeated within a daemon (from many
    threads at once), and another daemon (another key) issues none of the same, nor
    the first daemon's again after a restart."""
    run = [Run(0, 0, 4096, 0, 1)]
    first = Tickets()
    tokens: list[bytes] = []
    lock = threading.Lock()

    def issue() -> None:
        mine = [first.issue(READ, fh=1, ino=5, uid=1000, size=10, unit=4096, runs=run).token]
        mine += [first.issue(READ, fh=2, ino=5, uid=1000, size=10, unit=4096, runs=run).token]
        with lock:
            tokens.extend(mine)

    def issue_many() -> None:
        for _ in range(250):
            issue()

    threads = [threading.Thread(target=issue_many) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(tokens) == len(set(tokens)) == 2000 and {len(x) for x in tokens} == {16}
    assert all(first.find(x, 1000) is not None for x in tokens)
    other = Tickets()  # a restarted daemon: its counter starts over, its key does not
    again = {other.issue(READ, 1, 5, 1000, 10, 4096, run).token for _ in range(2000)}
    assert not again & set(tokens)
    assert all(other.find(x, 1000) is None for x in tokens)
