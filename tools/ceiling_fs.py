#!/usr/bin/env python3
"""The binding ceiling: the least a pyfuse3 + trio filesystem can do per byte.

Usage (root): ``ceiling_fs.py DEVICE MOUNTPOINT`` (foreground; unmount to stop).

One flat directory of regular files on a block device opened with ``O_DIRECT``.
A file is a list of 1 MiB units taken from a free list (so a FUSE request of up to
1 MiB is one device request); every FUSE READ/WRITE is one ``preadv``/``pwritev``
in ``trio.to_thread`` through a page-aligned buffer. No checksums, no cache of its
own, no readahead of its own, no journal, metadata in memory only (lost at
unmount). ``close`` of a written file does one ``fdatasync`` of the device, as a
kvfs close is durable. Files are opened with ``keep_cache`` and the mount's kernel
readahead is raised to 4 MiB as kvfs does, so both see the same kernel behaviour.
``getxattr user.ceiling.stats`` on the root returns request counts as JSON.
Only what ``tools/bench.py`` needs: unaligned write offsets are EINVAL.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import sys
import time
from typing import Any

import pyfuse3
import trio

UNIT = 1 << 20
ALIGN = 4096


class Node:
    def __init__(self, ino: int, mode: int) -> None:
        self.ino, self.mode, self.size = ino, mode, 0
        self.units: list[int] = []
        self.ns = time.time_ns()


class CeilingFS(pyfuse3.Operations):  # type: ignore[misc]
    enable_writeback_cache = False

    def __init__(self, dev: str) -> None:
        super().__init__()
        self.fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
        nunits = os.lseek(self.fd, 0, os.SEEK_END) // UNIT
        self.free = list(range(nunits - 1, -1, -1))  # pop() gives the lowest first
        root = Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o777)
        self.nodes: dict[int, Node] = {root.ino: root}
        self.names: dict[bytes, int] = {}
        self.next_ino = root.ino + 1
        self.spare: list[mmap.mmap] = []  # aligned buffers, reused when unreferenced
        self.dirty: set[int] = set()
        self.counts = {"reads": 0, "writes": 0, "read_bytes": 0, "syncs": 0}

    # ---------------------------------------------------------------- helpers
    def _buffer(self, size: int) -> mmap.mmap:
        for b in self.spare:  # a reply's memoryview holds a reference until sent
            if len(b) >= size and sys.getrefcount(b) == 3:  # list, b, the call
                return b
        b = mmap.mmap(-1, max(size, UNIT), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if len(self.spare) < 256:
            self.spare.append(b)
        return b

    def _runs(self, node: Node, off: int, end: int) -> list[tuple[int, int, int]]:
        """(device offset, buffer offset, length) pieces of off..end, merged when
        their units are adjacent on the device."""
        out: list[tuple[int, int, int]] = []
        pos = off
        while pos < end:
            u, skip = divmod(pos, UNIT)
            n = min(UNIT - skip, end - pos)
            dev = node.units[u] * UNIT + skip
            if out and out[-1][0] + out[-1][2] == dev:
                d, b, ln = out[-1]
                out[-1] = (d, b, ln + n)
            else:
                out.append((dev, pos - off, n))
            pos += n
        return out

    def _attr(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino, a.st_mode, a.st_size = node.ino, node.mode, node.size
        a.st_nlink = 2 if stat.S_ISDIR(node.mode) else 1
        a.st_uid = a.st_gid = 0
        a.st_blksize = UNIT
        a.st_blocks = len(node.units) * (UNIT // 512)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.ns
        a.entry_timeout = a.attr_timeout = 300.0
        return a

    def _truncate(self, node: Node, size: int) -> None:
        keep = -(-size // UNIT)
        self.free.extend(reversed(node.units[keep:]))
        del node.units[keep:]
        node.size = size

    # ---------------------------------------------------------------- handlers
    async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> Any:
        ino = self.names.get(name) if parent == pyfuse3.ROOT_INODE else None
        if ino is None:
            miss = pyfuse3.EntryAttributes()
            miss.st_ino, miss.entry_timeout = 0, 300.0
            return miss
        return self._attr(self.nodes[ino])

    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        return self._attr(self.nodes[inode])

    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
        node = self.nodes[inode]
        if fields.update_size:
            if attr.st_size > len(node.units) * UNIT:
                raise pyfuse3.FUSEError(errno.EINVAL)  # only shrinking is needed
            self._truncate(node, attr.st_size)
        return self._attr(node)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, ctx: Any) -> Any:
        if parent != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTSUP)
        ino = self.names.get(name)
        if ino is None:
            ino, self.next_ino = self.next_ino, self.next_ino + 1
            self.nodes[ino] = Node(ino, stat.S_IFREG | stat.S_IMODE(mode))
            self.names[name] = ino
        return pyfuse3.FileInfo(fh=ino, keep_cache=True), self._attr(self.nodes[ino])

    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        if flags & os.O_TRUNC:
            self._truncate(self.nodes[inode], 0)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> Any:
        node = self.nodes[fh]
        end = min(off + size, node.size)
        if off >= end:
            return b""
        start = off & ~(ALIGN - 1)
        length = -(-(end - start) // ALIGN) * ALIGN
        buf = self._buffer(length)
        view = memoryview(buf)
        runs = self._runs(node, start, start + length)

        def work() -> None:
            for dev, b, n in runs:
                if os.preadv(self.fd, [view[b : b + n]], dev) != n:
                    raise OSError(errno.EIO, "short device read")

        await trio.to_thread.run_sync(work)
        self.counts["reads"] += 1
        self.counts["read_bytes"] += end - off
        return view[off - start : end - start]

    async def write(self, fh: int, off: int, data: bytes) -> int:
        node = self.nodes[fh]
        if off % ALIGN:
            raise pyfuse3.FUSEError(errno.EINVAL)
        end = off + len(data)
        while len(node.units) * UNIT < end:
            if not self.free:
                raise pyfuse3.FUSEError(errno.ENOSPC)
            node.units.append(self.free.pop())
        length = -(-len(data) // ALIGN) * ALIGN
        buf = self._buffer(length)
        view = memoryview(buf)
        view[: len(data)] = data
        if length > len(data):  # the tail of the last block: zeros past EOF
            view[len(data) : length] = bytes(length - len(data))
        runs = self._runs(node, off, off + length)

        def work() -> None:
            for dev, b, n in runs:
                if os.pwritev(self.fd, [view[b : b + n]], dev) != n:
                    raise OSError(errno.EIO, "short device write")

        await trio.to_thread.run_sync(work)
        node.size = max(node.size, end)
        self.dirty.add(fh)
        self.counts["writes"] += 1
        return len(data)

    async def flush(self, fh: int) -> None:
        if fh in self.dirty:  # durable at close, as kvfs
            self.dirty.discard(fh)
            await trio.to_thread.run_sync(os.fdatasync, self.fd)
            self.counts["syncs"] += 1

    async def release(self, fh: int) -> None:
        await self.flush(fh)

    async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
        ino = self.names.pop(name, None)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        self._truncate(self.nodes.pop(ino), 0)

    async def forget(self, inode_list: Any) -> None:
        pass

    async def statfs(self, ctx: Any) -> Any:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = ALIGN
        s.f_blocks = (len(self.free) + sum(len(n.units) for n in self.nodes.values())) * 256
        s.f_bfree = s.f_bavail = len(self.free) * 256
        s.f_files, s.f_ffree, s.f_namemax = 1 << 20, (1 << 20) - len(self.nodes), 255
        return s

    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name == b"user.ceiling.stats":
            return json.dumps(self.counts).encode()
        raise pyfuse3.FUSEError(errno.ENODATA)


async def raise_readahead(mountpoint: str, kib: int = 4096) -> None:
    """The same kernel readahead kvfs sets once INIT is done."""
    for _ in range(200):
        st = await trio.to_thread.run_sync(os.stat, mountpoint)
        if os.major(st.st_dev) == 0:
            with open(f"/sys/class/bdi/0:{os.minor(st.st_dev)}/read_ahead_kb", "w") as f:  # noqa: ASYNC230
                f.write(str(kib))
            return
        await trio.sleep(0.05)


async def serve(fs: CeilingFS, mountpoint: str) -> None:
    pyfuse3.init(fs, mountpoint, {"fsname=ceiling", "noatime", "default_permissions"})
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(raise_readahead, mountpoint)
            await pyfuse3.main()
    finally:
        pyfuse3.close(unmount=True)


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    fs = CeilingFS(sys.argv[1])
    trio.run(serve, fs, sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
