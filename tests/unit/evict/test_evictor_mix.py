"""Every policy under a mount's mix of events, through the evictor as the store
drives it: prompts that read a prefix of chunks and write the rest (a partial last
chunk among them), evictions in the policy's order, unlinks, inode numbers reused
at once, chunks written again under a gone name, writers that exit, checkpoints
and remounts. The policy must never raise (``policy_faults`` stays 0: the evictor
would survive a fault, but it is a bug) and must track exactly the live files.
Session 29's fault, a ghost whose last use fell before a young policy's clock,
was of this kind."""

from __future__ import annotations

import random
import stat

import pytest

from kvfs.evict.evictor import Evictor
from kvfs.evict.policy import POLICY_NAMES
from kvfs.index.namespace import ROOT_INO, Namespace

FULL, PARTIAL = 4096, 1000


class Mount:
    """A namespace and its evictor, driven as the store drives them."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.ns = Namespace(lambda ops: None)
        self.ns.init_root(0, 0)
        self.live_pids: dict[int, int] = {}  # pid -> start time
        self.evictor = self._evictor()
        self.files: dict[bytes, int] = {}  # name -> ino
        self.seen: set[int] = set()
        self.reused = self.rewritten = self.remounts = self.orphaned = 0
        self.gone: set[bytes] = set()

    def _evictor(self) -> Evictor:
        return Evictor(
            self.ns,
            policy=self.policy,
            alive=self.live_pids.get,
            thread_group=lambda tid: tid,
        )

    def write(self, name: bytes, size: int, pid: int) -> None:
        inode = self.ns.make(ROOT_INO, name, stat.S_IFREG | 0o644, 0, 0)  # a number reused
        inode.size = size
        self.ns.commit(inode)
        self.evictor.created(inode, pid)
        self.evictor.committed(inode, pid)
        self.files[name] = inode.ino
        self.reused += inode.ino in self.seen
        self.seen.add(inode.ino)
        self.rewritten += name in self.gone

    def read(self, name: bytes, pid: int) -> None:
        self.evictor.opened(self.ns.inodes[self.files[name]], pid)

    def remove(self, name: bytes) -> None:
        """Evicted or unlinked: names first, then the evictor, then the row (as
        ``Lifetime.unlink_everywhere`` and ``maybe_drop``)."""
        ino = self.files.pop(name)
        self.gone.add(name)
        inode = self.ns.remove(ROOT_INO, name, want_dir=False)
        self.evictor.forget(ino)
        self.evictor.forget(ino)
        self.ns.drop(inode)

    def evict(self, count: int) -> None:
        """``count`` files, each removed as it comes (as the eviction driver does)."""
        by_ino = {ino: name for name, ino in self.files.items()}
        for inode, _ in self.evictor.candidates(lambda inode: True):
            if not count:
                break
            self.remove(by_ino[inode.ino])
            count -= 1

    def remount(self) -> None:
        """A checkpoint, then a new evictor resuming from it (the writers live on)."""
        self.remounts += 1
        self.evictor.save()
        self.evictor = self._evictor()
        self.evictor.adopt_all()

    def check(self) -> None:
        assert self.evictor.policy_faults == 0
        policy = self.evictor.policy
        assert len(policy) == len(self.files)
        assert sorted(policy.victims()) == sorted(self.files.values())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_takes_a_mounts_event_mix_without_a_fault(name: str, seed: int) -> None:
    rng = random.Random(seed)
    mount = Mount(name)
    capacity = 48
    pids = [11, 12, 13]
    for pid in pids:
        mount.live_pids[pid] = pid * 1000
    for step in range(700):
        pid = rng.choice(pids)
        prompt = rng.randrange(12)  # a few conversations, each a chain of chunks
        length = rng.randrange(1, 9)
        for i in range(length):
            chunk = b"p%d-%d" % (prompt, i)
            if chunk in mount.files:
                mount.read(chunk, pid)
            else:
                size = PARTIAL if i == length - 1 and rng.random() < 0.5 else FULL
                mount.write(chunk, size, pid)
        if len(mount.files) > capacity:
            mount.evict(len(mount.files) - capacity + rng.randrange(3))
        event = rng.random()
        if event < 0.05 and mount.files:
            mount.remove(rng.choice(list(mount.files)))  # an engine's unlink
        elif event < 0.08:
            gone = rng.choice(pids)  # a writer exits; another starts
            del mount.live_pids[gone]
            pids.remove(gone)
            pids.append(100 + step)
            mount.live_pids[100 + step] = step
            mount.evictor._reaped = -1.0  # reap now, whatever the interval
            mount.orphaned += mount.evictor.reap()
        elif event < 0.1:
            mount.remount()
        mount.check()
    # the mix did what it is for
    assert mount.reused > 100 and mount.rewritten > 100
    assert mount.remounts > 5 and mount.orphaned > 5
