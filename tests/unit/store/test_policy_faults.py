"""A policy that raises costs its order, never a byte or the mount (store level,
image files): the evictor makes the policy anew from the namespace and goes on
(``Evictor.policy_failed``). Session 29 met such a bug: a ghost with a last use
before the policy's clock made the gone-names table raise inside an eviction, and
the daemon stopped (the engines saw ECONNABORTED)."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.lowlevel

import kvfs.evict.evictor as evictor_mod
from kvfs.common.errors import NoSpace, NotFound
from kvfs.devices.pool import format_pool, open_pool
from kvfs.evict.policy import Policy, make_policy
from kvfs.index.namespace import ROOT_INO
from kvfs.store.facade import Store
from tests.unit.store.test_store import CFG, UNIT, get, put, serving, sparse_images

MANAGED = dataclasses.replace(CFG, default_policy="kvfs-managed")
FAULTY_VERBS = frozenset(
    {"identify", "touch", "track", "remove", "take_ghost", "put_ghost", "persist_pieces"}
    | {"recover_pieces", "resident_mask"}  # at a mount
)


class PolicyBug(Exception):
    """What the faulty policy raises: no error kvfs knows."""


class Faults:
    """A countdown shared by every policy made while it is installed: every
    ``every``-th call of a verb (and every ``every``-th victim yielded) raises."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.calls = self.raised = 0
        self.verbs: set[str] = set()
        self.force: str | None = None
        """A verb whose next call raises, whatever the count."""

    def tick(self, verb: str) -> None:
        self.calls += 1
        forced = verb == self.force
        if forced:
            self.force = None
        if forced or (self.every and self.calls % self.every == 0):
            self.raised += 1
            self.verbs.add(verb)
            raise PolicyBug(f"{verb}: injected fault {self.raised}")


class FaultyPolicy:
    """A real policy, every verb of it passing through :class:`Faults` first."""

    def __init__(self, inner: Policy, faults: Faults) -> None:
        self._inner, self._faults = inner, faults

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name == "victims":
            return self._victims
        if name not in FAULTY_VERBS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._faults.tick(name)
            return attr(*args, **kwargs)

        return call

    def _victims(self) -> Iterator[int]:
        for key in self._inner.victims():
            self._faults.tick("victims")
            yield key

    def __contains__(self, key: object) -> bool:
        return key in self._inner

    def __len__(self) -> int:
        return len(self._inner)


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Faults:
    """Every policy the evictor makes (at load and at each rebuild) is faulty."""
    made = Faults(every=0)
    real: Callable[[str], Policy] = make_policy

    def make(name: str) -> Policy:
        return cast(Policy, FaultyPolicy(real(name), made))

    monkeypatch.setattr(evictor_mod, "make_policy", make)
    return made


def new_pool(tmp_path: Path, size: int, meta: int) -> list[str]:
    paths = sparse_images(tmp_path, 1, size)
    format_pool(paths, unit_size=UNIT, meta_size=meta)
    return paths


@asynccontextmanager
async def mounted(paths: list[str]) -> AsyncIterator[Store]:
    """The pool opened and served; closed cleanly (a checkpoint) at the end."""
    pool = open_pool(paths)
    try:
        async with serving(pool, MANAGED) as store:
            yield store
            await store.close()
    finally:
        pool.close()


