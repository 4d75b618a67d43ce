"""The aware ring on a real mount (:mod:`kvfs.store.ring`, :mod:`kvfs.client.ring`,
:mod:`kvfs.store.tickets`): an ordinary user's engine moves bytes through the daemon,
and only the bytes its own opens allow.

What every aware route shares (sizes, rewrites, eviction, corruption, torch) runs on
the ring too, in :mod:`tests.mount.test_direct`. Here: a real unprivileged user;
requests a client forges (another user's ticket, a guessed one, a dead one, a read
ticket used to write, a region too small or misaligned, memory it never
registered); checksums an ordinary user may not choose; clients killed mid-request,
which leave nothing reserved and nothing half-committed, while the files others
wrote stay exact."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import pwd
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

import kvfs.client.direct as direct
from kvfs.client import ring as client
from kvfs.format import ring as wire
from kvfs.fuse.wake import SIGNAL
from kvfs.store.ring import OUTBOX_LIMIT
from tests.conftest import KvfsMount, errno_of, pattern, wait_for

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mount_options("--allow-other")


def _stats(mount: KvfsMount) -> dict[str, object]:
    out: dict[str, object] = mount.stats()["direct"]
    return out


def _ring_counters(mount: KvfsMount) -> dict[str, float]:
    ring = _stats(mount)["ring"]
    assert isinstance(ring, dict) and ring, "the mount serves no ring"
    return ring


def _in_child(pw: pwd.struct_passwd | None, cwd: Path, fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child, as ``pw`` (no groups) if given; fail on its error."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            for fd in direct._fds.values():  # root's member descriptors: not the user's
                os.close(fd)
            direct._fds.clear()
            direct._stats = direct.Statistics()
            os.environ.pop("KVFS_DIRECT_ROUTE", None)  # the fastest route it may use
            os.chdir(cwd)
            if pw is not None:
                os.setgroups([])
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)
            fn()
            code = 0
        except BaseException as e:
            traceback.print_exception(e)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "no-ring"])
def test_an_ordinary_user_gets_the_ring_or_the_mount_with_the_same_bytes(
    kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd, ring: bool
) -> None:
    """A process that may not open the devices moves its bytes through the daemon's
    ring (no FUSE data request), exact for every size and buffer; with
    ``--no-aware-ring`` it reads and writes through the mount, with the same bytes."""
    if not ring:
        kvfs_mount.stop()
        kvfs_mount.start("--allow-other", "--no-aware-ring")
    os.chmod(kvfs_mount.path, 0o777)
    sizes = [1, 4095, 4097, MiB + 17, 8 * MiB, 32 * MiB - 3]

    def user() -> None:
        for size in sizes:
            data = pattern(("user", size), size)
            assert direct.write_from(f"u{size}", data) == size
            for buf in (direct.aligned(size), memoryview(bytearray(size + 1))[1:]):
                assert direct.read_into(f"u{size}", buf) == size
                assert bytes(buf[:size]) == data, size
            with open(f"u{size}", "rb") as f:
                assert f.read() == data
        s = direct.stats()
        assert direct.route(".") == ("ring" if ring else "mount")
        assert s["direct_reads"] == s["direct_writes"] == 0, s
        kind = "ring" if ring else "fallback"
        assert s[f"{kind}_writes"] == len(sizes) and s[f"{kind}_reads"] == 2 * len(sizes), s

    _in_child(unprivileged_user, kvfs_mount.path, user)
    for size in sizes:
        assert (kvfs_mount.path / f"u{size}").read_bytes() == pattern(("user", size), size)
    if ring:
        c = _ring_counters(kvfs_mount)
        assert c["writes"] == len(sizes) and c["reads"] == 2 * len(sizes), c
        assert c["refused"] == 0 and c["checksum_failures"] == 0, c
    else:
        assert _stats(kvfs_mount)["ring"] == {}
    kvfs_mount.remount()
    for size in sizes:
        assert (kvfs_mount.path / f"u{size}").read_bytes() == pattern(("user", size), size)


def _open_map(path: Path, flags: int = os.O_RDONLY) -> tuple[int, dict[str, object]]:
    fd = os.open(path, flags | os.O_CLOEXEC)
    return fd, json.loads(os.getxattr(fd, direct.MAP))


def _submit(ring: client.Ring, op: int, ticket: bytes, buf: client.SharedBuffer, **kw: int) -> int:
    """A request's errno (0: done)."""
    got = ring.run([(op, ticket, buf, kw.get("offset", 0), kw.get("length", len(buf)))])[0]
    return got.errno or -1 if isinstance(got, OSError) else 0


