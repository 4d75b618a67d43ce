"""The ring client's flow control (:func:`kvfs.client.ring.Ring.run`): it keeps at
most MAX_UNREAD requests unanswered (plus the message it is sending), reading
completions before it sends more, so the daemon never holds more of its completions
than a bounded outbox (``kvfs.store.ring.OUTBOX_LIMIT``)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from kvfs.client import ring as client
from kvfs.format import ring as wire
from kvfs.store.ring import OUTBOX_LIMIT


def test_a_client_keeps_at_most_max_unread_requests_unanswered(tmp_path: Path) -> None:
    """A stand-in daemon answers only when no request has come for a while (as a
    daemon busy with a long batch would): the most requests it ever saw unanswered
    stays within MAX_UNREAD + one message, and every request gets its own answer."""
    path = str(tmp_path / "ring.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    most = [0]

    def daemon() -> None:
        conn, _ = listener.accept()
        with conn:
            serve(conn)

    def serve(conn: socket.socket) -> None:
        pending: list[wire.Request] = []
        conn.settimeout(0.5)
        while True:
            try:
                msg = conn.recv(wire.MAX_MESSAGE)
            except TimeoutError:  # the client waits: answer everything it sent
                for k in range(0, len(pending), wire.MAX_BATCH):
                    done = [wire.Done(r.tag, 0, r.length) for r in pending[k : k + wire.MAX_BATCH]]
                    conn.sendall(wire.done(done))
                pending.clear()
                continue
            if not msg:
                return
            if wire.kind(msg)[0] == wire.MSG_SUBMIT:
                pending += wire.requests_of(msg)
                most[0] = max(most[0], len(pending))

    t = threading.Thread(target=daemon, daemon=True)
    t.start()
    r = client.Ring(path)
    buf = client.shared(4096)
    n = 3 * wire.MAX_UNREAD
    got = r.run([(wire.OP_READ, bytes(16), buf, 0, 7 + i % 5) for i in range(n)])
    assert got == [7 + i % 5 for i in range(n)]
    # (a daemon that answered early, on a loaded machine, saw fewer: never more)
    assert 0 < most[0] <= wire.MAX_UNREAD + wire.MAX_BATCH < OUTBOX_LIMIT
    r.close()
    t.join(60)
    listener.close()
