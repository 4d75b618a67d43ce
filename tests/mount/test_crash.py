"""Crash torture: kill -9 the daemon at random moments under a mixed load, recover, and
check the durability contract of ``docs/design.md`` against a model.

A worker process (this file run as a script) drives three threads on the mount, each
owning one top-level directory: create+write+close of files of random, unaligned
sizes, overwrites in place (no O_TRUNC), O_TRUNC rewrites, vLLM-style tmp+rename,
unlink, mkdir/rmdir, fsync, fsyncdir and verified reads, half of the files under a
hex-hash name (kept by its form, ``kvfs/index/nameforms.py``: an engine's frame, or
one with a request number that comes and goes, so forms are freed and reused).
Every operation is logged (outside the mount, one ``write`` per record to an
O_APPEND file: the worker machine does not crash, only the daemon) with a begin
record before the syscall and an end record after it returned. The checker replays
the log into per-path *versions*:

- a file's content is durable once its close (of a writable fd) or fsync returned;
- a namespace operation (create, unlink, rename, mkdir, rmdir) is durable once some
  durable point (close/fsync/fsyncdir returned) *began* after it returned — the
  journal is ordered, so that point's wait covered it; until then either state is
  allowed;
- a file being written, overwritten in place or O_TRUNC-rewritten may be absent
  (WRITING files are dropped); O_TRUNC may also leave it empty; a close or fsync in
  flight may have committed the new content; never torn.

The daemon is killed (and reaped) before the worker: a killed *writer* has its fds
closed by the kernel, which flushes (commits) its partial files — POSIX behaviour,
not a kvfs crash.

After recovery every path must hold one of the outcomes from its last durable version
on; any other file is a phantom; ``kvfs fsck`` must find no problem on the crashed
pool and, after a clean unmount, none with every data unit read and verified.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

MiB = 1 << 20
THREADS = 3
BUDGET = 30 * MiB  # live bytes per worker thread: far below the eviction watermark
ABSENT = "absent"
DIR = "dir"


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


EMPTY = digest(b"")


# =============================================================================== worker
class Worker:
    """One thread's share of the load; owns ``top`` and everything under it."""

    def __init__(self, mnt: str, top: str, state: dict[str, Any], rec: Any, seed: int) -> None:
        self.mnt, self.top, self.rec = mnt, top, rec
        self.rng = random.Random(seed)
        self.files: dict[str, str] = {}  # relpath -> digest (belief after the last op)
        self.sizes: dict[str, int] = {}
        self.dirs: set[str] = {top}
        for rel, v in state.items():
            if rel == top or rel.startswith(top + "/"):
                if v["kind"] == DIR:
                    self.dirs.add(rel)
                else:
                    self.files[rel], self.sizes[rel] = v["sha"], v["size"]
        self.serial = 0

    def p(self, rel: str) -> str:
        return os.path.join(self.mnt, rel)

    def new_name(self, suffix: str = "") -> str:
        self.serial += 1
        d = self.rng.choice(sorted(self.dirs))
        r, h = self.rng.random(), f"{self.rng.getrandbits(64):x}{self.serial:06x}"
        if r < 0.3:  # an engine's name: kept by its form (index/nameforms)
            return f"{d}/model@1@{os.getpid() % 3}@{h}@bfloat16.pt{suffix}"
        if r < 0.5:  # a frame that comes and goes: its form is freed, its id reused
            return f"{d}/{h}_req{self.serial // 4}.kv{suffix}"
        return f"{d}/f{os.getpid()}_{self.serial}{suffix}"

    def size(self) -> int:
        r = self.rng.random()
        if r < 0.15:
            return self.rng.choice([0, 1, 4095, 4096, 4097, MiB - 1, MiB, MiB + 1])
        if r < 0.9:
            return self.rng.randrange(1, 3 * MiB)
        return self.rng.randrange(3 * MiB, 10 * MiB)

    def write_all(self, fd: int, data: bytes, off: int = 0) -> None:
        view, pos = memoryview(data), 0
        while pos < len(view):
            n = self.rng.choice([4096, 65536, 131072, 1 << 20, 1500, 300000])
            done = os.pwrite(fd, view[pos : pos + n], off + pos)
            pos += done

    def close(self, fd: int, rel: str, sha: str, size: int) -> None:
        b = self.rec("B", "close", rel, sha=sha)
        os.close(fd)
        self.rec("E", "close", rel, sha=sha, b=b)
        self.files[rel], self.sizes[rel] = sha, size

    # ------------------------------------------------------------------ operations
    def op_create(self, rel: str | None = None) -> str:
        rel = rel or self.new_name()
        data = self.rng.randbytes(self.size())
        sha = digest(data)
        b = self.rec("B", "create", rel, sha=sha)
        fd = os.open(self.p(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.rec("E", "create", rel, b=b)
        self.write_all(fd, data)
        if self.rng.random() < 0.2:
            b = self.rec("B", "fsync", rel, sha=sha)
            os.fsync(fd)
            self.rec("E", "fsync", rel, sha=sha, b=b)
        self.close(fd, rel, sha, len(data))
        return rel

    def read_file(self, rel: str) -> bytes:
        with open(self.p(rel), "rb") as f:
            data = f.read()
        if digest(data) != self.files[rel]:
            self.rec("BAD", "read", rel, sha=digest(data), want=self.files[rel], n=len(data))
            raise RuntimeError(f"{rel}: read back wrong data")
        return data

    def op_overwrite(self) -> None:
        rel = self.rng.choice(sorted(self.files))
        data = bytearray(self.read_file(rel))
        edits = []
        for _ in range(self.rng.randint(1, 3)):
            off = self.rng.randrange(0, len(data) + 1)
            chunk = self.rng.randbytes(self.rng.randrange(1, 2 * MiB))
            edits.append((off, chunk))
            data[off : off + len(chunk)] = chunk
        sha = digest(bytes(data))
        b = self.rec("B", "overwrite", rel, sha=sha)
        fd = os.open(self.p(rel), os.O_WRONLY)
        self.rec("E", "overwrite", rel, b=b)
        for off, chunk in edits:
            self.write_all(fd, chunk, off)
        self.close(fd, rel, sha, len(data))

    def op_trunc(self) -> None:
        rel = self.rng.choice(sorted(self.files))
        data = self.rng.randbytes(self.size())
        sha = digest(data)
        b = self.rec("B", "trunc", rel, sha=sha)
        fd = os.open(self.p(rel), os.O_WRONLY | os.O_TRUNC)
        self.rec("E", "trunc", rel, b=b)
        self.write_all(fd, data)
        self.close(fd, rel, sha, len(data))

    def op_rename(self) -> None:
        """vLLM: write name.tmp, close, rename over the final name (maybe existing)."""
        if self.files and self.rng.random() < 0.5:
            dst = self.rng.choice(sorted(self.files))
        else:
            dst = self.new_name()
        self.serial += 1
        tmp = self.op_create(f"{dst}.{os.getpid()}_{self.serial}.tmp")
        sha = self.files[tmp]
        b = self.rec("B", "rename", tmp, dst=dst, sha=sha)
        os.rename(self.p(tmp), self.p(dst))
        self.rec("E", "rename", tmp, dst=dst, sha=sha, b=b)
        self.files[dst], self.sizes[dst] = sha, self.sizes.pop(tmp)
        del self.files[tmp]

    def op_unlink(self) -> None:
        rel = self.rng.choice(sorted(self.files))
        b = self.rec("B", "unlink", rel)
        os.unlink(self.p(rel))
        self.rec("E", "unlink", rel, b=b)
        del self.files[rel], self.sizes[rel]

    def op_mkdir(self) -> None:
        self.serial += 1
        rel = f"{self.rng.choice(sorted(self.dirs))}/d{os.getpid()}_{self.serial}"
        b = self.rec("B", "mkdir", rel)
        os.mkdir(self.p(rel))
        self.rec("E", "mkdir", rel, b=b)
        self.dirs.add(rel)

    def op_rmdir(self) -> None:
        busy = {r.rsplit("/", 1)[0] for r in [*self.files, *self.dirs]}
        empty = sorted(d for d in self.dirs if d != self.top and d not in busy)
        if not empty:
            return
        rel = self.rng.choice(empty)
        b = self.rec("B", "rmdir", rel)
        os.rmdir(self.p(rel))
        self.rec("E", "rmdir", rel, b=b)
        self.dirs.discard(rel)

    def op_fsyncdir(self) -> None:
        rel = self.rng.choice(sorted(self.dirs))
        fd = os.open(self.p(rel), os.O_RDONLY | os.O_DIRECTORY)
        try:
            b = self.rec("B", "fsyncdir", rel)
            os.fsync(fd)
            self.rec("E", "fsyncdir", rel, b=b)
        finally:
            os.close(fd)

    def op_read(self) -> None:
        self.read_file(self.rng.choice(sorted(self.files)))

    def step(self) -> None:
        used = sum(self.sizes.values())
        if used > BUDGET:
            return self.op_unlink()
        ops: list[tuple[Callable[[], object], int]] = [
            (self.op_create, 30),
            (self.op_mkdir, 3),
            (self.op_fsyncdir, 3),
        ]
        if self.files:
            ops += [(self.op_overwrite, 12), (self.op_trunc, 10), (self.op_rename, 12)]
            ops += [(self.op_unlink, 10), (self.op_read, 10)]
        ops.append((self.op_rmdir, 2))
        fn = self.rng.choices([f for f, _ in ops], [w for _, w in ops])[0]
        fn()


def worker_main(mnt: str, log_path: str, state_path: str, seed: int) -> None:
    state = json.loads(Path(state_path).read_text())
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    lock = threading.Lock()
    counter = [0]

    def rec(ev: str, op: str, path: str, **kw: Any) -> int:
        with lock:
            counter[0] += 1
            n = counter[0]
            line = json.dumps({"n": n, "ev": ev, "op": op, "path": path, **kw}) + "\n"
            os.write(log_fd, line.encode())
        return n

    def run(t: int) -> None:
        w = Worker(mnt, f"t{t}", state, rec, seed * 100 + t)
        while True:
            try:
                w.step()
            except OSError as e:
                rec("X", "error", "", errno=e.errno, msg=str(e), t=time.monotonic())
                return
            except RuntimeError:
                return

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


# =============================================================================== model
@dataclass
class Version:
    outcome: str  # a digest, ABSENT or DIR
    durable: bool = False
    done: int | None = None  # log number at which the op returned (None: in flight)
    promotable: bool = True  # namespace op: durable after a later durable point


@dataclass
class PathModel:
    versions: list[Version] = field(default_factory=list)

    def add(self, outcome: str, promotable: bool = True, durable: bool = False) -> Version:
        v = Version(outcome, durable=durable, promotable=promotable)
        self.versions.append(v)
        return v

    def allowed(self) -> set[str]:
        last = max((i for i, v in enumerate(self.versions) if v.durable), default=0)
        return {v.outcome for v in self.versions[last:]}

    def durable_outcome(self) -> str:
        return [v for v in self.versions if v.durable][-1].outcome


def build_model(baseline: dict[str, str], records: list[dict[str, Any]]) -> dict[str, PathModel]:
    """Replay the worker log into per-path versions (see the module docstring)."""
    model: dict[str, PathModel] = {}

    def m(path: str) -> PathModel:
        if path not in model:
            model[path] = PathModel([Version(ABSENT, durable=True)])
        return model[path]

    for path, outcome in baseline.items():
        model[path] = PathModel([Version(outcome, durable=True)])
    open_versions: dict[int, list[Version]] = {}  # begin number -> versions to complete
    pending: list[Version] = []  # completed namespace versions not yet durable

    def durable_point(begin: int) -> None:
        for v in pending:
            if v.done is not None and v.done < begin:
                v.durable = True
        pending[:] = [v for v in pending if not v.durable]

    for r in records:
        ev, op, path, n = r["ev"], r["op"], r["path"], r["n"]
        if ev == "B":
            if op == "create":
                open_versions[n] = [m(path).add(ABSENT)]
            elif op == "overwrite":
                m(path).add(ABSENT, promotable=False)
            elif op == "trunc":
                m(path).add(EMPTY, promotable=False)
                m(path).add(ABSENT, promotable=False)
            elif op == "rename":
                open_versions[n] = [m(path).add(ABSENT), m(r["dst"]).add(r["sha"])]
            elif op == "unlink" or op == "rmdir":
                open_versions[n] = [m(path).add(ABSENT)]
            elif op == "mkdir":
                open_versions[n] = [m(path).add(DIR)]
            elif op in ("close", "fsync"):
                m(path).add(r["sha"], promotable=False)  # in flight: may have committed
        elif ev == "E":
            for v in open_versions.pop(r["b"], []):
                v.done = n
                pending.append(v)
            if op in ("close", "fsync", "fsyncdir"):
                durable_point(r["b"])
                if op != "fsyncdir":
                    m(path).add(r["sha"], durable=True)
    return model


# =============================================================================== checker
def scan(mnt: Path) -> dict[str, tuple[str, int]]:
    """Every path under the mount: (digest or DIR, size)."""
    out: dict[str, tuple[str, int]] = {}
    for root, dirs, files in os.walk(mnt):
        for d in dirs:
            rel = os.path.relpath(os.path.join(root, d), mnt)
            out[rel] = (DIR, 0)
        for f in files:
            full = os.path.join(root, f)
            data = Path(full).read_bytes()
            out[os.path.relpath(full, mnt)] = (digest(data), len(data))
    return out


@dataclass
class Totals:
    loops: int = 0
    operations: int = 0
    files_checked: int = 0
    durable_verified: int = 0
    ambiguous_resolved: int = 0
    mid_write_dropped: int = 0
    fsck_runs: int = 0
    problems: list[str] = field(default_factory=list)


def check(
    model: dict[str, PathModel], actual: dict[str, tuple[str, int]], totals: Totals, loop: int
) -> None:
    for path in sorted(set(model) | set(actual)):
        got = actual.get(path, (ABSENT, 0))[0]
        if path not in model:
            totals.problems.append(f"loop {loop}: phantom {path} ({got})")
            continue
        pm = model[path]
        allowed = pm.allowed()
        if got not in allowed:
            durable = pm.durable_outcome()
            kind = (
                "lost durable file"
                if got == ABSENT
                else "corrupt durable file"
                if durable not in (ABSENT, DIR)
                else "phantom/torn content"
            )
            totals.problems.append(
                f"loop {loop}: {kind} {path}: got {got}, allowed {sorted(allowed)}, "
                f"versions {[(v.outcome[:8], v.durable, v.done) for v in pm.versions]}"
            )
            continue
        if got not in (ABSENT, DIR):
            totals.files_checked += 1
            if got == pm.durable_outcome():
                totals.durable_verified += 1
        if len(allowed) > 1:
            totals.ambiguous_resolved += 1
        tail = pm.versions[max(i for i, v in enumerate(pm.versions) if v.durable) :]
        if got == ABSENT and any(not v.promotable and v.outcome == ABSENT for v in tail):
            totals.mid_write_dropped += 1


# =============================================================================== the test
def kvfs(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfs", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(900)  # a hang guard: 15 loops of mount, load, kill -9, fsck
def test_kill9_torture(tmp_path: Path) -> None:
    import pytest

    from kvfs.format.records import allocated_size
    from kvfs.testing import harness
    from tests.conftest import require_fuse

    require_fuse()
    seed = int(os.environ.get("KVFS_CRASH_SEED", random.randrange(1 << 30)))
    loops = int(os.environ.get("KVFS_CRASH_LOOPS", "15"))
    rng = random.Random(seed)
    print(f"\ncrash torture: seed {seed} (rerun with KVFS_CRASH_SEED={seed})")
    image = harness.make_image(tmp_path / "pool.img", 384 * MiB)
    mnt, kvlog = tmp_path / "mnt", tmp_path / "kvfs.log"
    totals = Totals()
    baseline: dict[str, str] = {}
    model: dict[str, PathModel] = {}
    t_start = time.monotonic()
    first = True
    for loop in range(loops):
        extra = ["--format", "--meta-size", "8M"] if first else []
        with harness.mounted(mnt, [image], *extra, log_file=kvlog) as daemon:
            if first:
                for t in range(THREADS):
                    os.mkdir(mnt / f"t{t}")
                fd = os.open(mnt, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                baseline = {f"t{t}": DIR for t in range(THREADS)}
                model = build_model(baseline, [])
                first = False
            # ---- recovery check of the previous loop's crash
            actual = scan(mnt)
            check(model, actual, totals, loop)
            stats = json.loads(os.getxattr(mnt, "user.kvfs.stats"))["store"]
            files = {p: s for p, (o, s) in actual.items() if o != DIR}
            unit = stats["unit_size"]
            want_used = sum(allocated_size(s, unit) for s in files.values())
            if stats["files"] != len(files) or stats["used_bytes"] != want_used:
                totals.problems.append(
                    f"loop {loop}: after recovery the index says {stats['files']} files, "
                    f"{stats['used_bytes']} bytes used; the tree has {len(files)} files "
                    f"needing {want_used} bytes (leak or lost index entries)"
                )
            assert not totals.problems, "\n".join(totals.problems[:20])
            baseline = {p: o for p, (o, _) in actual.items()}
            # ---- load, then kill -9 at a random moment
            state = tmp_path / f"state{loop}.json"
            state.write_text(
                json.dumps(
                    {
                        p: {"kind": DIR} if o == DIR else {"kind": "file", "sha": o, "size": s}
                        for p, (o, s) in actual.items()
                    }
                )
            )
            wlog = tmp_path / f"ops{loop}.log"
            worker = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "worker",
                    str(mnt),
                    str(wlog),
                    str(state),
                    str(rng.randrange(1 << 30)),
                ]
            )
            try:  # a failure (or the hang guard) must not leave the worker running
                deadline = time.monotonic() + 10
                while not wlog.exists() and time.monotonic() < deadline and worker.poll() is None:
                    time.sleep(0.01)  # the worker is up (python start-up is not load)
                delay = rng.choice([0.05, 0.2]) if rng.random() < 0.2 else rng.uniform(0.3, 2.5)
                time.sleep(delay)
                killed_at = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
                daemon.kill()
                daemon.wait()  # dead before the worker: its exit must not close (commit) files
            finally:
                worker.kill()
                worker.wait()
            harness.unmount(mnt)
        records = []
        for line in (wlog.read_text() if wlog.exists() else "").splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a record cut by the kill
                records.append(json.loads(line))
        bad = [r for r in records if r["ev"] == "BAD"]
        assert not bad, f"loop {loop}: wrong data read while serving: {bad[:5]}"
        # An operation in flight when the daemon dies may fail with any errno (a
        # partial-page write whose read-in is aborted gets EIO from the kernel): only
        # failures recorded before the kill count, whatever their errno.
        errors = [
            r
            for r in records
            if r["ev"] == "X"
            and r["errno"] not in (errno.ENOTCONN, errno.ECONNABORTED)
            and r.get("t", 0.0) < killed_at
        ]
        totals.operations += sum(1 for r in records if r["ev"] == "B")
        assert not errors, f"loop {loop}: operations failed before the kill: {errors[:5]}"
        model = build_model(baseline, records)
        # ---- the crashed pool itself must be consistent (fsck replays like a mount)
        r = kvfs("fsck", "--no-data", str(image))
        totals.fsck_runs += 1
        assert r.returncode == 0 and " 0 problem(s)" in r.stdout, (
            f"loop {loop}: fsck of the crashed pool exited {r.returncode}:\n{r.stdout}{r.stderr}"
        )
        totals.loops += 1
    # ---- final recovery check, clean unmount, full fsck with data
    with harness.mounted(mnt, [image], log_file=kvlog):
        actual = scan(mnt)
        check(model, actual, totals, loops)
        assert not totals.problems, "\n".join(totals.problems[:20])
    r = kvfs("fsck", str(image))
    totals.fsck_runs += 1
    assert r.returncode == 0 and " 0 problem(s)" in r.stdout, f"{r.stdout}{r.stderr}"
    log_text = kvlog.read_text(errors="replace")
    assert "Traceback" not in log_text, log_text[-3000:]
    elapsed = time.monotonic() - t_start
    print(
        f"crash torture: {totals.loops} kill -9 loops, {totals.operations} operations started, "
        f"{totals.files_checked} files checked after recovery, {totals.durable_verified} "
        f"durable files verified byte-identical, {totals.ambiguous_resolved} not-yet-durable "
        f"paths in an allowed state, {totals.mid_write_dropped} mid-write files dropped, "
        f"{totals.fsck_runs} fsck runs clean, 0 corrupt, 0 phantom, 0 lost ({elapsed:.1f} s)"
    )
    if not totals.files_checked:
        pytest.fail("the torture checked no files at all")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
