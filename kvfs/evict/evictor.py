"""Who may be evicted, and in which order. Pure and synchronous.

kvfs decides for the whole pool. Rules (``docs/eviction.md``):

1. Never an open file, a directory, or a file with uncommitted data.
2. Orphans first: files whose last user (the process that last opened them) is gone
   and that no live process has opened since — e.g. everything an engine wrote
   before it restarted. Liveness is checked by pid *and* process start time, so a
   recycled pid does not keep a file alive.
3. Then, only in directories whose policy is ``kvfs-managed``, the eviction
   policy's order (prefix-aware by default, see :mod:`kvfs.evict.policy`).
   ``engine-managed`` directories only ever lose orphans.

A *group* is a top-level directory (a child of the root; files directly in the root
form the root's group). Its policy and byte quota are the xattrs
``user.kvfs.policy`` and ``user.kvfs.quota`` on that directory, persisted like any
xattr (:mod:`kvfs.evict.groups`); a group without them uses the mount's defaults. The
orphans wait in an :class:`~kvfs.evict.orphans.OrphanList`.
"""

from __future__ import annotations

import itertools
import logging
import struct
import time
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from itertools import compress, islice
from operator import le

from kvfs.common import procs
from kvfs.evict.gone import GoneNames
from kvfs.evict.groups import (
    GROUP_XATTRS,
    KVFS_MANAGED,
    MAX_FILE_XATTR,
    POLICIES,
    POLICY_XATTR,
    QUOTA_XATTR,
    ROOT_XATTRS,
    check_group_target,
    check_group_xattr,
    parse_quota,
)
from kvfs.evict.orphans import OrphanList
from kvfs.evict.policy import DEFAULT_POLICY, Policy, make_policy
from kvfs.evict.slots import ROWS, SHIFT, SlotColumn
from kvfs.format import owners as owners_fmt
from kvfs.format.owners import MAX_PROCESSES, OWNERS_BLOB, PART_OWNERS, PART_POLICY, POLICY_BLOB
from kvfs.index.columns import ROWS as NS_ROWS
from kvfs.index.inodes import F_DEAD
from kvfs.index.namespace import EVICTOR_TAG, ROOT_INO, Inode, Namespace

log = logging.getLogger(__name__)

REAP_INTERVAL = 0.05
ORPHAN_SCAN = 4096
"""Orphans examined per eviction pass (keeps a pass O(1) with millions of orphans)."""
FRESH_GRACE = 5.0
"""Seconds after its commit (close) during which a file is evicted only as a last
resort, before ENOSPC: the moment between a writer's close and its first use of the
file (vLLM's ``os.replace`` of its tmp file) must not lose it (``docs/eviction.md``)."""
FRESH_GRACE_SHARE = 1 / 64
"""The most of the pool's data capacity the grace protects at once: when files in
their grace hold more, the longest-closed lose it first (each writer's newest file
always keeps it). The grace covers the moment between a close and a rename, never the
cache: 1/64 of a 245 TB drive is ~3.8 TB, far over what engines write in 5 s, so a
large pool keeps the whole time bound; on a small pool, where 5 s of writes can
exceed the whole pool, the eviction order stays the policy's (``docs/eviction.md``,
"The grace's byte bound")."""


GONE_MIN = 1024
"""Names of gone files remembered at least (as many as files are tracked, else)."""
FALLBACK_POLICY = "lru"
FAULTS_BEFORE_FALLBACK = 3
"""A policy that raised this many times in one mount is replaced by
``FALLBACK_POLICY`` (the simplest order) rather than rebuilt once more: a fault that
comes back after each rebuild is in the policy's code, not in its state."""


@dataclass(frozen=True)
class EvictorStatistics:
    policy: str
    tracked: int
    orphans: int
    fresh: int
    owners: int
    evictions: int
    orphan_evictions: int
    policy_faults: int = 0
    """Times the policy raised and was rebuilt (:meth:`Evictor.policy_failed`)."""


_REGULAR = bytes(int(b & 0xF0 == 0x80) for b in range(256))
"""A mode's high byte -> 1 for a regular file (S_IFREG)."""
_ALIVE = bytes(int(not b & F_DEAD) for b in range(256))
"""Inode flags -> 1 unless dropped."""


