"""Real-mount replays of the exact syscall patterns of LMCache, vLLM and SGLang
(docs: /work/shared/docs/engines.md), with plain ``os.*`` calls.

Every read is checked byte for byte against seeded data, and every read of a whole
file must return its full length in one call (the engines ignore or reject short
reads).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import random
import stat
import subprocess
import termios
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import KvfsMount, aligned, pattern

MiB = 1 << 20
PAGE = 4096


# ---------------------------------------------------------------------- LMCache
def lmcache_name(
    model: str,
    world: int,
    worker: int,
    chunk_hash: int,
    dtype: str = "bfloat16",
    tags: tuple[tuple[str, str], ...] = (),
    layer: int | None = None,
) -> str:
    """LMCache's flat file name: '/' in the model path becomes '-', the hash is a
    signed hex, tags append '@key%value' (free text), layerwise mode '@layer'."""
    name = f"{model}@{world}@{worker}@{chunk_hash:x}@{dtype}".replace("/", "-")
    for key, value in tags:
        name += f"@{key}%{value}"
    if layer is not None:
        name += f"@{layer}"
    return name + ".pt"


def lmcache_start(root: Path) -> os.statvfs_result:
    """Start-up: mkdir (EEXIST fine), stat, statfs."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(root)
    assert os.stat(root).st_mode & 0o040000
    st = os.statvfs(root)
    assert st.f_bsize == 4096, "LMCache needs f_bsize 4096 for O_DIRECT"
    return st


