"""The zero-copy path (:mod:`kvfs.client.direct` against a real mount, :mod:`kvfs.store.leases`):
bytes exact under rewrites, eviction, corruption and a killed writer; the same bytes
through FUSE and directly, both ways; an ordinary user through the daemon's ring.

Every test runs on both aware routes (``route``): ``devices``, this process opening
the pool's devices, and ``ring``, the daemon moving the bytes into this process's
shared memory (``KVFS_DIRECT_ROUTE=ring``: what a process that may not open the
devices gets). :mod:`tests.mount.test_ring` holds what only the ring has."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import kvfs.client.direct as direct
from kvfs.format import ring as wire
from tests.conftest import KvfsMount, errno_of, pattern, wait_for

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
SIZES = [1, 4095, 4097, MiB, MiB + 17, 3 * MiB - 5, 8 * MiB, 32 * MiB]


@pytest.fixture(autouse=True, params=["devices", "ring"])
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The aware route every test of this module runs on."""
    monkeypatch.setenv("KVFS_DIRECT_ROUTE", request.param)
    return str(request.param)


def moved(stats: dict[str, int], route: str, what: str) -> int:
    """The route's counter ``what`` (reads, writes, bytes_read, bytes_written)."""
    return stats[f"{'direct' if route == 'devices' else 'ring'}_{what}"]


def _stats(mount: KvfsMount) -> dict[str, int]:
    out: dict[str, int] = mount.stats()["direct"]
    return out


@pytest.mark.parametrize("where", ["kvfs_mount", "loop_mount"])
def test_direct_and_fuse_bytes_agree_both_ways(
    where: str, route: str, request: pytest.FixtureRequest
) -> None:
    """Every size (fragment tails, partial whole units, stripes over two members),
    aligned and unaligned buffers, read-only sources: written one way, read back the
    other way, bit-identical; and the direct calls really took the direct path."""
    mount: KvfsMount = request.getfixturevalue(where)  # an image file; two loop devices
    before = direct.stats()
    for size in SIZES:
        data = pattern((where, size), size)
        a, b = mount.path / f"direct-{size}", mount.path / f"fuse-{size}"
        assert direct.write_from(a, data) == size
        b.write_bytes(data)
        assert a.read_bytes() == data, size
        assert a.stat().st_size == size
        for target in (b, a):
            buf = direct.aligned(size)
            assert direct.read_into(target, buf) == size
            assert buf[:size] == data, (target, size)
            unaligned = memoryview(bytearray(size + 1))[1:]
            assert direct.read_into(target, unaligned) == size
            assert bytes(unaligned) == data, (target, size)
    after = direct.stats()
    assert moved(after, route, "reads") - moved(before, route, "reads") == 4 * len(SIZES)
    assert moved(after, route, "writes") - moved(before, route, "writes") == len(SIZES)
    assert after["fallback_reads"] == before["fallback_reads"]
    assert after["bounced_bytes"] > before["bounced_bytes"]  # the unaligned ones
    s = _stats(mount)
    assert s["commits"] == len(SIZES) and s["aborts"] == 0
    mount.remount()
    for size in SIZES:
        buf = direct.aligned(size)
        assert direct.read_into(mount.path / f"direct-{size}", buf) == size
        assert buf[:size] == pattern((where, size), size)


def test_small_buffer_and_missing_file(kvfs_mount: KvfsMount) -> None:
    p = kvfs_mount.path / "f"
    direct.write_from(p, pattern("f", 2 * MiB))
    with pytest.raises(ValueError):
        direct.read_into(p, bytearray(MiB))
    with pytest.raises(FileNotFoundError):
        direct.read_into(kvfs_mount.path / "missing", bytearray(MiB))
    assert direct.available(kvfs_mount.path) and direct.available(p)


def test_replacing_a_file_is_seen_through_fuse(kvfs_mount: KvfsMount) -> None:
    """A direct write over a file whose pages and size the kernel cached: a FUSE
    reader sees the new bytes and size at once, never the old size's cut."""
    p = kvfs_mount.path / "chunk"
    p.write_bytes(pattern("old", MiB))
    assert p.read_bytes() == pattern("old", MiB)  # cached by the kernel
    direct.write_from(p, pattern("new", 3 * MiB))
    assert p.read_bytes() == pattern("new", 3 * MiB)