def test_forged_requests_fail_before_any_io(kvfs_mount: KvfsMount) -> None:
    """Only a live ticket of the caller's own open moves bytes, and only within its
    registered memory: a guessed ticket, a read ticket used to write, a region that
    is too small or misaligned, or a ticket whose file was closed all fail (EBADF,
    EINVAL) and leave the file and the buffer as they were."""
    p = kvfs_mount.path / "f"
    data = pattern("f", 3 * MiB)
    p.write_bytes(data)
    fd, info = _open_map(p)
    ticket = bytes.fromhex(str(info["ticket"]))
    ring = client.connect(str(info["ring"]))
    assert ring is not None
    buf = client.shared(4 * MiB)
    buf[:] = b"\xaa" * len(buf)
    assert _submit(ring, wire.OP_READ, secrets.token_bytes(16), buf) == errno.EBADF
    assert _submit(ring, wire.OP_WRITE, ticket, buf) == errno.EBADF  # a read ticket
    assert _submit(ring, wire.OP_READ, ticket, buf, offset=512) == errno.EINVAL
    assert _submit(ring, wire.OP_READ, ticket, buf, length=MiB) == errno.EINVAL
    small = client.shared(MiB)
    assert _submit(ring, wire.OP_READ, ticket, small) == errno.EINVAL
    assert buf[:] == b"\xaa" * len(buf)
    assert _submit(ring, wire.OP_READ, ticket, buf) == 0  # the real thing works
    assert buf[: len(data)] == data
    os.close(fd)
    wait_for(lambda: _stats(kvfs_mount)["tickets"] == 0, what="the ticket to die")
    assert _submit(ring, wire.OP_READ, ticket, buf) == errno.EBADF  # closed: dead
    # a write-only open gets no read ticket
    wfd, winfo = _open_map(p, os.O_WRONLY)
    assert "ticket" not in winfo and winfo["ring"] == info["ring"]
    os.close(wfd)
    assert p.read_bytes() == data
    assert _ring_counters(kvfs_mount)["refused"] == 6


def test_a_client_that_does_not_read_its_completions_holds_nobody_else(
    kvfs_mount: KvfsMount,
) -> None:
    """A client submits 512 reads by path (eight messages; the daemon's I/O threads
    send their completions, more than its socket holds) and reads none of the
    completions yet: every read is still done, another client's request is served,
    and the first client then finds every completion, byte-exact. (The I/O threads
    once waited on the full socket, and with them every client.)"""
    n = 512
    for i in range(n):
        (kvfs_mount.path / f"f{i}").write_bytes(pattern(i, 4096))
    fd, info = _open_map(kvfs_mount.path / "f7")
    slow, other = client.Ring(str(info["ring"])), client.Ring(str(info["ring"]))
    buf = client.shared(4096 * n)
    slow._register(buf)
    reqs = [
        wire.PathRequest(wire.OP_READ, buf.region, i + 1, i * 4096, 4096, f"f{i}".encode())
        for i in range(n)
    ]
    reads = _ring_counters(kvfs_mount)["reads"]
    for k in range(0, n, wire.MAX_PATH_BATCH):  # and no recv for now
        slow._sock.sendall(wire.submit_paths(reqs[k : k + wire.MAX_PATH_BATCH]))
    wait_for(
        lambda: _ring_counters(kvfs_mount)["reads"] >= reads + n,
        what="every read of a client that reads no completion",
    )
    mine = client.shared(4096)
    assert other.run([(wire.OP_READ, bytes.fromhex(str(info["ticket"])), mine, 0, 4096)]) == [4096]
    assert mine[:4096] == pattern(7, 4096)
    done: dict[int, int] = {}
    slow._sock.settimeout(60)  # a lost completion fails here, not at the suite's time-out
    while len(done) < n:
        for d in wire.done_of(slow._sock.recv(wire.MAX_MESSAGE)):
            done[d.tag] = d.error or d.nbytes
    assert done == {i + 1: 4096 for i in range(n)}
    for i in range(n):
        assert buf[i * 4096 : (i + 1) * 4096] == pattern(i, 4096), i
    slow.close()
    other.close()
    os.close(fd)