def lmcache_write_buffered(path: Path, data: bytes) -> None:
    """open(O_WRONLY|O_CREAT|O_TRUNC), fstat, ioctl(TCGETS), lseek(0, SEEK_CUR),
    ONE write() of the whole chunk, close. No fsync, no rename."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.fstat(fd)
        with pytest.raises(OSError) as tty:
            fcntl.ioctl(fd, termios.TCGETS, bytes(64))
        assert tty.value.errno == errno.ENOTTY
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
        assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)


def read_whole(path: Path, flags: int = 0) -> bytes:
    """open(O_RDONLY[|flags]) and ONE readinto of the whole file, which must return
    its full size (LMCache ignores the count: a short read would be corrupt KV)."""
    size = os.stat(path).st_size
    buf = aligned(size) if flags & os.O_DIRECT else bytearray(size)
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        with io.FileIO(fd, "rb", closefd=False) as f:
            n = f.readinto(memoryview(buf)[:size])
    finally:
        os.close(fd)
    assert n == size, f"short read of {path.name}: {n} of {size} bytes"
    return bytes(buf[:size])


def test_lmcache_buffered_chunks_four_writer_threads(kvfs_mount: KvfsMount) -> None:
    root = kvfs_mount.path / "lmcache"
    lmcache_start(root)
    lmcache_start(root)  # a restart: mkdir gets EEXIST
    rng = random.Random(1)
    models = ["meta-llama/Meta-Llama-3-8B", "/models/qwen/Qwen2-7B", "mistral"]
    chunk_sizes = [4 * MiB, 8 * MiB, 32 * MiB, 4 * MiB + 4096, 16 * MiB]
    jobs: list[tuple[str, int]] = []
    for worker in range(4):
        for i in range(3):
            h = rng.getrandbits(64) - (1 << 63)  # LMCache hashes are signed: '-...' names
            tags = (("user", "alice smith"), ("lora", "my adapter v2")) if i == 1 else ()
            name = lmcache_name(
                models[(worker + i) % 3], 4, worker, h, tags=tags, layer=i if i == 2 else None
            )
            jobs.append((name, chunk_sizes[(worker * 3 + i) % len(chunk_sizes)]))
    assert any(name.startswith("-") for name, _ in jobs)
    assert any("-" in name.split("@")[3][:1] for name, _ in jobs)
    assert any(" " in name for name, _ in jobs)

    def writer(worker: int) -> None:
        for name, size in jobs[worker * 3 : worker * 3 + 3]:
            lmcache_write_buffered(root / name, pattern(name, size))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(writer, range(4)))

    def reader(worker: int) -> None:
        for name, size in jobs[worker * 3 : worker * 3 + 3]:
            got = read_whole(root / name)
            assert got == pattern(name, size), f"{name}: bytes differ"

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(reader, range(4)))
    assert sorted(os.listdir(root)) == sorted(name for name, _ in jobs)

    # a restart: LMCache rewrites a chunk it already has on disk (O_TRUNC, new bytes)
    name, size = jobs[0]
    lmcache_write_buffered(root / name, pattern("v2", size))
    assert read_whole(root / name) == pattern("v2", size)
    kvfs_mount.remount()
    for name, size in jobs[1:]:
        assert read_whole(root / name) == pattern(name, size)
    assert read_whole(root / jobs[0][0]) == pattern("v2", jobs[0][1])


def test_lmcache_name_too_long_is_clean(kvfs_mount: KvfsMount) -> None:
    root = kvfs_mount.path / "lmcache"
    lmcache_start(root)
    model = "/models/" + "very-long-organisation-name/" * 6 + "Meta-Llama-3-70B-Instruct"
    long_name = lmcache_name(
        model,
        8,
        7,
        -0x498AFE385B3AB422,
        tags=(("tenant", "a tenant with spaces"), ("lora", "x" * 40)),
    )
    assert len(long_name.encode()) > 255
    with pytest.raises(OSError) as e:
        fd = os.open(root / long_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.close(fd)
    assert e.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as e:
        os.stat(root / long_name)
    assert e.value.errno == errno.ENAMETOOLONG
    # exactly 255 bytes is allowed, and the mount is still healthy
    ok = long_name[: 255 - 3] + ".pt"
    assert len(ok.encode()) == 255
    lmcache_write_buffered(root / ok, pattern(ok, 4 * MiB))
    assert read_whole(root / ok) == pattern(ok, 4 * MiB)
    assert os.listdir(root) == [ok]


def lmcache_write_direct(path: Path, data: bytes) -> None:
    """open(O_WRONLY|O_CREAT|O_DIRECT) WITHOUT O_TRUNC, one write() from an aligned
    buffer (LMCache does not check its return value; we do)."""
    buf = aligned(len(data))
    buf[: len(data)] = data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        assert os.write(fd, memoryview(buf)[: len(data)]) == len(data)
    finally:
        os.close(fd)
        buf.close()


def test_lmcache_odirect_write_overwrite_in_place_and_read(kvfs_mount: KvfsMount) -> None:
    root = kvfs_mount.path / "lmcache"
    st = lmcache_start(root)
    sizes = [4 * MiB, 8 * MiB, 32 * MiB, 12 * MiB + 8 * PAGE]
    names = [
        lmcache_name("meta-llama/Llama-3.1-8B", 2, i % 2, -(i + 1) * 0x1F3D5B79)
        for i in range(len(sizes))
    ]
    for name, size in zip(names, sizes, strict=True):
        assert size % st.f_bsize == 0  # the condition under which LMCache uses O_DIRECT
        lmcache_write_direct(root / name, pattern(("old", name), size))
    for name, size in zip(names, sizes, strict=True):
        assert read_whole(root / name, os.O_DIRECT) == pattern(("old", name), size)

    # after an engine restart it overwrites existing same-size files in place
    kvfs_mount.remount()
    for name, size in zip(names, sizes, strict=True):
        lmcache_write_direct(root / name, pattern(("new", name), size))
        assert os.stat(root / name).st_size == size
    for name, size in zip(names, sizes, strict=True):
        assert read_whole(root / name, os.O_DIRECT) == pattern(("new", name), size)
        assert read_whole(root / name) == pattern(("new", name), size)
    kvfs_mount.remount()
    for name, size in zip(names, sizes, strict=True):
        assert read_whole(root / name, os.O_DIRECT) == pattern(("new", name), size)


def _df(path: Path) -> tuple[int, int, int]:
    out = subprocess.run(
        ["df", "-B1", "--output=size,used,avail", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\n")[1]
    size, used, avail = map(int, out.split())
    return size, used, avail


def test_statfs_block_size_and_free_space_match_df(kvfs_mount: KvfsMount) -> None:
    mnt = kvfs_mount.path
    st = os.statvfs(mnt)
    assert st.f_bsize == 4096 and st.f_frsize == 4096
    assert st.f_namemax >= 255
    assert 0 < st.f_bavail <= st.f_bfree <= st.f_blocks
    stats = kvfs_mount.stats()["store"]
    assert st.f_blocks * st.f_frsize == stats["capacity_bytes"]
    assert st.f_bfree * st.f_frsize == stats["free_bytes"]
    assert (st.f_blocks * 4096, (st.f_blocks - st.f_bfree) * 4096, st.f_bavail * 4096) == _df(mnt)

    lmcache_write_buffered(mnt / "chunk.pt", pattern("statfs", 32 * MiB))
    after = os.statvfs(mnt)
    assert after.f_blocks == st.f_blocks
    assert (st.f_bfree - after.f_bfree) * 4096 >= 32 * MiB
    assert (
        after.f_blocks * 4096,
        (after.f_blocks - after.f_bfree) * 4096,
        after.f_bavail * 4096,
    ) == _df(mnt)
    os.unlink(mnt / "chunk.pt")


# ---------------------------------------------------------------------- vLLM fs tier
class VllmFsTier:
    """vLLM's ``fs`` secondary tier, syscall for syscall."""

    def __init__(self, root: Path, model: str, block_size: int, rank: int = 0) -> None:
        self.root = root
        sha12 = hashlib.sha256(model.encode()).hexdigest()[:12]
        self.model_dir = root / f"{model.replace('/', '-')}_{sha12}"
        self.rank_dir = root / f"{model.replace('/', '-')}_{sha12}_r{rank}"
        self.block_size = block_size
        self.o_direct = self.probe()

    def probe(self) -> bool:
        os.makedirs(self.root, exist_ok=True)
        probe = self.root / f".o_direct_probe_{uuid.uuid4().hex[:8]}.tmp"
        buf = aligned(PAGE)
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                assert os.write(fd, buf) == PAGE
            finally:
                os.close(fd)
            os.remove(probe)
        finally:
            buf.close()
        assert not probe.exists()
        return True

    def path(self, block_hash: str, group: int = 0) -> Path:
        return self.rank_dir / block_hash[:3] / f"{block_hash[3:5]}_g{group}" / f"{block_hash}.bin"

    def store(self, block_hash: str, data: bytes) -> bool:
        dest = self.path(block_hash)
        if os.path.exists(dest):
            return False
        os.makedirs(dest.parent, exist_ok=True)
        self._write_replace(dest, data)
        return True

    def _write_replace(self, dest: Path, data: bytes) -> None:
        tmp = f"{dest}_{uuid.uuid4().hex[:8]}.tmp"
        buf = aligned(len(data))
        buf[: len(data)] = data
        try:
            fd = os.open(
                tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o644
            )
            try:
                assert os.write(fd, memoryview(buf)[: len(data)]) == len(data)
            finally:
                os.close(fd)
        finally:
            buf.close()
        os.replace(tmp, dest)

    def load(self, block_hash: str) -> bytes:
        """O_RDONLY|O_DIRECT + readv into aligned (pinned) buffers: full length or fail."""
        buf = aligned(self.block_size)
        try:
            fd = os.open(self.path(block_hash), os.O_RDONLY | os.O_DIRECT)
            try:
                half = self.block_size // 2 // PAGE * PAGE
                with memoryview(buf) as view:
                    n = os.readv(fd, [view[:half], view[half : self.block_size]])
            finally:
                os.close(fd)
            assert n == self.block_size, f"short read: {n} of {self.block_size}"
            return bytes(buf[: self.block_size])
        finally:
            buf.close()

    def lookup(self, block_hash: str) -> bool:
        try:
            st = os.stat(self.path(block_hash))
        except FileNotFoundError:
            return False
        return st.st_size == self.block_size


