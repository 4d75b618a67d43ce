"""Consistency checks of an index (pure, no I/O): shared by fsck and by recovery from a
damaged metadata log. Each finding is a :class:`Report` problem with the fix that a
repair applies; inodes that cannot be trusted are ``doomed`` (dropped by a repair).
"""

from __future__ import annotations

import functools
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfs.devices.pool import Pool
from kvfs.format.records import (
    DEV_SHIFT,
    FLAG_QUARANTINED,
    FLAG_WRITING,
    NO_UNIT,
    extent,
    fragment_size,
    is_fragment,
)
from kvfs.index.namespace import ROOT_INO, Inode, Namespace


@dataclass
class Report:
    """Findings in plain language; ``doomed`` inodes are dropped by a repair."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    doomed: set[int] = field(default_factory=set)
    fixes: list[Callable[[], None]] = field(default_factory=list)
    files: int = 0
    units_checked: int = 0

    def problem(
        self, text: str, fix: Callable[[], None] | None = None, doom: int | None = None
    ) -> None:
        """Record a problem; a repair runs ``fix`` and drops inode ``doom``."""
        self.problems.append(text)
        if fix is not None:
            self.fixes.append(fix)
        if doom is not None:
            self.fixes.append(functools.partial(self.doomed.add, doom))


def check_index(ns: Namespace, pool: Pool, report: Report) -> None:
    root = ns.inodes.get(ROOT_INO)
    if root is None or not root.is_dir:
        report.problem("the root directory is missing")
        return
    names: dict[int, int] = {}
    for d in ns.inodes.values():
        for name, ino in list((d.entries or {}).items()):
            if ino not in ns.inodes:
                report.problem(
                    f"name {name!r} in directory {d.ino} points to missing inode {ino}",
                    _remover(ns, d.ino, name),
                )
            else:
                names[ino] = names.get(ino, 0) + 1
    for inode in ns.inodes.values():
        _check_inode(inode, names.get(inode.ino, 0), pool, report)
    _check_claims(ns, pool, report)


def _remover(ns: Namespace, parent: int, name: bytes) -> Callable[[], None]:
    def fix() -> None:
        ns.detach(parent, name)

    return fix


def _check_inode(inode: Inode, links: int, pool: Pool, report: Report) -> None:
    if inode.ino == ROOT_INO:
        return
    what = f"inode {inode.ino} ({inode.name.decode(errors='replace') or '?'})"
    if links == 0:
        kind = "unlinked-while-open" if inode.nlink == 0 else "unreachable"
        if inode.nlink == 0:
            report.notes.append(f"{what}: {kind}, dropped at mount")
        else:
            report.problem(f"{what}: {kind}")
        report.doomed.add(inode.ino)
        return
    if inode.flags & FLAG_WRITING:
        report.notes.append(f"{what}: was mid-write at a crash; dropped at mount")
        report.doomed.add(inode.ino)
    if inode.flags & FLAG_QUARANTINED:
        report.notes.append(f"{what}: quarantined after a checksum failure; dropped at mount")
        report.doomed.add(inode.ino)
    if not inode.is_dir and inode.nlink != links:
        report.problem(
            f"{what}: link count {inode.nlink}, {links} name(s)",
            functools.partial(setattr, inode, "nlink", links),
        )
    expected = -(-inode.size // pool.unit_size)
    if not inode.is_dir and inode.nunits != expected:
        report.problem(
            f"{what}: unit map has {inode.nunits} entries for {inode.size} bytes",
            doom=inode.ino,
        )
    if not (stat.S_ISREG(inode.mode) or stat.S_ISDIR(inode.mode)):
        report.problem(f"{what}: unsupported file type {oct(inode.mode)}", doom=inode.ino)


def _check_claims(ns: Namespace, pool: Pool, report: Report) -> None:
    """Every mapped unit lies in the pool and has one owner; a fragment tail claims
    its fragments (several files share a host unit, none may hold it whole). Files
    already doomed (dropped at mount or by the repair) claim nothing."""
    whole: dict[tuple[int, int], int] = {}  # (device, unit) -> the inode holding it whole
    hosts: dict[tuple[int, int], int] = {}  # (device, unit) -> an inode with fragments there
    fragments: dict[tuple[int, int, int], int] = {}
    u_size = pool.unit_size
    frag = fragment_size(u_size)
    dropped = set(report.doomed)  # doomed before the claims: they claim nothing
    for inode in ns.inodes.values():
        if inode.ino in dropped:
            continue
        for p in inode.units:
            if p == NO_UNIT:
                continue
            dev = p >> DEV_SHIFT
            unit, skip, length = extent(p, u_size)
            what = f"inode {inode.ino}: unit {dev}:{unit}"
            if is_fragment(p):
                what += f" fragments {skip // frag}+{length // frag}"
            if (
                dev >= len(pool.devices)
                or unit >= pool.superblocks[dev].data_units
                or skip + length > u_size
            ):
                report.problem(f"{what} lies outside the pool", doom=inode.ino)
                break
            key = (dev, unit)
            if is_fragment(p):
                others = [whole.get(key)]
                hosts.setdefault(key, inode.ino)
                others += [
                    fragments.setdefault((dev, unit, f), inode.ino)
                    for f in range(skip // frag, (skip + length) // frag)
                ]
            else:
                others = [whole.setdefault(key, inode.ino), hosts.get(key)]
                if others[1] == inode.ino:  # its own tail's host cannot be held whole
                    others[1] = -1
            other = next((o for o in others if o is not None and o != inode.ino), None)
            if other is not None and inode.ino not in report.doomed:
                by = "its own fragments" if other < 0 else f"inode {other}"
                report.problem(f"{what} is also used by {by}", doom=inode.ino)
                break


def fix_dir_links(ns: Namespace) -> None:
    for d in ns.inodes.values():
        if d.entries is not None:
            subdirs = sum(1 for i in d.entries.values() if ns.inodes[i].is_dir)
            d.nlink = 2 + subdirs


__all__ = ["Report", "check_index", "fix_dir_links"]