def test_a_client_that_never_reads_is_shut_out_not_kept(kvfs_mount: KvfsMount) -> None:
    """A client floods the ring with requests (forged tickets: each is refused at
    once) and reads no completion: past OUTBOX_LIMIT unread the daemon shuts its
    connection down instead of keeping its completions without end; the client sees
    the end of its stream, and the mount and other clients go on."""
    p = kvfs_mount.path / "f"
    p.write_bytes(pattern("f", MiB))
    fd, info = _open_map(p)
    flood = client.Ring(str(info["ring"]))
    flood._sock.settimeout(60)  # a hang guard: the daemon never stops receiving
    forged = [
        wire.Request(wire.OP_READ, 0, tag, secrets.token_bytes(16), 0, 4096)
        for tag in range(wire.MAX_BATCH)
    ]
    sent = 0
    with contextlib.suppress(OSError):  # EPIPE once the daemon has shut it down
        for _ in range(2 * OUTBOX_LIMIT // wire.MAX_BATCH):
            flood._sock.sendall(wire.submit(forged))
            sent += wire.MAX_BATCH
    got = 0
    while msg := flood._sock.recv(wire.MAX_MESSAGE):
        got += len(wire.done_of(msg))
    assert got < sent, (got, sent)  # the rest dropped with the connection
    assert "completions left unread" in kvfs_mount.log.read_text()
    other = client.Ring(str(info["ring"]))
    buf = client.shared(MiB)
    assert _submit(other, wire.OP_READ, bytes.fromhex(str(info["ticket"])), buf) == 0
    assert buf[:MiB] == pattern("f", MiB)
    other.close()
    flood.close()
    os.close(fd)


def test_batches_of_more_files_than_the_socket_queues(
    kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd
) -> None:
    """An ordinary user writes and reads 1,200 files by path in one call each (19
    messages of 64 files each way, while the socket queues 10): both complete,
    byte-exact, through the ring. (A read batch of 1,500 files once waited for ever:
    the client sending its batch's next message while the daemon waited to send a
    completion.)"""
    os.chmod(kvfs_mount.path, 0o777)
    n = 1200

    def user() -> None:
        names = [f"b{i}" for i in range(n)]
        assert direct.write_many([(m, pattern(m, 4096 + i)) for i, m in enumerate(names)]) == [
            4096 + i for i in range(n)
        ]
        bufs = [direct.aligned(8192) for _ in names]
        assert direct.read_batch(zip(names, bufs, strict=True)) == [4096 + i for i in range(n)]
        for i, (m, b) in enumerate(zip(names, bufs, strict=True)):
            assert bytes(b[: 4096 + i]) == pattern(m, 4096 + i), m
        s = direct.stats()
        assert s["ring_reads"] == n and s["fallback_reads"] == 0, s

    _in_child(unprivileged_user, kvfs_mount.path, user)
    assert (kvfs_mount.path / "b1199").read_bytes() == pattern("b1199", 4096 + 1199)


def test_another_users_ticket_is_not_theirs(
    kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd
) -> None:
    """A ticket leaked to another user (here: handed over) moves nothing for them."""
    p = kvfs_mount.path / "secret"
    p.write_bytes(pattern("secret", MiB))
    os.chmod(kvfs_mount.path, 0o777)
    fd, info = _open_map(p)
    ticket, sock = str(info["ticket"]), str(info["ring"])

    def thief() -> None:
        ring = client.connect(sock)
        assert ring is not None
        buf = client.shared(MiB)
        assert _submit(ring, wire.OP_READ, bytes.fromhex(ticket), buf) == errno.EBADF
        assert buf[:] == bytes(MiB)

    try:
        _in_child(unprivileged_user, kvfs_mount.path, thief)
    finally:
        os.close(fd)


def test_an_ordinary_user_cannot_commit_checksums_of_its_choosing(
    kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd
) -> None:
    """A reservation committed with the client's checksums and no ring write (what
    only a process that wrote the devices itself may do) is refused for a user who
    cannot write them: the file is dropped, never left mapping stale units."""
    os.chmod(kvfs_mount.path, 0o777)
    free = kvfs_mount.stats()["store"]["free_bytes"]

    def user() -> None:
        fd = os.open("forged", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        plan = json.loads(os.getxattr(fd, direct.RESERVE + f"{2 * MiB}.n1"))
        sums = [1] * -(-2 * MiB // int(plan["unit"]))
        commit = json.dumps({"nonce": "n1", "csums": sums}).encode()
        assert errno_of(os.setxattr, fd, direct.COMMIT, commit) == errno.EINVAL
        try:
            os.close(fd)
        except OSError as e:  # the flush of a failed file says so
            assert e.errno == errno.EIO

    _in_child(unprivileged_user, kvfs_mount.path, user)
    wait_for(lambda: not (kvfs_mount.path / "forged").exists(), what="the file dropped")
    wait_for(lambda: kvfs_mount.stats()["store"]["free_bytes"] == free, what="room back")
    kvfs_mount.expect_errors += ["could not be committed", "flush: .*checksums from a user"]


_RING_CLIENT = """
import os, random, sys
sys.path.insert(0, sys.argv[3])
import kvfs.client.direct as d
from tests.conftest import pattern
root, seed, uid = sys.argv[1], int(sys.argv[2]), int(sys.argv[4])
os.chdir(root)  # as root: the user could not walk the test's directories
if uid:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
rng = random.Random(seed)
buf = d.aligned(17 << 20)
bufs = [d.aligned(4 << 20) for _ in range(10)]
print("ready", flush=True)
i = 0
while True:
    i += 1
    name = f"c{seed}-{i % 7}"
    size = rng.choice([3 * (1 << 20) + 5, 8 << 20, 17 << 20])
    pick = rng.random()
    if pick < 0.35:
        d.write_from(name, pattern(name, size))
    elif pick < 0.5:  # a batch: created, written and committed a few files per group
        names = [f"m{seed}-{j}" for j in range(rng.randint(5, 10))]
        d.write_many([(n, pattern(n, 3 * (1 << 20) + 5)) for n in names])
    elif pick < 0.65:
        names = [f"m{seed}-{j}" for j in range(10)]
        for n, got in zip(names, d.read_batch(zip(names, bufs))):
            if isinstance(got, FileNotFoundError):
                continue
            assert not isinstance(got, BaseException), (n, got)
            assert bytes(bufs[names.index(n)][:got]) == pattern(n, got), n
    else:
        try:
            n = d.read_into(name, buf)
        except FileNotFoundError:
            continue
        assert bytes(buf[:n]) == pattern(name, n), name
"""


def _kernel_stacks(pid: int) -> str:
    """Where each thread of ``pid`` waits in the kernel (root reads them)."""
    out = []
    with contextlib.suppress(OSError):
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with contextlib.suppress(OSError):
                stack = Path(f"/proc/{pid}/task/{tid}/stack").read_text().split("\n")[:6]
                out.append(f"{tid}: " + " / ".join(line.split()[-1] for line in stack if line))
    return "; ".join(out)


def _wait_killed(proc: subprocess.Popen[bytes], mount: KvfsMount) -> None:
    """A SIGKILLed client ends: only a FUSE request the daemon read and never
    answered can hold it (its exit waits for that answer); fail with where the
    client and the daemon wait, not at the suite's time-out."""
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        assert mount.proc is not None
        pytest.fail(
            f"a killed client never ended: client {_kernel_stacks(proc.pid)}; "
            f"daemon {_kernel_stacks(mount.proc.pid)}"
        )


def test_clients_killed_mid_request_leave_nothing_reserved_or_half_committed(
    kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd
) -> None:
    """Ordinary users' clients writing and reading through the ring, one file and
    batches of files at a time, are killed (-9) at random moments, many times: every
    file then listed reads whole and exact
    (through FUSE and the ring; empty if killed before its reservation), no
    reservation and no ticket is left, and the free space is what the listed files
    leave; after a remount, the same."""
    os.chmod(kvfs_mount.path, 0o777)
    free0 = kvfs_mount.stats()["store"]["free_bytes"]
    rng = random.Random(29)
    kills = 0
    for rnd in range(12):
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _RING_CLIENT,
                    str(kvfs_mount.path),
                    str(rnd * 10 + k),
                    str(REPO),
                    str(unprivileged_user.pw_uid),
                ],
                stdout=subprocess.PIPE,
                cwd=REPO,
            )
            for k in range(2)
        ]
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.05, 1.5))
        for proc in procs:
            assert proc.poll() is None, "a client failed (a wrong byte?) before its kill"
            proc.send_signal(signal.SIGKILL)
            _wait_killed(proc, kvfs_mount)
            assert proc.stdout is not None
            proc.stdout.close()
            kills += 1
    assert _ring_counters(kvfs_mount)["writes"] > 0
    assert _ring_counters(kvfs_mount)["created"] > 0  # new names went by path

    def settled() -> bool:
        s = _stats(kvfs_mount)
        # a path write in progress may have made its file and not yet its ticket
        return (
            s["tickets"] == 0
            and s["leased_files"] == 0
            and _ring_counters(kvfs_mount)["creating"] == 0
        )

    wait_for(settled, what="every ticket, lease and path write gone with its client")

    def check() -> int:
        used = 0
        for f in sorted(kvfs_mount.path.iterdir()):
            data = f.read_bytes()
            assert data == pattern(f.name, len(data)), f
            # 0: killed between its create and its reservation (an empty file, as a
            # writer killed right after open(O_CREAT) leaves on ext4): never a prefix.
            # A path write the daemon had begun is finished: whole.
            assert len(data) in (0, 3 * MiB + 5, 8 * MiB, 17 * MiB), (f, len(data))
            buf = direct.aligned(len(data))
            assert direct.read_into(f, buf) == len(data) and buf[: len(data)] == data
            used += len(data)
        return used

    used = check()
    assert used > 0
    unit = int(kvfs_mount.stats()["store"]["unit_size"])
    nfiles = len(list(kvfs_mount.path.iterdir()))

    def only_the_files() -> bool:
        """What the files hold, rounded up to a unit per file: nothing else reserved."""
        store = kvfs_mount.stats()["store"]
        free = store["free_bytes"] + store["pending_free_bytes"]
        return bool(free0 - used - nfiles * unit <= free <= free0 - used)

    wait_for(only_the_files, what="the room of every killed request back")
    kvfs_mount.expect_errors += ["could not be committed", "abandoned", "killed"]
    kvfs_mount.remount()
    assert check() == used
    assert kills == 24