def test_a_lease_keeps_the_old_units_from_reuse(small_mount: KvfsMount, route: str) -> None:
    """While a mapped file is open its old units are not reused, however much is
    rewritten meanwhile: a direct reader of the old map still gets the old bytes,
    all verified; the units go back once the file closes."""
    mnt = small_mount.path
    p = mnt / "leased"
    old = pattern("old", 16 * MiB)
    direct.write_from(p, old)
    fd = os.open(p, os.O_RDONLY)
    try:
        info = json.loads(os.getxattr(fd, direct.MAP))
        # rewrite the leased file and churn the rest of the pool several times over
        direct.write_from(p, pattern("new", 16 * MiB))
        for i in range(24):
            direct.write_from(mnt / f"churn{i % 4}", pattern(("c", i), 16 * MiB))
        assert _stats(small_mount)["held_units"] == 16
        buf = direct.aligned(len(old))
        if route == "devices":
            fds = direct._devices(info, write=False)
            assert fds is not None
            assert direct._read_runs(info, fds, memoryview(buf))
        else:  # the daemon reads the old map's units, verified, for this open's ticket
            ring = direct._ring(info)
            assert ring is not None
            direct._ring_move(ring, wire.OP_READ, info, memoryview(buf))
        assert buf[:] == old
    finally:
        os.close(fd)
    wait_for(lambda: _stats(small_mount)["held_units"] == 0, what="the lease to end")
    assert direct.read_into(p, direct.aligned(16 * MiB)) == 16 * MiB


def test_eviction_pressure_during_direct_reads(small_mount: KvfsMount) -> None:
    """Readers loop over the written files while a writer overfills the pool: every
    read is the file's exact bytes or a clean miss (evicted), never wrong or short."""
    mnt = small_mount.path
    size, stop, bad, reads, done = 8 * MiB, threading.Event(), [], [0, 0], [8]
    for i in range(8):
        direct.write_from(mnt / f"f{i}", pattern(i, size))

    def reader(k: int) -> None:
        buf = direct.aligned(size)
        while not stop.is_set():
            for i in range(k, done[0], 2):
                try:
                    n = direct.read_into(mnt / f"f{i}", buf)
                except FileNotFoundError:
                    reads[1] += 1
                    continue
                reads[0] += 1
                if n != size or buf[:] != pattern(i, size):
                    bad.append((i, n))

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(8, 64):  # 448 MiB through a 128 MiB pool
            direct.write_from(mnt / f"f{i}", pattern(i, size))
            done[0] = i + 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not bad
    assert reads[0] > 0
    assert small_mount.stats()["eviction"]["evictions"] > 0


def test_a_corrupt_unit_is_eio_never_served(kvfs_mount: KvfsMount, tmp_path: Path) -> None:
    p = kvfs_mount.path / "victim"
    direct.write_from(p, pattern("v", 4 * MiB))
    fd = os.open(p, os.O_RDONLY)
    try:
        info = json.loads(os.getxattr(fd, direct.MAP))
    finally:
        os.close(fd)
    kvfs_mount.stop()
    dev, offset = info["runs"][0][0], info["runs"][0][1] + MiB + 100  # inside unit 1
    with open(info["devices"][dev]["path"], "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    kvfs_mount.expect_errors += ["checksum mismatch", "quarantined or gone"]
    kvfs_mount.start()
    before = direct.stats()["checksum_failures"]
    assert errno_of(direct.read_into, p, direct.aligned(4 * MiB)) == errno.EIO
    assert direct.stats()["checksum_failures"] == before + 1
    assert not p.exists()  # quarantined


_KILLED_WRITER = """
import json, os, secrets, sys, time
sys.path.insert(0, sys.argv[3])
import kvfs.client.direct as d
path, size = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
plan = json.loads(os.getxattr(fd, d.RESERVE + f"{size}.{secrets.token_hex(4)}"))
run = plan["runs"][0]
dfd = d._device(plan["devices"][run[0]], write=True)
buf = d.aligned(1 << 20)
buf[:] = b"x" * len(buf)
os.pwrite(dfd, buf, run[1])
child = os.fork() if sys.argv[4] == "forked" else -1
if child == 0:  # holds a copy of the descriptor, outliving the writer
    time.sleep(60)
    os._exit(0)
print("reserved", child, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["killed", "closed", "killed-forked", "closed-shared"])
def test_an_uncommitted_direct_write_leaves_nothing(kvfs_mount: KvfsMount, how: str) -> None:
    """A client that reserved and wrote part of a file, then was killed (or closed
    it without committing): the file is gone and its room is free again. A killed
    writer's room comes back at once even while a child it forked still holds the
    descriptor; a closed one's when the last copy of its descriptor closes."""
    p = kvfs_mount.path / "partial"
    free = kvfs_mount.stats()["store"]["free_bytes"]
    if how.startswith("killed"):
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_WRITER, str(p), str(8 * MiB), str(REPO), how[7:]],
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        said, child = proc.stdout.readline().split()
        assert said == b"reserved"
        assert kvfs_mount.stats()["store"]["free_bytes"] < free
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        if int(child) > 0:  # the child keeps the file open: only the room comes back
            wait_for(lambda: _stats(kvfs_mount)["aborts"] == 1, what="the write abandoned")
            wait_for(lambda: kvfs_mount.stats()["store"]["free_bytes"] == free, what="room")
            os.kill(int(child), 0)  # still alive, still holding the descriptor
            os.kill(int(child), signal.SIGKILL)
            # the child's close flushes a failed file: EIO, as any later flush of it
            kvfs_mount.expect_errors.append("flush: .*direct write closed before its commit")
    else:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.getxattr(fd, direct.RESERVE + f"{8 * MiB}.abc")
        holder = None
        if how == "closed-shared":  # a child holds a copy of the descriptor
            holder = subprocess.Popen(
                [sys.executable, "-c", "import sys; sys.stdin.read()"],
                pass_fds=(fd,),
                stdin=subprocess.PIPE,
            )
        os.close(fd)
        if holder is not None:
            assert holder.stdin is not None
            holder.stdin.close()  # the child exits: the descriptor's last close
            assert holder.wait() == 0
    wait_for(lambda: not p.exists(), what="the incomplete file to go")
    wait_for(lambda: kvfs_mount.stats()["store"]["free_bytes"] == free, what="room back")
    assert _stats(kvfs_mount)["aborts"] == 1
    kvfs_mount.expect_errors.append("could not be committed")
    kvfs_mount.remount()
    assert not p.exists()


