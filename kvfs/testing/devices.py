"""Devices for tests and benchmarks of the layers above the devices: one in RAM, and a
wrapper that injects faults. Test support only: no product module imports it."""

from __future__ import annotations

import errno
import threading
from collections.abc import Sequence

from kvfs.devices.device import ALIGN, Device


class MemoryDevice(Device):
    """A device in RAM, for tests of the layers above."""

    def __init__(self, size: int, path: str = "mem") -> None:
        super().__init__(path, size, ALIGN, 0)
        self.data = bytearray(size)

    def _pread(self, offset: int, buf: memoryview) -> int:
        buf[:] = self.data[offset : offset + len(buf)]
        return len(buf)

    def _pwrite(self, offset: int, bufs: Sequence[memoryview]) -> int:
        pos = offset
        for b in bufs:
            self.data[pos : pos + len(b)] = b
            pos += len(b)
        return pos - offset

    def _flush(self) -> None:
        pass

    def _discard(self, offset: int, length: int) -> None:
        self.data[offset : offset + length] = bytes(length)


class FaultyDevice(Device):
    """Wraps a device and injects faults: EIO on ranges, or hangs, on demand (tests)."""

    def __init__(self, inner: Device) -> None:
        super().__init__(inner.path, inner.size, inner.logical_block, inner.optimal_io)
        self.inner = inner
        self.fail_reads = False
        self.fail_writes = False
        self.hang = threading.Event()  # cleared = no hang
        self.release = threading.Event()

    def _wait_if_hung(self) -> None:
        if self.hang.is_set():
            self.release.wait()

    def _pread(self, offset: int, buf: memoryview) -> int:
        self._wait_if_hung()
        if self.fail_reads:
            raise OSError(errno.EIO, "injected read error")
        return self.inner._pread(offset, buf)

    def _pwrite(self, offset: int, bufs: Sequence[memoryview]) -> int:
        self._wait_if_hung()
        if self.fail_writes:
            raise OSError(errno.EIO, "injected write error")
        return self.inner._pwrite(offset, bufs)

    def _flush(self) -> None:
        self.inner._flush()

    def _discard(self, offset: int, length: int) -> None:
        self.inner._discard(offset, length)


__all__ = ["FaultyDevice", "MemoryDevice"]