def test_the_daemon_wakes_its_fuse_reader(kvfs_mount: KvfsMount) -> None:
    """The daemon's trio thread, the one that reads /dev/fuse, has the wake-up timer
    of :mod:`kvfs.fuse.wake` (a read whose request a killed client withdrew would
    otherwise hold the whole daemon: the killed-clients test above once found a
    client SIGKILL could not end); the mount serves as ever."""
    assert kvfs_mount.proc is not None
    pid = kvfs_mount.proc.pid  # the main thread's id is the process's
    timers = Path(f"/proc/{pid}/timers").read_text()
    assert f"signal: {int(SIGNAL)}/" in timers and f"tid.{pid}\n" in timers, timers
    (kvfs_mount.path / "f").write_bytes(pattern("f", MiB))
    assert (kvfs_mount.path / "f").read_bytes() == pattern("f", MiB)


def test_path_reads_follow_the_kernels_permission_rules(
    kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd
) -> None:
    """A batch read by path (``read_batch``: the daemon opens each file for the
    connection's user) serves exactly what the user may open through the mount: its
    own and world-readable files, byte-exact; EACCES for a file it may not read or
    under a directory it may not search (``..`` included: the kernel's walk); a clean
    miss for a missing file; an unaligned buffer bounced, the same bytes."""
    m = kvfs_mount.path
    os.chmod(m, 0o755)
    (m / "open").mkdir(mode=0o755)
    (m / "shut").mkdir(mode=0o700)
    files = {
        "open/public": (0o644, pattern("public", 3 * MiB + 1)),
        "open/secret": (0o600, pattern("secret", MiB)),
        "shut/inside": (0o644, pattern("inside", MiB)),
    }
    for name, (mode, data) in files.items():
        (m / name).write_bytes(data)
        os.chmod(m / name, mode)
    os.chmod(m / "open", 0o777)

    def user() -> None:
        mine = pattern("mine", 2 * MiB)
        direct.write_from("open/mine", mine)
        names = ["open/public", "open/mine", "open/secret", "shut/inside", "open/none"]
        names.append("shut/../open/./public")  # the kernel's walk: shut/ is not searchable
        names.append("nodir/none")  # a missing directory: a miss of this file alone
        bufs = [direct.aligned(4 * MiB) for _ in names]
        # by path on the ring, but for shut/: the user cannot even list it
        assert [direct._ring_path_of(n) is not None for n in names[:5]] == [1, 1, 1, 0, 1]
        got = direct.read_batch(zip(names, bufs, strict=True))
        assert got[0] == 3 * MiB + 1 and bufs[0][: got[0]] == files["open/public"][1]
        assert got[1] == 2 * MiB and bufs[1][: 2 * MiB] == mine
        for i in (2, 3, 5):
            assert isinstance(got[i], PermissionError), got[i]
            assert bufs[i][:] == bytes(4 * MiB)  # nothing of it reached the user
        assert isinstance(got[4], FileNotFoundError)
        assert isinstance(got[6], FileNotFoundError)
        unaligned = memoryview(bytearray(2 * MiB + 1))[1:]
        assert direct.read_many([("open/mine", unaligned)]) == [2 * MiB]
        assert bytes(unaligned) == mine
        s = direct.stats()
        assert s["direct_reads"] == 0 and s["ring_reads"] >= 3, s
        # a client that names paths itself gets the same rules from the daemon
        sock = direct._ring_path_of("open/public")
        assert sock is not None
        ring = client.connect(sock[0])
        assert ring is not None
        raw = client.shared(MiB)
        got = ring.read_paths([(b"shut/inside", raw, 0, MiB), (b"shut/../open/mine", raw, 0, MiB)])
        assert [g.errno if isinstance(g, OSError) else g for g in got] == [
            errno.EACCES,
            errno.EINVAL,
        ]
        assert raw[:] == bytes(MiB)

    _in_child(unprivileged_user, m, user)
    c = _ring_counters(kvfs_mount)
    assert c["refused"] >= 4, c  # the daemon's own rules refused them
    wait_for(lambda: _stats(kvfs_mount)["tickets"] == 0, what="every path read's ticket gone")
    assert kvfs_mount.stats()["store"]["open_handles"] == 0