def test_a_forked_child_cannot_abandon_a_direct_write(kvfs_mount: KvfsMount, route: str) -> None:
    """Another thread starts subprocesses all the time, as engines do: each child
    inherits the writer's descriptor and closes it at exec (a FLUSH of the writer's
    handle). Only the writer's own last close abandons its write, so every write
    succeeds and every file is exact, through FUSE and directly."""
    m = kvfs_mount.path
    sizes = [8 * MiB + i * (5 * MiB // 2) + i for i in range(10)]  # 8 to 31 MiB, odd tails
    stop, spawned, errors = threading.Event(), [0], []

    def spawn() -> None:
        try:
            while not stop.is_set():
                subprocess.run(["true"], check=True)
                spawned[0] += 1
        except BaseException as e:
            errors.append(e)

    before = moved(direct.stats(), route, "writes")
    spawner = threading.Thread(target=spawn)
    spawner.start()
    try:
        for i, size in enumerate(sizes):
            assert direct.write_from(m / f"f{i}", pattern(("fork", i), size)) == size
    finally:
        stop.set()
        spawner.join()
    assert not errors and spawned[0] > 0
    # and one child forked for certain between the reservation and the commit
    fd = os.open(m / "g", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        plan = json.loads(os.getxattr(fd, direct.RESERVE + f"{4 * MiB}.n1"))
        subprocess.run(["true"], check=True)  # its exec closes the inherited fd: a FLUSH
        g = memoryview(pattern("g", 4 * MiB))
        commit: dict[str, object] = {"nonce": "n1"}
        if route == "devices":
            fds = direct._devices(plan, write=True)
            assert fds is not None
            sums = [0] * -(-4 * MiB // plan["unit"])
            direct._wait(direct._submit_runs(plan, fds, g, sums))
            commit["csums"] = sums
        else:  # the daemon writes, and keeps the checksums it computed
            ring = direct._ring(plan)
            assert ring is not None
            direct._ring_move(ring, wire.OP_WRITE, plan, g)
        os.setxattr(fd, direct.COMMIT, json.dumps(commit).encode())
    finally:
        os.close(fd)
    assert moved(direct.stats(), route, "writes") - before == len(sizes)
    assert _stats(kvfs_mount)["aborts"] == 0
    files = {f"f{i}": pattern(("fork", i), size) for i, size in enumerate(sizes)}
    files["g"] = pattern("g", 4 * MiB)
    for name, data in files.items():
        assert (m / name).read_bytes() == data, name
        buf = direct.aligned(len(data))
        assert direct.read_into(m / name, buf) == len(data)
        assert buf[:] == data, name


def test_a_full_pool_fails_the_write_and_leaves_no_file(small_mount: KvfsMount) -> None:
    p = small_mount.path / "huge"
    assert errno_of(direct.write_from, p, direct.aligned(200 * MiB)) in (errno.ENOSPC, errno.EFBIG)
    wait_for(lambda: not p.exists(), what="the failed file to go")


def test_a_batch_is_whole_files_even_when_one_fails(small_mount: KvfsMount) -> None:
    """write_many: every file of a batch exact (through FUSE and directly, across a
    remount); one that cannot be stored (a missing directory, a file over the pool)
    raises after the others are committed, and leaves nothing behind."""
    m = small_mount.path
    sizes = {"a": 1, "b": 4097, "c": 3 * MiB - 5, "d": 8 * MiB, "e": 0}
    items = [(m / n, pattern(n, size)) for n, size in sizes.items()]
    assert direct.write_many(items) == list(sizes.values())
    bad = [(m / "x", pattern("x", MiB)), (m / "no-dir" / "y", b"y"), (m / "z", pattern("z", 5))]
    with pytest.raises(FileNotFoundError):
        direct.write_many(bad)
    huge = [(m / "h1", pattern("h1", 2 * MiB)), (m / "huge", direct.aligned(200 * MiB))]
    assert errno_of(direct.write_many, huge) in (errno.ENOSPC, errno.EFBIG)
    wait_for(lambda: not (m / "huge").exists(), what="the failed file to go")
    stored = {**sizes, "x": MiB, "z": 5, "h1": 2 * MiB}
    for rounds in range(2):
        assert sorted(os.listdir(m)) == sorted(stored)
        for n, size in stored.items():
            assert (m / n).read_bytes() == pattern(n, size), n
            buf = direct.aligned(max(size, 1))
            assert direct.read_into(m / n, buf) == size
            assert buf[:size] == pattern(n, size), n
        if not rounds:
            small_mount.remount()
    small_mount.expect_errors.append("could not be committed")


_TENSORS = """
import json, sys
sys.path.insert(0, sys.argv[2])
import torch
import kvfs.client.direct as direct
root = sys.argv[1]
n = 3 * (1 << 20) + 4096  # 3 MiB of bf16 and a partial unit
src = (torch.arange(n // 2, dtype=torch.float32) * 0.37).to(torch.bfloat16).reshape(-1, 1024)
assert direct.write_from(root + "/t.bin", src) == n
out = {"written": bytes(src.view(torch.uint8).reshape(-1).numpy()).hex()}
aligned = torch.frombuffer(direct.aligned(n), dtype=torch.bfloat16).reshape(src.shape)
before = direct.stats()["bounced_bytes"]
assert direct.read_into(root + "/t.bin", aligned) == n and torch.equal(aligned, src)
out["bounced_aligned"] = direct.stats()["bounced_bytes"] - before
plain = torch.zeros(n + 10, dtype=torch.uint8)[10:]  # off the page: bounced
assert direct.read_into(root + "/t.bin", plain) == n
assert torch.equal(plain.view(torch.bfloat16).reshape(src.shape), src)
try:
    direct.read_into(root + "/t.bin", aligned.t())
except ValueError:
    out["non_contiguous"] = "refused"
out.update(direct.stats())
print(json.dumps(out))
"""


def test_torch_tensors_in_and_out(kvfs_mount: KvfsMount, route: str) -> None:
    """A torch tensor of any dtype is a buffer both ways (its bytes, shared, no copy
    when page-aligned); the file holds exactly the tensor's bytes; a non-contiguous
    tensor is refused. Runs in the engines venv, which has the CPU torch."""
    from tests.engines.test_engines import engines_python

    out = subprocess.run(
        [engines_python(), "-c", _TENSORS, str(kvfs_mount.path), str(REPO)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    data = (kvfs_mount.path / "t.bin").read_bytes()
    assert len(data) == 3 * MiB + 4096 and data.hex() == got["written"]
    assert moved(got, route, "writes") == 1 and moved(got, route, "reads") == 2
    assert got["fallback_reads"] == 0
    # only the partial last unit, which the ring's daemon bounces on its side
    assert got["bounced_aligned"] == (4096 if route == "devices" else 0)
    assert got["bounced_bytes"] > 3 * MiB and got["non_contiguous"] == "refused"


def test_concurrent_direct_streams(loop_mount: KvfsMount) -> None:
    """Four streams writing and reading their own files at once, each read exact."""
    errors: list[BaseException] = []

    def stream(k: int) -> None:
        try:
            buf = direct.aligned(8 * MiB)
            for i in range(6):
                p = loop_mount.path / f"s{k}-{i}"
                direct.write_from(p, pattern((k, i), 8 * MiB))
                assert direct.read_into(p, buf) == 8 * MiB
                assert buf[:] == pattern((k, i), 8 * MiB)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_another_close_cannot_leave_an_abandoned_direct_write_empty(
    kvfs_mount: KvfsMount,
) -> None:
    """Another writable handle's close commits the (still empty) file while a direct
    write is reserved; the direct writer then gives up: the file must go, not stay as
    an empty chunk."""
    p = kvfs_mount.path / "shared"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.getxattr(fd, direct.RESERVE + f"{4 * MiB}.n1")
    other = os.open(p, os.O_WRONLY)
    os.close(other)  # a FLUSH: commits the empty file
    os.close(fd)  # no commit: abandoned
    wait_for(lambda: not p.exists(), what="the abandoned file to go")
    kvfs_mount.remount()
    assert not p.exists()
