"""Who may be evicted, and in which order. Pure and synchronous.

kvfs decides for the whole pool. Rules (``docs/eviction.md``):

1. Never an open file, a directory, or a file with uncommitted data.
2. Orphans first: files whose last user (the process that last opened them) is gone
   and that no live process has opened since — e.g. everything an engine wrote
   before it restarted. Liveness is checked by pid *and* process start time, so a
   recycled pid does not keep a file alive.
3. Then, only in directories whose policy is ``kvfs-managed``, the eviction
   policy's order (prefix-aware by default, see :mod:`kvfs.policy`).
   ``engine-managed`` directories only ever lose orphans.

A *group* is a top-level directory (a child of the root; files directly in the root
form the root's group). Its policy and byte quota are the xattrs
``user.kvfs.policy`` and ``user.kvfs.quota`` on that directory, persisted like any
xattr; a group without them uses the mount's defaults.
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from operator import itemgetter

from kvfs import procs
from kvfs.errors import InvalidArgument
from kvfs.namespace import ROOT_INO, Inode, Namespace
from kvfs.policy import EvictionPolicy, make_policy

log = logging.getLogger(__name__)

POLICY_XATTR = b"user.kvfs.policy"
QUOTA_XATTR = b"user.kvfs.quota"
MAX_FILE_XATTR = b"user.kvfs.max_file_size"
GROUP_XATTRS = (POLICY_XATTR, QUOTA_XATTR, MAX_FILE_XATTR)
"""Settings of a top-level directory, validated before they are stored."""
KVFS_MANAGED = "kvfs-managed"
ENGINE_MANAGED = "engine-managed"
POLICIES = (KVFS_MANAGED, ENGINE_MANAGED)
REAP_INTERVAL = 0.05
POLICY_BLOB = "eviction-policy"
OWNERS_BLOB = "file-owners"
"""(inode, pid, process start time) triples, int64: who last opened each file."""
ORPHAN_SCAN = 4096
"""Orphans examined per eviction pass (keeps a pass O(1) with millions of orphans)."""
FRESH_GRACE = 5.0
"""Seconds after its commit (close) during which a file is evicted only as a last
resort, before ENOSPC: the moment between a writer's close and its first use of the
file (vLLM's ``os.replace`` of its tmp file) must not lose it (``docs/eviction.md``)."""


GONE_MIN = 1024
"""Names of gone files remembered at least (as many as files are tracked, else)."""


def parse_quota(value: bytes) -> int:
    """'100G', '5368709120', '0' (no quota) -> bytes; InvalidArgument otherwise."""
    text = value.decode(errors="replace").strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    digits = text[:-1] if mult > 1 else text
    if not digits.isdigit():
        raise InvalidArgument(f"bad quota {value!r}: use bytes or a K/M/G/T suffix")
    return int(digits) * mult


def check_group_xattr(name: bytes, value: bytes) -> None:
    """Reject a malformed policy, quota or maximum file size before it is stored."""
    if name == POLICY_XATTR and value.decode(errors="replace") not in POLICIES:
        raise InvalidArgument(f"policy must be one of {', '.join(POLICIES)}")
    if name in (QUOTA_XATTR, MAX_FILE_XATTR):
        parse_quota(value)


@dataclass(frozen=True)
class EvictorStatistics:
    policy: str
    tracked: int
    orphans: int
    fresh: int
    owners: int
    evictions: int
    orphan_evictions: int


class Evictor:
    """Ownership, orphans and eviction order over one namespace."""

    def __init__(
        self,
        ns: Namespace,
        policy: str = "kvfs",
        default_policy: str = KVFS_MANAGED,
        default_quota: int = 0,
        alive: Callable[[int], int | None] = procs.start_time,
        thread_group: Callable[[int], int | None] = procs.thread_group,
        grace: float = FRESH_GRACE,
    ) -> None:
        if default_policy not in POLICIES:
            raise ValueError(f"default policy must be one of {POLICIES}")
        self.ns = ns
        self.policy: EvictionPolicy = make_policy(policy)
        self.default_policy = default_policy
        self.default_quota = default_quota
        self._alive = alive
        self._thread_group = thread_group
        self._tgids: dict[int, tuple[int, float]] = {}
        self._reaped = 0.0
        self._owner: dict[int, tuple[int, int]] = {}  # ino -> (pid, start time)
        self._owned: dict[tuple[int, int], set[int]] = {}
        self._interned: dict[tuple[int, int], tuple[int, int]] = {}  # owner -> itself
        self.orphans: dict[int, None] = {}  # insertion-ordered set
        self._starts: dict[int, int] = {}
        self.grace = grace
        self._fresh: dict[int, float] = {}  # ino -> end of its grace, in commit order
        self._gone: dict[int, int] = {}  # hash((parent, name)) -> ino of a gone file
        self.evictions = self.orphan_evictions = 0

    # ------------------------------------------------------------------ events
    def adopt_all(self) -> None:
        """After a mount: every file is an orphan, oldest first; the policy resumes
        from the state saved at the last clean unmount (learned chains included)."""
        # O(files) with C-level set, sort and dict operations: no per-file policy
        # calls unless the file is missing from the saved state.
        saved = self.ns.blobs.get(POLICY_BLOB)
        inodes = self.ns.inodes
        if saved:
            self._recover_policy(saved)
        tracked = self.policy.keys()
        absent = tracked - inodes.keys()  # e.g. files dropped since the last checkpoint
        if absent:
            self.policy.remove_many(absent)  # in victims() order, as one by one would
            tracked -= absent
        rows = self.ns.file_rows()  # (ino, size, mtime): no per-file views
        rows.sort(key=itemgetter(2))
        for ino, size, _ in rows:
            if ino not in tracked:
                self.policy.track(ino, size, None)
        files = [row[0] for row in rows]
        del rows
        owners = self._saved_owners()
        if not owners:
            self.orphans.update(dict.fromkeys(files))
            return
        starts: dict[int, int | None] = {}  # one /proc read per process, not per file
        for ino in files:
            owner = owners.get(ino)
            if owner is not None:
                pid = owner[0]
                if pid not in starts:
                    starts[pid] = self._alive(pid)
                if starts[pid] == owner[1]:
                    owner = self._interned.setdefault(owner, owner)
                    self._owner[ino] = owner  # its engine outlived the remount
                    self._owned.setdefault(owner, set()).add(ino)
                    continue
            self.orphans[ino] = None

    def _recover_policy(self, saved: bytes) -> None:
        """Resume from the saved image; from another policy's image (the pool was
        last mounted with another ``--eviction``) keep what this policy can use;
        else start afresh. Never fails the mount."""
        try:
            self.policy.recover(saved)
            return
        except ValueError as e:
            reason = str(e)
        if self.policy.recover_foreign(saved):
            log.info("eviction state of another policy adopted (%s)", reason)
            return
        log.warning("saved eviction state unusable (%s); starting afresh", reason)
        self.policy.reset()

    def _saved_owners(self) -> dict[int, tuple[int, int]]:
        raw = self.ns.blobs.get(OWNERS_BLOB, b"")
        if len(raw) % 24:
            log.warning("saved file owners unusable; every file starts as an orphan")
            return {}
        cols = array("q")
        cols.frombytes(raw)
        return {cols[i]: (cols[i + 1], cols[i + 2]) for i in range(0, len(cols), 3)}

    def save(self) -> None:
        """Put the policy's state and the file owners into the namespace's blobs,
        so the next checkpoint carries them (no journal record: checkpoints only)."""
        self.ns.blobs[POLICY_BLOB] = self.policy.persist()
        cols = array("q")
        for ino, (pid, start) in self._owner.items():
            cols.extend((ino, pid, start))
        self.ns.blobs[OWNERS_BLOB] = cols.tobytes()

    def opened(self, inode: Inode, pid: int) -> tuple[int, int] | None:
        """A live process opened the file: it is no orphan, and it is touched.
        Returns the opener as (process id, start time), None if unknown."""
        self.orphans.pop(inode.ino, None)
        owner = self._set_owner(inode.ino, pid)
        self.policy.touch(inode.ino, (pid, inode.parent))
        return owner

    def committed(self, inode: Inode, pid: int) -> None:
        """A file was closed with new data: track it, and give it its grace. A new
        file with the name of one that went (an evicted chunk written again)
        inherits what the policy remembers of it (``EvictionPolicy.rekey``)."""
        if inode.ino not in self.policy and self._gone:
            old = self._gone.pop(hash((inode.parent, inode.name)), None)
            if old is not None:
                self.policy.rekey(old, inode.ino)
        self.policy.track(inode.ino, inode.size, (pid, inode.parent))
        self._fresh.pop(inode.ino, None)
        self._fresh[inode.ino] = time.monotonic() + self.grace

    def fresh(self) -> int:
        """Files still in their grace (expired ones are forgotten first)."""
        now = time.monotonic()
        expired = []
        for ino, deadline in self._fresh.items():
            if deadline > now:
                break
            expired.append(ino)
        for ino in expired:
            del self._fresh[ino]
        return len(self._fresh)

    def created(self, inode: Inode, pid: int) -> None:
        self.orphans.pop(inode.ino, None)
        self._set_owner(inode.ino, pid)

    def forget(self, ino: int) -> None:
        inode = self.ns.inodes.get(ino)
        if inode is not None and ino in self.policy:  # remember its name for rekey()
            gone = self._gone
            gone[hash((inode.parent, inode.name))] = ino
            while len(gone) > max(GONE_MIN, len(self.policy)):
                del gone[next(iter(gone))]
        self.policy.remove(ino)
        self.orphans.pop(ino, None)
        self._fresh.pop(ino, None)
        owner = self._owner.pop(ino, None)
        if owner is not None:
            owned = self._owned.get(owner)
            if owned is not None:
                owned.discard(ino)
                if not owned:
                    del self._owned[owner]
                    self._interned.pop(owner, None)

    def _start_of(self, pid: int) -> int | None:
        """A process's start time, cached for the lifetime of the process entry:
        opens are frequent, /proc reads are not free."""
        start = self._starts.get(pid)
        if start is None:
            start = self._alive(pid)
            if start is not None:
                if len(self._starts) > 65536:
                    self._starts.clear()
                self._starts[pid] = start
        return start

    def _process(self, tid: int) -> int | None:
        """Thread id -> process id, cached for a second (tids are recycled)."""
        now = time.monotonic()
        hit = self._tgids.get(tid)
        if hit is not None and now - hit[1] < 1.0:
            return hit[0]
        tgid = self._thread_group(tid)
        if tgid is not None:
            if len(self._tgids) > 65536:
                self._tgids.clear()
            self._tgids[tid] = (tgid, now)
        return tgid

    def _set_owner(self, ino: int, tid: int) -> tuple[int, int] | None:
        pid = self._process(tid) if tid > 0 else None
        if pid is None:
            return None
        start = self._start_of(pid)
        if start is None:
            return None
        key = (pid, start)
        if self._owner.get(ino) == key:
            return key
        self.forget_owner(ino)
        key = self._interned.setdefault(key, key)  # one tuple per process, not per file
        self._owner[ino] = key
        self._owned.setdefault(key, set()).add(ino)
        return key

    def forget_owner(self, ino: int) -> None:
        owner = self._owner.pop(ino, None)
        if owner is not None and owner in self._owned:
            self._owned[owner].discard(ino)
            if not self._owned[owner]:
                del self._owned[owner]
                self._interned.pop(owner, None)

    def reap(self) -> int:
        """Turn the files of processes that exited into orphans; returns how many.
        Runs at most every REAP_INTERVAL seconds (it reads /proc per owner)."""
        now = time.monotonic()
        if now - self._reaped < REAP_INTERVAL:
            return 0
        self._reaped = now
        count = 0
        dead = [k for k in self._owned if self._alive(k[0]) != k[1]]
        for pid, _ in dead:
            self._starts.pop(pid, None)
        for key in dead:
            self._interned.pop(key, None)
            for ino in self._owned.pop(key):
                self._owner.pop(ino, None)
                if ino in self.ns.inodes:
                    self.orphans[ino] = None
                    count += 1
        return count

    # ------------------------------------------------------------------ groups
    def group_of(self, inode: Inode) -> int:
        """The top-level directory containing ``inode`` (ROOT_INO for the root's files)."""
        node = inode
        for _ in range(4096):
            if node.ino == ROOT_INO:
                return ROOT_INO
            if node.parent == ROOT_INO:
                return node.ino
            parent = self.ns.inodes.get(node.parent)
            if parent is None:
                return ROOT_INO
            node = parent
        return ROOT_INO

    def group_policy(self, group: int) -> str:
        xattrs = self.ns.inodes[group].xattrs if group in self.ns.inodes else None
        raw = (xattrs or {}).get(POLICY_XATTR)
        return raw.decode() if raw else self.default_policy

    def group_quota(self, group: int) -> int:
        xattrs = self.ns.inodes[group].xattrs if group in self.ns.inodes else None
        raw = (xattrs or {}).get(QUOTA_XATTR)
        return parse_quota(raw) if raw else self.default_quota

    def group_max_file_size(self, group: int) -> int:
        """The directory's own maximum file size in bytes, 0 if it sets none."""
        xattrs = self.ns.inodes[group].xattrs if group in self.ns.inodes else None
        raw = (xattrs or {}).get(MAX_FILE_XATTR)
        return parse_quota(raw) if raw else 0

    # ------------------------------------------------------------------ order
    def candidates(
        self,
        evictable: Callable[[Inode], bool],
        group: int | None = None,
        include_fresh: bool = False,
        owners: Collection[int] | None = None,
    ) -> Iterator[tuple[Inode, bool]]:
        """(inode, is_orphan) in eviction order; the caller evicts or skips each one
        and must call :meth:`forget` for every inode it evicts. Files in their grace
        are passed over; ``include_fresh`` (the last resort before ENOSPC) yields
        only them, the longest closed first: the file a writer closed a moment ago
        and is about to rename goes last. ``owners``: only files of these uids."""
        if owners is not None:
            uids, by_owner = owners, evictable

            def evictable(inode: Inode) -> bool:
                return inode.uid in uids and by_owner(inode)

        if include_fresh:
            yield from self._fresh_candidates(evictable, group)
            return
        if self.fresh():
            fresh = self._fresh
            inner = evictable

            def evictable(inode: Inode) -> bool:
                return inode.ino not in fresh and inner(inode)

        for ino in list(itertools.islice(self.orphans, ORPHAN_SCAN)):
            inode = self.ns.inodes.get(ino)
            if inode is None:
                self.orphans.pop(ino, None)
                continue
            if evictable(inode) and (group is None or self.group_of(inode) == group):
                yield inode, True
        yield from self._in_order(self.policy.victims(), evictable, group, orphans=False)

    def _fresh_candidates(
        self, evictable: Callable[[Inode], bool], group: int | None
    ) -> Iterator[tuple[Inode, bool]]:
        yield from self._in_order(list(self._fresh), evictable, group, orphans=True)

    def _in_order(
        self,
        keys: Iterable[int],
        evictable: Callable[[Inode], bool],
        group: int | None,
        orphans: bool,
    ) -> Iterator[tuple[Inode, bool]]:
        """(inode, is_orphan) of ``keys`` in their order that may go: evictable, in
        ``group`` if one is given, and in a kvfs-managed directory -- or, with
        ``orphans``, an orphan anywhere."""
        managed: dict[int, bool] = {}
        for ino in keys:
            inode = self.ns.inodes.get(ino)
            if inode is None or not evictable(inode):
                continue
            g = self.group_of(inode)
            if group is not None and g != group:
                continue
            orphan = orphans and ino in self.orphans
            if not orphan:
                if g not in managed:
                    managed[g] = self.group_policy(g) == KVFS_MANAGED
                if not managed[g]:
                    continue
            yield inode, orphan

    def statistics(self) -> EvictorStatistics:
        return EvictorStatistics(
            self.policy.name,
            len(self.policy),
            len(self.orphans),
            len(self._fresh),
            len(self._owned),
            self.evictions,
            self.orphan_evictions,
        )


__all__ = ["GROUP_XATTRS", "Evictor", "EvictorStatistics", "check_group_xattr", "parse_quota"]