def test_without_allow_other_no_other_user_reads_by_path(
    tmp_path: Path, unprivileged_user: pwd.struct_passwd
) -> None:
    """A mount without ``--allow-other`` is its owner's alone, through FUSE (the
    kernel's rule) and through the ring: another user's path reads are EACCES even
    when it names the socket itself."""
    from kvfs.testing import harness
    from tests.conftest import META_SIZE, _finish

    m = KvfsMount(tmp_path / "mnt", [str(harness.make_image(tmp_path / "p.img", 256 * MiB))],
                  tmp_path / "kvfs.log", [])  # fmt: skip
    m.start("--format", "--meta-size", META_SIZE)
    try:
        (m.path / "f").write_bytes(pattern("f", MiB))
        sock = json.loads(os.getxattr(m.path, direct.MAP))["ring"]

        def other() -> None:
            ring = client.connect(sock)
            assert ring is not None
            buf = client.shared(MiB)
            got = ring.read_paths([(b"f", buf, 0, MiB)])[0]
            assert isinstance(got, OSError) and got.errno == errno.EACCES, got
            assert buf[:] == bytes(MiB)

        _in_child(unprivileged_user, tmp_path, other)
    finally:
        _finish(m)


def test_bounced_requests_of_many_sizes_from_many_threads(kvfs_mount: KvfsMount) -> None:
    """Buffers that are not shared memory go through the process's staging buffers,
    which threads share and drop once more sizes than it keeps were used: a buffer's
    finalizer then runs inside the staging code (it once deadlocked a real vLLM
    engine's store threads). Every request completes, every byte exact."""
    os.environ["KVFS_DIRECT_ROUTE"] = "ring"
    try:
        sizes = [(1 << k) + 3 for k in range(10, 25)]  # 15 staging sizes, 1 KiB..16 MiB
        for size in sizes:
            direct.write_from(kvfs_mount.path / f"s{size}", pattern(("s", size), size))
        errors: list[BaseException] = []

        def worker(k: int) -> None:
            try:
                for size in sizes[k % 3 :: 2] + sizes[::-3]:
                    buf = memoryview(bytearray(size + 1))[1:]  # never shared: bounced
                    assert direct.read_into(kvfs_mount.path / f"s{size}", buf) == size
                    assert bytes(buf) == pattern(("s", size), size)
                    direct.write_from(kvfs_mount.path / f"w{k}-{size}", bytes(buf))
                got = direct.read_batch(
                    (kvfs_mount.path / f"s{size}", bytearray(size)) for size in sizes
                )
                assert got == sizes, got
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a ring request never completed"
        assert not errors, errors
        assert direct.stats()["bounced_bytes"] > 0
    finally:
        os.environ.pop("KVFS_DIRECT_ROUTE", None)