def block_hashes(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(128):032x}" for _ in range(n)]


def test_vllm_fs_tier_store_load_lookup(kvfs_mount: KvfsMount) -> None:
    block = 192 * 1024  # not a multiple of the unit: blocks share no unit boundaries
    tier = VllmFsTier(kvfs_mount.path / "vllm", "meta-llama/Llama-3.1-8B-Instruct", block)
    os.makedirs(tier.model_dir, exist_ok=True)
    (tier.model_dir / "config.json").write_text(json.dumps({"block_size": block}))
    hits = block_hashes(7, 160)
    misses = block_hashes(8, 2000)

    with ThreadPoolExecutor(16) as pool:  # 16 write threads by default
        stored = list(pool.map(lambda h: tier.store(h, pattern(h, block)), hits))
    assert all(stored)
    with ThreadPoolExecutor(16) as pool:  # a second store of the same blocks is skipped
        assert not any(pool.map(lambda h: tier.store(h, pattern("x", block)), hits))
    with ThreadPoolExecutor(16) as pool:
        loaded = list(pool.map(tier.load, hits))
    for h, data in zip(hits, loaded, strict=True):
        assert data == pattern(h, block), f"block {h}: bytes differ"
    assert not [p for p in tier.rank_dir.rglob("*.tmp")]
    assert json.loads((tier.model_dir / "config.json").read_text()) == {"block_size": block}

    # lookup storms: thousands of stat calls on hits and misses, twice (cached verdicts)
    t0 = time.monotonic()
    for _ in range(2):
        assert all(tier.lookup(h) for h in hits * 6)
        assert not any(tier.lookup(h) for h in misses)
        assert all(os.access(tier.path(h), os.F_OK) for h in hits)
    storm = time.monotonic() - t0
    assert storm < 60, f"{2 * (len(hits) * 7 + len(misses))} lookups took {storm:.1f} s"
    # a miss that was just looked up becomes a hit as soon as it is stored (no stale
    # negative entry), and a removed block becomes a miss at once
    assert tier.store(misses[0], pattern(misses[0], block))
    assert tier.lookup(misses[0]) and tier.load(misses[0]) == pattern(misses[0], block)
    os.unlink(tier.path(hits[0]))
    assert not tier.lookup(hits[0])
    with pytest.raises(FileNotFoundError):
        tier.load(hits[0])

    # optional CRC32C in an xattr
    for h in hits[1:20]:
        crc = str(zlib.crc32(pattern(h, block))).encode()
        os.setxattr(tier.path(h), "user.vllm.kv_crc32c", crc)
    for h in hits[1:20]:
        assert (
            os.getxattr(tier.path(h), "user.vllm.kv_crc32c")
            == str(zlib.crc32(tier.load(h))).encode()
        )
        assert "user.vllm.kv_crc32c" in os.listxattr(tier.path(h))