def _chunk_id(inode: Inode) -> int:
    """What a file holds, as the policy may know it across rewrites: its name in
    its directory (a chunk written again after its eviction is a new inode under
    the same name), as a non-negative int (this process's hash)."""
    return hash((inode.parent, inode.name)) & _ID_MASK


_ID_MASK = (1 << 62) - 1


class Evictor:
    """Ownership, orphans and eviction order over one namespace."""

    def __init__(
        self,
        ns: Namespace,
        policy: str = DEFAULT_POLICY,
        default_policy: str = KVFS_MANAGED,
        default_quota: int = 0,
        alive: Callable[[int], int | None] = procs.start_time,
        thread_group: Callable[[int], int | None] = procs.thread_group,
        grace: float = FRESH_GRACE,
        grace_bytes: int = 0,
    ) -> None:
        if default_policy not in POLICIES:
            raise ValueError(f"default policy must be one of {POLICIES}")
        self.ns = ns
        self.policy: Policy = make_policy(policy)
        self.default_policy = default_policy
        self.default_quota = default_quota
        self._alive = alive
        self._thread_group = thread_group
        self._tgids: dict[int, tuple[int, float]] = {}
        self._reaped = 0.0
        # who last opened each file: a process number per inode (0: none), the
        # processes by number, and how many files each owns; a chunk of the column is
        # a byte a row while its process numbers are under 256 (a few engines), two
        # past that (the image keeps two bytes a row either way: owners_fmt.encode)
        self._owner = SlotColumn("I", narrow=True)  # (numbers < 2**16: "B" or "H")
        self._procs: list[tuple[int, int] | None] = [None]
        self._proc_ids: dict[tuple[int, int], int] = {}
        self._proc_files = [0]
        self._free_ids: list[int] = []
        self.orphans = OrphanList()
        self._starts: dict[int, int] = {}
        self.grace = grace
        self.grace_bytes = grace_bytes
        """The most bytes files in their grace may hold (0: no bound)."""
        # ino -> (end of its grace, size, writer's thread id), in commit order
        self._fresh: dict[int, tuple[float, int, int]] = {}
        self._fresh_bytes = 0
        self._newest: dict[int, int] = {}  # writer -> its newest file in its grace
        self._gone = GoneNames()  # _chunk_id (its name) -> a gone file's ghost
        self.evictions = self.orphan_evictions = 0
        self.policy_faults = 0

    # ------------------------------------------------------------------ events
    def adopt_all(self) -> None:
        """After a mount: the policy resumes from the state of the last checkpoint
        (learned chains included), files gone since leave it and files it lacks join
        it (mtime order); every file is an orphan, oldest first, unless the process
        that last opened it is still alive.

        C-level scans of the namespace's and the policy's columns: no per-file
        Python call on a first mount (every file joins the policy in bulk)."""
        payloads, self.ns.evictor_payloads = self.ns.evictor_payloads, []
        policy_pieces = [p[2:] for p in payloads if p[1:2] == PART_POLICY]
        owner_pieces = [p[2:] for p in payloads if p[1:2] == PART_OWNERS]
        del payloads
        blob = self.ns.blobs.pop(POLICY_BLOB, None)  # an older pool: read once
        owners_blob = self.ns.blobs.pop(OWNERS_BLOB, None)
        try:
            if policy_pieces:
                self._recover_pieces(policy_pieces)
            elif blob:
                self._recover_policy(blob)
        except Exception:  # a policy's bug: its order, never a byte (nor the mount)
            self.policy_failed("mount", adopt=False)  # every file joins it below
        del policy_pieces, blob
        files, sizes, present, spans = self._files_by_mtime()
        try:
            self._resume(files, sizes, present, spans)
        except Exception:  # a policy's bug: its order, never a byte (nor the mount)
            self.policy_failed("mount")
        del sizes
        live = self._load_owners(owner_pieces, owners_blob, present)
        if not live:
            self.orphans.extend(files, spans)
            return
        owner = self._owner
        self.orphans.extend(array("q", (ino for ino in files if not owner.get(ino, 0))))

    def _resume(
        self,
        files: array[int],
        sizes: array[int],
        present: bytes,
        spans: list[tuple[int, int]] | None,
    ) -> None:
        """The policy as the checkpoint left it, less the files gone since, plus
        the files it lacks (``files``: every live file, mtime order)."""
        resident = self.policy.resident_mask(len(present))
        missing: list[int] | None
        if resident is None:  # a policy keyed through a dict (not one of the mount's)
            tracked = self.policy.keys()
            absent: Collection[int] = tracked - set(files)
            missing = [int(ino not in tracked) for ino in files]
        else:
            have, want = int.from_bytes(resident, "little"), int.from_bytes(present, "little")
            gone = (have & ~want).to_bytes(len(present), "little")
            absent = set(compress(range(len(present)), gone)) if have & ~want else set()
            new = want & ~have
            lacking = new.to_bytes(len(present), "little")
            missing = None if new == want else [lacking[ino] for ino in files]
            del have, want, gone
        if absent:
            self.policy.remove_many(absent)  # in victims() order, as one by one would
        if missing is None:
            self.policy.adopt(files, sizes, spans)
        elif any(missing):
            self.policy.adopt(
                array("q", compress(files, missing)), array("q", compress(sizes, missing))
            )

    def _files_by_mtime(
        self,
    ) -> tuple[array[int], array[int], bytes, list[tuple[int, int]] | None]:
        """(inodes, sizes) of every live file, oldest mtime first (inode number on a
        tie), a byte per inode number below ``next_ino``: 1 for a live file, and
        when that order is the inode order, the runs of consecutive inodes in it
        (from the bytes: ``slots.runs`` without its per-key work).
        Per namespace chunk C-level byte translations; the sort only if the mtimes
        are not already in inode order (files written one after the other)."""
        ns = self.ns
        end = ns.next_ino
        inos, sizes, mtimes = array("q"), array("q"), array("q")
        masks = []
        cols = zip(
            ns._mode.chunks, ns._flags.chunks, ns._size.chunks, ns._mtime.chunks, strict=True
        )
        for c, (modes, flags, size, mtime) in enumerate(cols):
            base = c * NS_ROWS
            if base >= end:
                break
            regular = modes.tobytes()[1::2].translate(_REGULAR)  # the mode's high byte
            alive = flags.tobytes().translate(_ALIVE)
            mask = (int.from_bytes(regular, "little") & int.from_bytes(alive, "little")).to_bytes(
                NS_ROWS, "little"
            )
            masks.append(mask)
            if mask.count(0) == NS_ROWS:
                continue
            inos.extend(compress(range(base, base + NS_ROWS), mask))
            sizes.extend(compress(size, mask))
            mtimes.extend(compress(mtime, mask))
        present = b"".join(masks)[:end]
        if not all(map(le, mtimes, islice(mtimes, 1, None))):
            order = sorted(range(len(inos)), key=mtimes.__getitem__)
            inos = array("q", map(inos.__getitem__, order))
            sizes = array("q", map(sizes.__getitem__, order))
            return inos, sizes, present, None
        spans, done, pos = [], 0, present.find(1)
        while pos >= 0:
            stop = present.find(0, pos)
            stop = len(present) if stop < 0 else stop
            spans.append((done, done + stop - pos))
            done += stop - pos
            pos = present.find(1, stop)
        return inos, sizes, present, spans

    def _recover_pieces(self, pieces: list[bytes]) -> None:
        """Resume from the version 2 image of the last checkpoint (or adopt what
        it can from another policy's); never fails the mount."""
        try:
            self.policy.recover_pieces(pieces)
            return
        except (ValueError, OverflowError, IndexError, struct.error) as e:
            reason = str(e)
        if self.policy.recover_foreign(b"".join(pieces)):
            log.info("eviction state of another policy adopted (%s)", reason)
            return
        log.warning("saved eviction state unusable (%s); starting afresh", reason)
        self.policy.reset()

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

    def _load_owners(self, pieces: list[bytes], blob: bytes | None, present: bytes) -> int:
        """Restore who owns which file from the checkpoint (or an older pool's blob),
        keeping only processes still alive (one /proc read each) and files that are
        still there; returns how many processes own files."""
        saved = owners_fmt.Owners([None], [])
        try:
            if pieces:
                saved = owners_fmt.decode(pieces)
            elif blob:
                saved = owners_fmt.decode_blob(blob)
        except ValueError as e:
            log.warning("saved file owners unusable (%s); every file starts as an orphan", e)
            return 0
        live = {}
        for number, proc in enumerate(saved.procs):
            if proc is not None and self._alive(proc[0]) == proc[1]:
                live[number] = proc
        if not live:
            return 0
        for c, chunk in enumerate(saved.chunks):
            if chunk is None or chunk.count(0) == ROWS:
                continue
            for i, number in enumerate(chunk):
                proc = live.get(number) if number else None
                ino = (c << SHIFT) + i
                if proc is not None and ino < len(present) and present[ino]:
                    self._own(ino, proc)  # its engine outlived the remount
        return len(self._proc_ids)

    def snapshot_payloads(self) -> Iterator[bytes]:
        """Freeze the policy's and the owners' state now (O(chunks)) and return an
        iterator over checkpoint payloads of it, encoded as they are consumed (off
        the event loop). The blobs of an older pool are dropped: the checkpoint
        carries these payloads instead."""
        self.ns.blobs.pop(POLICY_BLOB, None)
        self.ns.blobs.pop(OWNERS_BLOB, None)
        pieces: Iterator[bytes] = iter(())  # none: the next mount adopts every file
        for _ in range(2):  # a second fault in one freeze: no policy state this time
            try:
                pieces = self.policy.persist_pieces()
                break
            except Exception:  # a policy's bug: its order, never a byte
                self.policy_failed("checkpoint")
        owners = self._owner.freeze()
        procs_ = list(self._procs)  # a copy: the pieces are encoded later
        tag = bytes((EVICTOR_TAG,))

        def payloads() -> Iterator[bytes]:
            for piece in pieces:
                yield tag + PART_POLICY + piece
            for piece in owners_fmt.encode(procs_, owners):
                yield tag + PART_OWNERS + piece

        return payloads()

    def save(self) -> None:
        """Encode the state now (tests and tools): ``snapshot_payloads`` consumed
        at once, kept where a checkpoint's load puts them (``ns.evictor_payloads``)."""
        self.ns.evictor_payloads = list(self.snapshot_payloads())

    def opened(self, inode: Inode, pid: int) -> tuple[int, int] | None:
        """A live process opened the file: it is no orphan, and it is touched.
        Returns the opener as (process id, start time), None if unknown."""
        self.orphans.pop(inode.ino, None)
        owner = self._set_owner(inode.ino, pid)
        try:
            self.policy.identify(inode.ino, _chunk_id(inode))
            self.policy.touch(inode.ino, (pid, inode.parent))
        except Exception:  # a policy's bug: its order, never a byte
            self.policy_failed("touch")
        return owner

    def committed(self, inode: Inode, pid: int) -> None:
        """A file was closed with new data: track it, and give it its grace. A new
        file with the name of one that went (an evicted chunk written again)
        inherits what the policy remembers of it (``Policy.put_ghost``)."""
        try:
            self._track(inode, pid)
        except Exception:  # a policy's bug: its order, never a byte
            self.policy_failed("track")  # the rebuilt policy has the file
        self._unfresh(inode.ino)
        if self.grace > 0:
            self._fresh[inode.ino] = (time.monotonic() + self.grace, inode.size, pid)
            self._fresh_bytes += inode.size
            self._newest[pid] = inode.ino
            self._bound_fresh()

    def _track(self, inode: Inode, pid: int) -> None:
        if inode.ino not in self.policy:
            # the namespace reuses inode numbers: what the policy remembers under this
            # one was another file's (dropped); what it remembers of this name is this
            # file's
            self.policy.take_ghost(inode.ino)
            ghost = self._gone.pop(_chunk_id(inode)) if self._gone else None
            if ghost is not None:
                self.policy.put_ghost(inode.ino, ghost)
        self.policy.identify(inode.ino, _chunk_id(inode))
        self.policy.track(inode.ino, inode.size, (pid, inode.parent))

    def policy_failed(self, where: str, leaving: int | None = None, adopt: bool = True) -> None:
        """The policy raised (in ``where``): a bug in its code or state. What it
        holds is only an order, never where a byte is, so the mount goes on: the
        error is logged with its traceback, and the policy is made anew from the
        namespace, every live file in mtime order, as a first mount adopts them
        (``leaving``, a file on its way out, excepted); the names of gone files
        are forgotten with it. After :data:`FAULTS_BEFORE_FALLBACK` faults the
        new policy is :data:`FALLBACK_POLICY`. ``adopt=False``: the new policy is
        left empty (the caller adopts the files). Call from an ``except`` block."""
        self.policy_faults += 1
        name = self.policy.name
        if self.policy_faults >= FAULTS_BEFORE_FALLBACK:
            name = FALLBACK_POLICY
        log.exception(
            "eviction policy %s failed (%s, fault %d); its order starts again from the "
            "files' mtimes under %s; no file is lost",
            self.policy.name,
            where,
            self.policy_faults,
            name,
        )
        self.policy = make_policy(name)
        self._gone = GoneNames()
        if not adopt:
            return
        files, sizes, _, spans = self._files_by_mtime()
        if leaving is not None and leaving in files:
            keep = [ino != leaving for ino in files]
            files, sizes = array("q", compress(files, keep)), array("q", compress(sizes, keep))
            spans = None
        try:
            self.policy.adopt(files, sizes, spans)
        except Exception:  # the policy's code itself: the fallback's order from here
            log.exception("eviction policy %s failed to adopt the files; %s", name, FALLBACK_POLICY)
            self.policy = make_policy(FALLBACK_POLICY)
            self.policy.adopt(files, sizes, spans)

    def _unfresh(self, ino: int) -> None:
        entry = self._fresh.pop(ino, None)
        if entry is not None:
            self._fresh_bytes -= entry[1]
            if self._newest.get(entry[2]) == ino:
                del self._newest[entry[2]]

    def _bound_fresh(self) -> None:
        """While the files in their grace hold more than ``grace_bytes``, the
        longest closed lose it -- but never a writer's newest file: a writer (vLLM's
        fs tier, LMCache) renames or reads the file it just closed before it writes
        the next, so that file must survive whatever the other writers close."""
        over = self._fresh_bytes - self.grace_bytes
        if not self.grace_bytes or over <= 0:
            return
        newest = self._newest
        drop = []
        for ino, (_, size, writer) in self._fresh.items():
            if over <= 0:
                break
            if newest.get(writer) != ino:
                drop.append(ino)
                over -= size
        for ino in drop:
            self._unfresh(ino)

    def fresh(self) -> int:
        """Files still in their grace (expired ones are forgotten first)."""
        now = time.monotonic()
        expired = []
        for ino, (deadline, _, _) in self._fresh.items():
            if deadline > now:
                break
            expired.append(ino)
        for ino in expired:
            self._unfresh(ino)
        return len(self._fresh)

    def fresh_bytes(self) -> int:
        """Bytes of the files in their grace (as of their close)."""
        return self._fresh_bytes

    def created(self, inode: Inode, pid: int) -> None:
        self.orphans.pop(inode.ino, None)
        self._set_owner(inode.ino, pid)

    def forget(self, ino: int) -> None:
        inode = self.ns.inodes.get(ino)
        name = None  # a tracked file's (parent, name): its ghost is kept under it
        try:
            if inode is not None and ino in self.policy:
                name = _chunk_id(inode)
            self.policy.remove(ino)
            ghost = None if name is None else self.policy.take_ghost(ino)
            if name is not None and ghost is not None:
                self._gone.put(name, ghost, max(GONE_MIN, len(self.policy)))
        except Exception:  # a policy's bug: its order, never a byte
            self.policy_failed("remove", leaving=ino)
        self.orphans.pop(ino, None)
        self._unfresh(ino)
        self.forget_owner(ino)

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
        return self._own(ino, (pid, start))

    def _own(self, ino: int, key: tuple[int, int]) -> tuple[int, int] | None:
        """``key`` (pid, start time) owns ``ino`` now; returns the process's one
        shared tuple (None: more than MAX_PROCESSES processes own files)."""
        number = self._proc_ids.get(key)
        if number is not None and self._owner.get(ino, 0) == number:
            return self._procs[number]
        self.forget_owner(ino)
        if number is None:
            if self._free_ids:
                number = self._free_ids.pop()
                self._procs[number] = key
            elif len(self._procs) <= MAX_PROCESSES:
                number = len(self._procs)
                self._procs.append(key)
                self._proc_files.append(0)
            else:
                return None
            self._proc_ids[key] = number
        self._owner.ensure_row(ino)
        self._owner[ino] = number
        self._proc_files[number] += 1
        return self._procs[number]

    def owner_of(self, ino: int) -> tuple[int, int] | None:
        """(pid, start time) of the live process that last opened ``ino``, or None."""
        return self._procs[self._owner.get(ino, 0)]

    def forget_owner(self, ino: int) -> None:
        number = self._owner.get(ino, 0)
        if number:
            self._owner[ino] = 0
            self._proc_files[number] -= 1
            if not self._proc_files[number]:
                self._drop_process(number)

    def _drop_process(self, number: int) -> None:
        key = self._procs[number]
        assert key is not None
        del self._proc_ids[key]
        self._procs[number] = None
        self._proc_files[number] = 0
        self._free_ids.append(number)

    def processes(self) -> list[tuple[int, int]]:
        """The (pid, start time) of every process that owns files."""
        return list(self._proc_ids)

    def _files_of(self, number: int) -> Iterator[int]:
        """Inodes process ``number`` owns: a C-level search of the owner column."""
        left = self._proc_files[number]
        for c, chunk in enumerate(self._owner.chunks):
            if chunk is None or not left:
                continue
            width = chunk.itemsize  # 1 or 2 (a narrowed chunk: numbers under 256)
            if number >> 8 * width:
                continue
            pattern = number.to_bytes(width, "little")
            raw = chunk.tobytes()
            at = raw.find(pattern)
            while at >= 0:
                if not at % width:
                    left -= 1
                    yield (c << SHIFT) + at // width
                at = raw.find(pattern, at + 1)

    def reap(self) -> int:
        """Turn the files of processes that exited into orphans, oldest mtime first
        (inode numbers are reused: inode order is not age order); returns how many.
        Runs at most every REAP_INTERVAL seconds (it reads /proc per owner)."""
        now = time.monotonic()
        if now - self._reaped < REAP_INTERVAL:
            return 0
        self._reaped = now
        dead = [(n, k) for k, n in self._proc_ids.items() if self._alive(k[0]) != k[1]]
        for _, (pid, _start) in dead:
            self._starts.pop(pid, None)
        inodes, orphaned = self.ns.inodes, []
        for number, _key in dead:
            for ino in list(self._files_of(number)):
                self._owner[ino] = 0
                if ino in inodes:
                    orphaned.append(ino)
            self._drop_process(number)
        orphaned.sort()  # the tie break: inode order
        orphaned.sort(key=self.ns._mtime.__getitem__)
        for ino in orphaned:
            self.orphans.add(ino)
        return len(orphaned)

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
        are passed over unless orphans; ``include_fresh`` (the last resort before ENOSPC) yields
        only them, the longest closed first: the file a writer closed a moment ago
        and is about to rename goes last. ``owners``: only files of these uids."""
        if owners is not None:
            uids, by_owner = owners, evictable

            def evictable(inode: Inode) -> bool:
                return inode.uid in uids and by_owner(inode)

        if include_fresh:
            yield from self._fresh_candidates(evictable, group)
            return
        # orphans first, in their grace or not: the grace keeps a file for its
        # writer's rename, and an orphan's writer is gone
        for ino in list(itertools.islice(self.orphans, ORPHAN_SCAN)):
            inode = self.ns.inodes.get(ino)
            if inode is None:
                self.orphans.pop(ino, None)
                continue
            if evictable(inode) and (group is None or self.group_of(inode) == group):
                yield inode, True
        if self.fresh():
            fresh = self._fresh
            inner = evictable

            def evictable(inode: Inode) -> bool:
                return inode.ino not in fresh and inner(inode)

        yield from self._in_order(self._victims(), evictable, group, orphans=False)

    def _victims(self) -> Iterator[int]:
        """The policy's victims; a policy that raises on the way is made anew
        (:meth:`policy_failed`) and its order followed from its start (the files
        evicted meanwhile have left it), once: a second fault in one pass ends it."""
        for _ in range(2):
            try:
                yield from self.policy.victims()
                return
            except Exception:  # a policy's bug: its order, never a byte
                self.policy_failed("victims")

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
            len(self._proc_ids),
            self.evictions,
            self.orphan_evictions,
            self.policy_faults,
        )


__all__ = [
    "GROUP_XATTRS",
    "ROOT_XATTRS",
    "Evictor",
    "EvictorStatistics",
    "check_group_target",
    "check_group_xattr",
    "parse_quota",
]