def test_path_writes_create_as_the_kernel_would_and_never_leave_a_part(
    kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd
) -> None:
    """``write_from`` by an ordinary user sends a new file as one path write: the
    daemon creates it as that user (owner, umask-applied mode), writes and commits
    it, byte-exact, and the name is seen at once even where the kernel had cached
    its absence. Where the user may not create it (a directory it may not write or
    search, a missing one, a name too long) it gets the error open(2) would give and
    nothing is left; a name in use is replaced through the mount, exact."""
    m = kvfs_mount.path
    os.chmod(m, 0o755)
    (m / "open").mkdir(mode=0o777)
    (m / "ro").mkdir(mode=0o755)
    (m / "shut").mkdir(mode=0o700)
    (m / "shut" / "inner").mkdir(mode=0o777)
    (m / "open" / "taken").write_bytes(b"old bytes of root's")
    os.chmod(m / "open" / "taken", 0o666)
    os.chmod(m / "open", 0o777)

    def user() -> None:
        os.umask(0o027)
        assert not os.path.exists("open/neg")  # the kernel caches "no such name"
        data = pattern("neg", 3 * MiB + 7)
        assert direct.write_from("open/neg", data, mode=0o666) == len(data)
        with open("open/neg", "rb") as f:  # seen at once, whole
            assert f.read() == data
        st = os.stat("open/neg")
        assert (st.st_uid, st.st_mode & 0o7777, st.st_size) == (os.getuid(), 0o640, len(data))
        buf = direct.aligned(len(data))
        assert direct.read_into("open/neg", buf) == len(data) and buf[: len(data)] == data
        new = pattern("taken", MiB + 1)
        assert direct.write_from("open/taken", new) == len(new)  # replaced the mount's way
        with open("open/taken", "rb") as f:
            assert f.read() == new
        refused = {
            "ro/x": PermissionError,
            "shut/inner/x": PermissionError,
            "nodir/x": FileNotFoundError,
            "open/" + "n" * 300: OSError,
        }
        for name, kind in refused.items():
            with pytest.raises(kind) as e:
                direct.write_from(name, pattern(name, MiB))
            if name.startswith("open/n"):
                assert e.value.errno == errno.ENAMETOOLONG, e.value
        s = direct.stats()
        assert s["ring_writes"] == 2 and s["fallback_writes"] == 0, s
        assert s["direct_writes"] == 0, s

    _in_child(unprivileged_user, m, user)
    c = _ring_counters(kvfs_mount)
    assert c["created"] == 1 and c["creating"] == 0, c
    assert sorted(p.name for p in (m / "open").iterdir()) == ["neg", "taken"]
    assert list((m / "ro").iterdir()) == [] and list((m / "shut" / "inner").iterdir()) == []
    wait_for(lambda: _stats(kvfs_mount)["tickets"] == 0, what="every path write's ticket gone")
    assert kvfs_mount.stats()["store"]["open_handles"] == 0
    kvfs_mount.remount()
    assert (m / "open" / "neg").read_bytes() == pattern("neg", 3 * MiB + 7)
    assert (m / "open" / "taken").read_bytes() == pattern("taken", MiB + 1)