def content(i: int) -> bytes:
    """File i's bytes: 1 to 3 units, its own pattern."""
    seed = hashlib.sha256(b"%d" % i).digest()
    return seed * ((UNIT * (1 + i % 3) - 1000 * (i % 5)) // len(seed))


async def check(store: Store, written: dict[bytes, int]) -> int:
    """Every file written is gone or byte-exact; returns the survivors."""
    alive = 0
    for name, i in written.items():
        try:
            ino = store.ns.lookup(ROOT_INO, name).ino
        except NotFound:
            continue
        assert await get(store, ino) == content(i), f"{name!r}: wrong bytes"
        alive += 1
    return alive


async def test_a_failing_policy_costs_its_order_never_a_byte_or_the_mount(
    tmp_path: Path, faults: Faults
) -> None:
    """Writers and readers at once over a pool that turns over three times, the
    policy raising at every 41st call of any verb (touch, track, remove, victims)
    and at checkpoints: the store answers every request (at worst NoSpace to a write),
    every file reads back exact or is gone, the policy ends as the fallback after
    its third fault, and the pool reopens with every survivor exact."""
    paths = new_pool(tmp_path, 24 << 20, 2 << 20)
    faults.every = 41
    written: dict[bytes, int] = {}
    refused = 0
    async with mounted(paths) as store:
        capacity = store.alloc.total_units
        count = 3 * capacity // 2  # files of two units on average: three turnovers

        async def writer(first: int) -> None:
            nonlocal refused
            for i in range(first, count, 3):
                name = b"chunk-%06d" % i
                try:
                    await put(store, name, content(i))
                except NoSpace:
                    refused += 1  # a write may be refused, never answered wrong
                    continue
                written[name] = i
                if i % 100 == 0:  # a checkpoint whose freeze of the policy raises
                    faults.force = "persist_pieces"
                    store.request_checkpoint()

        async def reader() -> None:
            rng = random.Random(7)
            for _ in range(count):
                if written:
                    name = rng.choice(list(written))
                    try:
                        ino = store.ns.lookup(ROOT_INO, name).ino
                        assert await get(store, ino) == content(written[name])
                    except NotFound:
                        pass  # evicted: a miss
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            for first in range(3):
                nursery.start_soon(writer, first)
            nursery.start_soon(reader)
        assert faults.raised >= 3
        assert store.evictor.policy_faults == faults.raised
        assert {"touch", "track", "remove", "victims"} <= faults.verbs, faults.verbs
        assert store.evictor.policy.name == evictor_mod.FALLBACK_POLICY
        assert store.evictor.evictions > capacity // 3
        assert refused < count // 10
        alive = await check(store, written)
        assert alive > 0
        assert len(store.evictor.policy) <= alive  # files being written: none now
        stats = store.statistics()
        assert stats.evictions == store.evictor.evictions
        faults.every = 0  # a forced fault may be left for the last checkpoint
    assert "persist_pieces" in faults.verbs and faults.force is None
    async with mounted(paths) as store:
        assert await check(store, written) == alive


async def test_a_policy_that_fails_in_remove_still_lets_its_file_go(
    faults: Faults, tmp_path: Path
) -> None:
    """The fault of session 29 (the gone-names table raised while an evicted file
    was handed over): the file still goes, the rebuilt policy does not hold it, and
    the one after it is evicted by the new order."""
    async with mounted(new_pool(tmp_path, 16 << 20, 1 << 20)) as store:
        inos = [await put(store, b"f%d" % i, content(i)) for i in range(6)]
        victim = inos[2]
        faults.every = faults.calls + 1  # the next verb raises (the remove), once
        store.lifetime.unlink_everywhere(store.ns.get(victim))
        faults.every = 0
        assert store.evictor.policy_faults == 1
        assert victim not in store.evictor.policy
        assert sorted(store.evictor.policy.victims()) == sorted(set(inos) - {victim})
        for i, ino in enumerate(inos):
            if ino != victim:
                assert await get(store, ino) == content(i)


@pytest.mark.parametrize("verb", ["recover_pieces", "resident_mask"])
async def test_a_policy_that_fails_at_mount_still_mounts(
    faults: Faults, tmp_path: Path, verb: str
) -> None:
    """A policy that raises while it resumes from the checkpoint (reading its image,
    or comparing it with the files present): the pool mounts, the new policy holds
    every file, and every file reads back exact."""
    paths = new_pool(tmp_path, 16 << 20, 1 << 20)
    async with mounted(paths) as store:
        inos = [await put(store, b"f%d" % i, content(i)) for i in range(8)]
    faults.force = verb
    async with mounted(paths) as store:
        assert faults.force is None and store.evictor.policy_faults == 1
        assert sorted(store.evictor.policy.victims()) == sorted(inos)
        for i, ino in enumerate(inos):
            assert await get(store, ino) == content(i)


async def test_a_checkpoint_whose_policy_fails_twice_holds_no_policy_state(
    faults: Faults, tmp_path: Path
) -> None:
    """The freeze at a checkpoint fails, and so does the rebuilt policy's: the
    checkpoint goes on without policy state, and the next mount adopts every file."""
    paths = new_pool(tmp_path, 16 << 20, 1 << 20)
    async with mounted(paths) as store:
        inos = [await put(store, b"f%d" % i, content(i)) for i in range(8)]
        faults.every = 1  # every verb from here raises: the close's freeze twice
    assert faults.verbs == {"persist_pieces"} and faults.raised == 2
    faults.every = 0
    async with mounted(paths) as store:
        assert store.evictor.policy_faults == 0
        assert sorted(store.evictor.policy.victims()) == sorted(inos)
        for i, ino in enumerate(inos):
            assert await get(store, ino) == content(i)