def test_vllm_replace_is_atomic_for_concurrent_readers(kvfs_mount: KvfsMount) -> None:
    block = 1 * MiB + 64 * 1024
    tier = VllmFsTier(kvfs_mount.path / "vllm", "Qwen/Qwen2-7B", block)
    h = block_hashes(3, 1)[0]
    versions = [pattern(("v", i), block) for i in range(2)]
    assert tier.store(h, versions[0])
    done = threading.Event()
    seen = [0, 0]
    errors: list[str] = []

    def read_loop() -> None:
        while not done.is_set():
            try:
                data = tier.load(h)
            except (OSError, AssertionError) as e:
                errors.append(repr(e))
                return
            if data == versions[0]:
                seen[0] += 1
            elif data == versions[1]:
                seen[1] += 1
            else:
                errors.append("a reader saw neither the old nor the new block")
                return

    readers = [threading.Thread(target=read_loop) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for i in range(40):
            tier._write_replace(tier.path(h), versions[(i + 1) % 2])
            assert tier.load(h) == versions[(i + 1) % 2]
    finally:
        done.set()
        for t in readers:
            t.join(30)
    assert not errors, errors[:3]
    assert sum(seen) > 0
    assert [p.name for p in tier.path(h).parent.iterdir()] == [f"{h}.bin"]


# ---------------------------------------------------------------------- SGLang HiCacheFile
def sglang_store(path: Path, data: bytes) -> None:
    """tofile(path + '.tmp.<pid>.<tid>.<uuid>') (buffered writes), then os.replace."""
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        view = memoryview(data)
        for off in range(0, len(data), 256 * 1024):  # fwrite in pieces, like tofile
            f.write(view[off : off + 256 * 1024])
    os.replace(tmp, path)


def sglang_load(path: Path, size: int) -> bytes:
    buf = bytearray(size)
    with open(path, "rb", buffering=0) as f:
        n = f.readinto(buf)
    assert n == size, f"short read: {n} of {size}"
    return bytes(buf)


def sglang_name(key: str, model: str = "Llama-3.1-8B", tp_rank: int = 0, tp_size: int = 1) -> str:
    return f"{key}_{model}_{tp_rank}_{tp_size}.bin"


def test_sglang_hicache_file_store_load(kvfs_mount: KvfsMount) -> None:
    root = kvfs_mount.path / "hicache"
    root.mkdir()
    page = 2 * MiB + 12345  # not page-aligned: buffered writes of any size
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(48)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda k: sglang_store(root / sglang_name(k), pattern(k, page)), keys))
    for k in keys:
        assert os.path.exists(root / sglang_name(k))
        assert sglang_load(root / sglang_name(k), page) == pattern(k, page)
    # store again over existing pages (replace), then reload
    for k in keys[:8]:
        sglang_store(root / sglang_name(k), pattern(("again", k), page))
    for k in keys:
        want = pattern(("again", k), page) if k in keys[:8] else pattern(k, page)
        assert sglang_load(root / sglang_name(k), page) == want
    assert not [n for n in os.listdir(root) if ".tmp." in n]