def test_write_many_goes_by_path_in_batches_and_every_file_is_exact(
    kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd
) -> None:
    """``write_many`` of new and existing files of many sizes, from shared, bytes and
    unaligned buffers, by an ordinary user: the new files go by path (one message per
    batch), the existing ones the mount's way, and every file reads back exact, also
    after a remount; one file the user may not create fails the call after all the
    others are stored."""
    m = kvfs_mount.path
    os.chmod(m, 0o777)
    (m / "ro").mkdir(mode=0o755)
    sizes = [1, 4095, 4096, 65537, MiB, 2 * MiB + 3, 8 * MiB]
    names = [f"f{i:03d}" for i in range(90)]
    want = {n: pattern(n, sizes[i % len(sizes)]) for i, n in enumerate(names)}
    for n in names[::9]:  # already there: replaced
        (m / n).write_bytes(b"stale")
        os.chmod(m / n, 0o666)

    def user() -> None:
        bufs: list[object] = []
        for i, n in enumerate(names):
            data = want[n]
            if i % 3 == 0:
                a = direct.aligned(len(data))
                a[: len(data)] = data
                bufs.append(memoryview(a)[: len(data)])
            elif i % 3 == 1:
                bufs.append(data)
            else:
                u = memoryview(bytearray(len(data) + 1))[1:]
                u[:] = data
                bufs.append(u)
        assert direct.write_many(zip(names, bufs, strict=True)) == [len(want[n]) for n in names]
        for n in names:
            with open(n, "rb") as f:
                assert f.read() == want[n], n
        s = direct.stats()
        assert s["ring_writes"] == len(names) and s["fallback_writes"] == 0, s
        with pytest.raises(PermissionError):
            direct.write_many([("late", b"x" * 5000), ("ro/no", b"y" * 5000)])
        with open("late", "rb") as f:
            assert f.read() == b"x" * 5000

    _in_child(unprivileged_user, m, user)
    c = _ring_counters(kvfs_mount)
    assert c["created"] == len(names) - len(names[::9]) + 1, c
    wait_for(lambda: _stats(kvfs_mount)["tickets"] == 0, what="every path write's ticket gone")
    kvfs_mount.remount()
    for n in names:
        assert (m / n).read_bytes() == want[n], n
    assert not (m / "ro" / "no").exists()


