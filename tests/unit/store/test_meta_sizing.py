"""The metadata area's size at format: the per-file checkpoint bound is measured on a
real checkpoint (namespace + eviction state, as ``Store._snapshot`` takes it), and
the default area holds the checkpoint of a pool whose every unit is a file."""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Callable, Sequence

import pytest

from kvfs.common.errors import UserError
from kvfs.devices.device import Device
from kvfs.evict.evictor import Evictor
from kvfs.format import geometry
from kvfs.format.geometry import (
    CHECKPOINT_FILE_BYTES,
    CHECKPOINT_UNIT_BYTES,
    DEFAULT_MIN_META,
    META_FULL,
    SPARE_FILES,
    default_meta_size,
)
from kvfs.format.halves import encode_checkpoint, half_bounds
from kvfs.format.records import Image, phys
from kvfs.index.namespace import ROOT_INO, Namespace
from kvfs.testing.devices import MemoryDevice

MiB = 1 << 20
FILES = 6000
PER_DIR = 1000

# names as the engines write them (docs/engines.md)
NAMES: dict[str, Callable[[int], bytes]] = {
    "lmcache": lambda i: (
        b"vllm@meta-llama--Llama-3.1-70B-Instruct@8@%d@%d@bfloat16.pt"
        % (i % 8, (i * 0x9E3779B97F4A7C15) % 2**63 - 2**62)
    ),
    "vllm": lambda i: b"%016x.bin" % ((i * 0x9E3779B97F4A7C15) % 2**64),
    "sglang": lambda i: (
        b"%064x_meta-llama-Llama-3.1-8B_0_1.bin" % ((i * 0x9E3779B97F4A7C15) % 2**256)
    ),
}


def checkpoint_of(names: Callable[[int], bytes], units: int, devices: int = 1) -> int:
    """Bytes of the checkpoint of FILES committed files of ``units`` units each, laid
    out as the store stripes them (8-unit stripes rotating over ``devices``), with
    the eviction state a busy mount persists: every file tracked, as many ghost keys
    (recently evicted files), an owner per file."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    evictor = Evictor(ns)
    parent, next_unit = ROOT_INO, [0] * devices
    for i in range(FILES):
        if i % PER_DIR == 0:
            parent = ns.make(ROOT_INO, b"d%04d" % (i // PER_DIR), stat.S_IFDIR | 0o755, 0, 0).ino
        inode = ns.make(parent, names(i), stat.S_IFREG | 0o644, 0, 0)
        inode.size = units * MiB
        umap, csums = ns.edit_map(inode)
        for u in range(units):
            dev = (inode.ino + u // 8) % devices
            umap.append(phys(dev, next_unit[dev]))
            csums.append((inode.ino * 2654435761 + u) % 2**64)
            next_unit[dev] += 1
        ns.commit(inode)  # folded into the compact columns, as a committed file is
        evictor.created(inode, os.getpid())
        evictor.committed(inode, os.getpid())
    for ino in range(10**9, 10**9 + FILES):  # ghosts: keys the policy evicted
        evictor.policy.track(ino, units * MiB, None)
        evictor.policy.remove(ino)
    evictor_payloads = [Image(p) for p in evictor.snapshot_payloads()]  # as Store._snapshot
    data, _, _ = encode_checkpoint(itertools.chain(ns.snapshot(), evictor_payloads), 2, 0, 1)
    return len(data)


@pytest.mark.parametrize("style", sorted(NAMES))
def test_one_unit_files_fit_the_per_file_bound(style: str) -> None:
    size = checkpoint_of(NAMES[style], 1)
    per_file = size / FILES
    bound = CHECKPOINT_FILE_BYTES + CHECKPOINT_UNIT_BYTES
    assert per_file <= bound, f"{style}: {per_file:.0f} B per one-unit file > {bound}"
    assert per_file > bound / 3, f"{style}: the bound ({bound}) is far too loose ({per_file:.0f})"


@pytest.mark.parametrize("devices", [1, 4])
def test_large_files_fit_the_per_unit_bound(devices: int) -> None:
    """32-unit files (LMCache's 32 MiB chunks), striped over the devices: runs and
    checksums stay within the per-unit share."""
    size = checkpoint_of(NAMES["lmcache"], 32, devices)
    bound = FILES * (CHECKPOINT_FILE_BYTES + 32 * CHECKPOINT_UNIT_BYTES)
    assert size <= bound, (size, bound)


def test_the_default_area_holds_a_full_pool_of_one_unit_files() -> None:
    units = 10**6
    per_file = checkpoint_of(NAMES["sglang"], 1) / FILES  # the longest names
    meta = default_meta_size(units, MiB)
    _, half = half_bounds(0, meta, 0)
    files = units * (1 + SPARE_FILES)
    assert per_file * files <= half * META_FULL
    assert meta % MiB == 0


def test_default_area_at_245_tb() -> None:
    """The figures docs/design.md "Limits" quotes (1 MiB units)."""
    units = 245 * 10**12 // MiB
    assert 175e9 < default_meta_size(units, MiB) < 185e9  # files of one unit (2 MiB blocks)
    assert 92e9 < default_meta_size(units, MiB, 2 * MiB) < 98e9  # --mean-file-size 2M
    assert 14.5e9 < default_meta_size(units, MiB, 32 * MiB) < 16e9  # 32 MiB chunks
    assert default_meta_size(100, MiB) == DEFAULT_MIN_META
    assert default_meta_size(units, MiB, MiB // 2) == default_meta_size(units, MiB)


class SizeOnly(Device):
    """A device of a given size that is never read or written (``new_pool`` only
    looks at sizes)."""

    def __init__(self, size: int, path: str) -> None:
        super().__init__(path, size, 4096, 0)

    def _pread(self, offset: int, buf: memoryview) -> int:
        raise AssertionError("read")

    def _pwrite(self, offset: int, bufs: Sequence[memoryview]) -> int:
        raise AssertionError("write")

    def _flush(self) -> None:
        raise AssertionError("flush")

    def _discard(self, offset: int, length: int) -> None:
        raise AssertionError("discard")


def test_layout_sizes_and_refuses() -> None:
    devs: list[Device] = [SizeOnly(64 << 30, "big")]
    sbs = geometry.new_pool(devs, MiB, 0, "")
    assert sbs[0].meta_size == default_meta_size((64 << 30) // MiB - 1, MiB)
    smaller = geometry.new_pool(devs, MiB, 0, "", mean_file_size=8 * MiB)
    assert smaller[0].meta_size < sbs[0].meta_size
    assert geometry.new_pool(devs, MiB, 3 * MiB, "")[0].meta_size == 3 * MiB
    with pytest.raises(UserError, match="at least 1 MiB"):
        geometry.new_pool(devs, MiB, 512 << 10, "")
    tiny: list[Device] = [MemoryDevice(16 * MiB, "d0"), SizeOnly(64 << 30, "d1")]
    with pytest.raises(UserError, match="too small for the"):
        geometry.new_pool(tiny, MiB, 0, "")
