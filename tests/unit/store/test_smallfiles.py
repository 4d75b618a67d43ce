"""Fragment tails on the store, without a mount: files smaller than a unit (and the
partial last unit of any file) take fragments, not a whole unit (``docs/format.md``
"Fragment tails"). Every test checks bytes against a model; space is checked against
what the allocator holds; the index passes fsck's checks and data check."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.lowlevel

from kvfs.cli.offline import _check_data
from kvfs.common.errors import Corruption, NotFound
from kvfs.devices.pool import Pool
from kvfs.format.records import (
    DEV_SHIFT,
    NO_UNIT,
    allocated_size,
    extent,
    fragment_size,
    is_fragment,
    split_fragment,
)
from kvfs.index.check import Report, check_index
from kvfs.index.namespace import ROOT_INO
from kvfs.store.facade import Store
from kvfs.testing.devices import MemoryDevice
from tests.unit.store.test_store import (
    crash_image,
    create,
    files,
    get,
    memory_pool,
    no_leaks,
    put,
    serving,
    unlink,
    wait_until,
)

MiB = 1 << 20
UNIT = MiB
SIZES = [1, 4096, 100 << 10, 512 << 10, UNIT - 1, UNIT, UNIT + 1, 32 * MiB + (100 << 10)]


def fsck_clean(store: Store, pool: Pool) -> None:
    report = Report()
    check_index(store.ns, pool, report)
    _check_data(store.ns, pool, report)
    assert not report.problems, report.problems


def held_bytes(store: Store) -> int:
    """Device bytes the allocator holds: whole units, and fragments in host units."""
    a = store.alloc
    whole = a.total_units - a.free_units - a.fragment_hosts
    return whole * store.unit + a.fragments_used * fragment_size(store.unit)


def contents(seed: int, sizes: list[int]) -> dict[bytes, bytes]:
    rng = random.Random(seed)
    return {b"f%d-%d" % (i, n): rng.randbytes(n) for i, n in enumerate(sizes)}


async def put_all(store: Store, data: dict[bytes, bytes]) -> dict[bytes, int]:
    """Write every file concurrently (each in 100 kB writes)."""
    inos: dict[bytes, int] = {}

    async def one(name: bytes) -> None:
        inos[name] = await put(store, name, data[name])

    async with trio.open_nursery() as nursery:
        for name in data:
            nursery.start_soon(one, name)
    return inos


async def check_all(store: Store, data: dict[bytes, bytes]) -> None:
    present = files(store)
    assert set(present) == set(data)
    for name, ino in present.items():
        assert await get(store, ino) == data[name], name
        inode = store.ns.get(ino)
        assert store.allocated_bytes(inode) == allocated_size(len(data[name]), store.unit)


def test_allocated_size_of_the_sizes_kvfs_sees() -> None:
    frag = fragment_size(UNIT)
    assert frag == 4096
    assert [allocated_size(n, UNIT) for n in SIZES] == [
        frag,
        frag,
        100 << 10,
        512 << 10,
        UNIT,  # a tail of 255 fragments and a bit would save nothing
        UNIT,
        UNIT + frag,
        32 * MiB + (100 << 10),
    ]
    assert fragment_size(64 << 10) == 4096 and fragment_size(64 * MiB) == 256 << 10


async def test_files_of_every_size_round_trip_take_only_their_fragments() -> None:
    pool = memory_pool(devices=2, size=128 * MiB, unit=UNIT)
    data = contents(1, SIZES * 3)
    async with serving(pool) as store:
        before = sum(d.statistics().bytes_written for d in pool.devices)
        await put_all(store, data)
        await store.journal.wait_durable()
        written = sum(d.statistics().bytes_written for d in pool.devices) - before
        want = sum(allocated_size(len(v), UNIT) for v in data.values())
        assert held_bytes(store) == want
        assert no_leaks(store)
        stats = store.statistics()
        assert stats.used_bytes == want  # nothing claimed: every file is committed
        assert want <= written < want + 4 * MiB  # data + the journal, not whole units
        tails = [p for i in store.ns.inodes.values() for p in i.units if is_fragment(p)]
        assert len(tails) == 3 * 6  # every size but UNIT - 1 (rounded up) and UNIT
        hosts = {(p >> DEV_SHIFT, split_fragment(p)[0]) for p in tails}
        assert len(hosts) < len(tails)  # tails share units
        for inode in store.ns.inodes.values():  # a tail stays on its stripe's device
            if 0 < inode.size <= store.cfg.stripe_units * UNIT:
                assert len({p >> DEV_SHIFT for p in inode.units if p != NO_UNIT}) == 1
        store.cache = store.reader.cache = type(store.cache)(256 * MiB)  # cold, and big
        reads = sum(d.statistics().bytes_read for d in pool.devices)
        await check_all(store, data)
        read = sum(d.statistics().bytes_read for d in pool.devices) - reads
        assert read == want  # a tail reads only its fragments
        fsck_clean(store, pool)
        await store.close()
    async with serving(pool) as store:  # clean reopen: the allocator is rebuilt
        assert held_bytes(store) == want and no_leaks(store)
        await check_all(store, data)
        fsck_clean(store, pool)


async def test_a_tail_grows_shrinks_and_moves_and_keeps_its_bytes() -> None:
    pool = memory_pool(size=64 * MiB, unit=UNIT)
    rng = random.Random(2)
    model = bytearray(rng.randbytes(100 << 10))
    async with serving(pool) as store:
        ino = await put(store, b"f", bytes(model))
        neighbour = rng.randbytes(300 << 10)
        other = await put(store, b"n", neighbour)  # shares the host unit
        inode = store.ns.get(ino)
        assert is_fragment(inode.units[0])

        async def write(off: int, data: bytes) -> None:
            nonlocal model
            fh = await store.open(ino, 2)
            await store.write(fh, off, data)
            await store.commit(inode)
            await store.release(fh)
            if off > len(model):
                model += bytes(off - len(model))
            model[off : off + len(data)] = data

        async def truncate(size: int) -> None:
            nonlocal model
            await store.truncate(inode, size)
            await store.commit(inode)
            model = model[:size] + bytes(max(size - len(model), 0))

        steps: list[Callable[[], Awaitable[None]]] = [
            lambda: write(len(model), rng.randbytes(200 << 10)),  # append: 300 KiB tail
            lambda: write(10, rng.randbytes(5)),  # overwrite inside the tail
            lambda: truncate(50 << 10),
            lambda: truncate(3 * MiB),  # the tail is now unit 0 of a sparse file
            lambda: write(2 * MiB + 7, rng.randbytes(1000)),
            lambda: write(len(model), rng.randbytes(UNIT + 3)),
            lambda: truncate(UNIT + 1),
            lambda: truncate(4097),
        ]
        for step in steps:
            await step()
            await store.journal.wait_durable()
            assert await get(store, ino) == bytes(model)
            assert await get(store, other) == neighbour
            await wait_until(lambda: no_leaks(store))  # frees wait for the journal, TRIM
            fsck_clean(store, pool)
        assert store.allocated_bytes(inode) == 8192
        await store.close()
    async with serving(pool) as store:
        assert await get(store, ino) == bytes(model)
        assert await get(store, other) == neighbour
        assert no_leaks(store)


async def remove(store: Store, names: list[bytes]) -> None:
    for name in names:
        await unlink(store, name)
        await trio.lowlevel.checkpoint()


async def read_all(store: Store, data: dict[bytes, bytes]) -> None:
    for name in sorted(data):
        assert await get(store, store.ns.lookup(ROOT_INO, name).ino) == data[name]


async def test_freed_tails_trim_only_their_fragments_while_others_are_read() -> None:
    """Unlinks free fragments (TRIM zeroes them on a memory device) of hosts that
    other files still use, while those files are read and new tails reuse the room:
    a discard or allocation in the wrong place would show as a checksum failure."""
    pool = memory_pool(devices=2, size=64 * MiB, unit=UNIT)
    rng = random.Random(3)
    live: dict[bytes, bytes] = {}
    async with serving(pool) as store:
        store.cache = type(store.cache)(0)  # every read goes to the device
        for round_ in range(6):
            batch = {
                b"r%d-%d" % (round_, i): rng.randbytes(rng.choice([1, 5000, 100 << 10, 400 << 10]))
                for i in range(12)
            }
            victims = rng.sample(sorted(live), k=len(live) // 2)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(remove, store, victims)
                nursery.start_soon(read_all, store, {n: live[n] for n in live if n not in victims})
                nursery.start_soon(put_all, store, batch)
            for name in victims:
                del live[name]
            live.update(batch)
            await store.journal.wait_durable()
        await check_all(store, live)
        await wait_until(lambda: no_leaks(store))
        fsck_clean(store, pool)
        for name in list(live):
            await unlink(store, name)
        await store.journal.wait_durable()
        await wait_until(lambda: store.space.pending_free() == 0)
        # every host unit went back to the unit map once its last fragment was freed
        assert store.alloc.fragment_hosts == 0 and store.alloc.fragments_used == 0
        assert store.alloc.free_units == store.alloc.total_units


async def test_a_flipped_byte_in_a_fragment_tail_is_corruption() -> None:
    pool = memory_pool(size=32 * MiB, unit=UNIT)
    rng = random.Random(4)
    data, neighbour = rng.randbytes(UNIT + (200 << 10)), rng.randbytes(300 << 10)
    async with serving(pool) as store:
        ino = await put(store, b"victim", data)
        other = await put(store, b"other", neighbour)
        p = store.ns.get(ino).units[1]
        assert is_fragment(p)
        unit, skip, length = extent(p, UNIT)
        assert length == 200 << 10
        dev = pool.devices[p >> DEV_SHIFT]
        assert isinstance(dev, MemoryDevice)
        dev.data[pool.unit_offset(p >> DEV_SHIFT, unit) + skip + length - 1] ^= 0x01
        store.cache = type(store.cache)(0)
        report = Report()
        _check_data(store.ns, pool, report)  # fsck sees it too
        assert len(report.problems) == 1 and "checksum mismatch" in report.problems[0]
        fh = await store.open(ino, 0)
        assert bytes(await store.read(fh, 0, UNIT)) == data[:UNIT]
        with pytest.raises(Corruption):
            await store.read(fh, UNIT, 4096)
        with pytest.raises(NotFound):
            store.ns.lookup(ROOT_INO, b"victim")
        await store.release(fh)
        assert await get(store, other) == neighbour  # the host's other tail is intact


async def test_bytes_past_the_end_of_a_tail_read_as_zeros() -> None:
    """A dirty tail buffer with stale bytes past EOF (a truncate within the unit)
    still stores a tail whose unit reads as data then zeros."""
    pool = memory_pool(size=32 * MiB, unit=UNIT)
    data = random.Random(5).randbytes(700 << 10)
    async with serving(pool) as store:
        ino, fh = await create(store, b"f")
        await store.write(fh, 0, data)
        inode = store.ns.get(ino)
        await store.truncate(inode, 5000)
        await store.truncate(inode, 600 << 10)
        await store.commit(inode)
        await store.release(fh)
        assert store.allocated_bytes(inode) == 600 << 10
        store.cache = type(store.cache)(0)
        assert await get(store, ino) == data[:5000] + bytes((600 << 10) - 5000)
        fsck_clean(store, pool)


def test_unit_maps_without_fragments_read_as_before() -> None:
    """Addresses of pools written before fragments existed never carry the flag."""
    for p in (0, 1, (3 << DEV_SHIFT) | 12345, (1 << 31) + 5):
        assert not is_fragment(p) and extent(p, UNIT) == (p & ((1 << 48) - 1), 0, UNIT)
    assert NO_UNIT == -1


async def test_crash_images_keep_every_committed_tail() -> None:
    """The devices' bytes at many moments (mid-write, after a commit, after an unlink
    of a file whose host others share): each, recovered, has every committed file
    byte-identical, no torn file, no leaked fragment, and passes fsck."""
    pool = memory_pool(size=48 * MiB, unit=UNIT)
    rng = random.Random(6)
    contents: dict[bytes, bytes] = {}
    committed: set[bytes] = set()
    images: list[tuple[Pool, set[bytes]]] = []

    def snap() -> None:
        images.append((crash_image(pool), set(committed)))

    async with serving(pool) as store:
        for n in range(20):
            name = b"t%d" % n
            contents[name] = rng.randbytes(rng.choice([1, 4096, 100 << 10, 512 << 10, UNIT + 1]))
            ino, fh = await create(store, name)
            half = len(contents[name]) // 2
            await store.write(fh, 0, contents[name][:half])
            snap()
            await store.write(fh, half, contents[name][half:])
            await store.commit(store.ns.get(ino))
            committed.add(name)
            snap()
            await store.release(fh)
            if n % 4 == 3:
                victim = rng.choice(sorted(committed))
                await unlink(store, victim)
                snap()
                await store.journal.wait_durable()
                committed.discard(victim)
                snap()
    for image, durable in images:
        async with serving(image) as store:
            present = files(store)
            assert durable <= set(present) <= set(contents)
            for name, ino in present.items():
                assert await get(store, ino) == contents[name], name
            await wait_until(lambda: no_leaks(store))
            fsck_clean(store, image)