def test_a_path_write_is_read_whole_by_whoever_looked_at_it_while_it_was_made(
    kvfs_mount: KvfsMount,
) -> None:
    """A file a path write makes behind the kernel is empty while the daemon writes
    it; a process that looked it up meanwhile (the kernel then caches its size 0)
    reads it whole once ``write_from`` returned, never a short or empty file."""
    os.environ["KVFS_DIRECT_ROUTE"] = "ring"  # root takes the ring, as a user would
    try:
        for i in range(12):
            path = kvfs_mount.path / f"p{i}"
            data = pattern(("p", i), 8 * MiB + 4096 * i + 1)
            stop = threading.Event()

            def look(path: Path = path, stop: threading.Event = stop) -> None:
                while not stop.is_set():  # each stat the kernel answers caches its size
                    with contextlib.suppress(FileNotFoundError):
                        os.stat(path)

            poller = threading.Thread(target=look)
            poller.start()
            try:
                assert direct.write_from(path, data) == len(data)
            finally:
                stop.set()
                poller.join()
            assert os.stat(path).st_size == len(data)
            with open(path, "rb") as f:
                assert f.read() == data, i
        assert _ring_counters(kvfs_mount)["created"] == 12
    finally:
        os.environ.pop("KVFS_DIRECT_ROUTE", None)


def test_a_forged_path_write_makes_nothing(kvfs_mount: KvfsMount) -> None:
    """Path writes a client forges fail before any file is made: a region too small
    for the size, a misaligned offset, memory never registered, a path the daemon
    does not resolve; a batch with two requests of one tag still answers each
    request for its own file (both made, exact)."""
    m = kvfs_mount.path
    sock = json.loads(os.getxattr(m, direct.MAP))["ring"]
    ring = client.connect(sock)
    assert ring is not None
    buf = client.shared(2 * MiB)
    buf[:] = pattern("forged", 2 * MiB)
    bad = [
        (b"small", buf, 0, 2 * MiB + 1, 0o644),  # past the region's end
        (b"skew", buf, 512, MiB, 0o644),  # not at a page boundary
        (b"a/../b", buf, 0, MiB, 0o644),  # the client resolves ``..`` through the mount
        (b"", buf, 0, MiB, 0o644),
    ]
    got = ring.write_paths(bad[:3])
    assert [g.errno if isinstance(g, OSError) else g for g in got] == [errno.EINVAL] * 3
    with pytest.raises(ValueError):  # an empty path is not even sent
        ring.write_paths(bad[3:])
    stray = wire.PathRequest(wire.OP_WRITE, 10**6, 5, 0, 4096, b"stray", 0o644)  # no region
    twins = [wire.PathRequest(wire.OP_WRITE, buf.region, 7, 0, MiB, b"t1", 0o644),
             wire.PathRequest(wire.OP_WRITE, buf.region, 7, MiB, MiB, b"t2", 0o644)]  # fmt: skip
    ring._sock.sendall(wire.submit_paths([stray]))
    assert wire.done_of(ring._sock.recv(wire.MAX_MESSAGE)) == [wire.Done(5, errno.EINVAL, 0)]
    ring._sock.sendall(wire.submit_paths(twins))  # buf was registered by the first batch
    done = [d for _ in range(2) for d in wire.done_of(ring._sock.recv(wire.MAX_MESSAGE))]
    assert [(d.tag, d.error, d.nbytes) for d in done] == [(7, 0, MiB)] * 2
    assert (m / "t1").read_bytes() == bytes(buf[:MiB])
    assert (m / "t2").read_bytes() == bytes(buf[MiB:])
    assert sorted(p.name for p in m.iterdir()) == ["t1", "t2"]
    assert _ring_counters(kvfs_mount)["created"] == 2


def test_a_failed_call_leaves_the_callers_buffer_free_to_close(kvfs_mount: KvfsMount) -> None:
    """A ``read_into``, ``read_many`` or ``write_many`` on the ring that fails (a
    missing file, a missing directory) holds no view of the caller's buffer once the
    error is handled: an ``mmap`` of the caller's closes at once, with the garbage
    collector off (the soak's readers, which reuse and close their buffers, met
    ``BufferError: cannot close exported pointers exist``)."""
    import gc

    os.environ["KVFS_DIRECT_ROUTE"] = "ring"
    (kvfs_mount.path / "here").write_bytes(pattern("here", MiB))
    gc.disable()
    try:
        calls: list[Callable[[mmap.mmap], object]] = [
            lambda b: direct.read_into(kvfs_mount.path / "gone", b),
            lambda b: direct.read_many(
                [(kvfs_mount.path / "here", b), (kvfs_mount.path / "gone", b)]
            ),
            lambda b: direct.write_many(
                [(kvfs_mount.path / "new", b), (kvfs_mount.path / "no/x", b)]
            ),
        ]
        for call in calls:
            buf = mmap.mmap(-1, 2 * MiB)
            with pytest.raises(FileNotFoundError):
                call(buf)
            buf.close()  # BufferError if any frame still held a view of it
    finally:
        gc.enable()
        os.environ.pop("KVFS_DIRECT_ROUTE", None)
    assert (kvfs_mount.path / "new").read_bytes() == bytes(2 * MiB)