@pytest.mark.timeout(600)
@pytest.mark.mount_options("--meta-size", "32M")  # 20k files: an area sized for them
def test_sglang_scandir_of_a_flat_directory_with_20k_entries(kvfs_mount: KvfsMount) -> None:
    root = kvfs_mount.path / "hicache"
    root.mkdir()
    n = 20_000
    names = [
        sglang_name(
            f"{i:06d}{hashlib.md5(str(i).encode()).hexdigest()[:10]}", tp_rank=i % 4, tp_size=4
        )
        for i in range(n)
    ]
    with_data = set(names[::500])
    for name in names:
        if name in with_data:
            sglang_store(root / name, pattern(name, 64 * 1024))
        else:  # empty pages (mknod: one request) keep the pool small and the test fast
            os.mknod(root / name, 0o644 | stat.S_IFREG)
    for _ in range(2):  # per-batch lookups scan the whole directory
        seen: dict[str, int] = {}
        with os.scandir(root) as it:
            for entry in it:
                seen[entry.name] = seen.get(entry.name, 0) + 1
                assert entry.is_file(follow_symlinks=False)
        assert len(seen) == n, f"scandir returned {len(seen)} distinct names, not {n}"
        assert set(seen) == set(names)
        assert all(c == 1 for c in seen.values()), "a name was returned twice"
    for name in sorted(with_data):
        assert sglang_load(root / name, 64 * 1024) == pattern(name, 64 * 1024)
