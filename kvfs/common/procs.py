"""What kvfs reads about processes from ``/proc`` (one home for the parsing).

FUSE reports the calling *thread*; kvfs cares about processes (thread groups): who
owns a file (eviction: orphans) and whether a writer that closes a file is dying
from a signal (a killed writer's implicit close is not a real close). Permission
rules need the caller's thread itself: its supplementary groups and capabilities.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

PF_EXITING = 0x4
"""``task->flags`` bit set once a task has entered ``do_exit`` (include/linux/sched.h)."""


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` kvfs uses."""

    state: str
    flags: int
    start_time: int
    exit_code: int
    """The wait status the task will report (``task->exit_code``): set early in
    ``do_exit``, before the task's files are closed. 0 when we may not see it."""

    @property
    def exiting(self) -> bool:
        return self.state in ("Z", "X") or bool(self.flags & PF_EXITING)

    @property
    def killed(self) -> bool:
        """Exiting because of a signal (SIGKILL, SIGTERM, SIGSEGV...), not exit()."""
        return self.exiting and self.exit_code & 0x7F != 0


def stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` of a process or thread, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = data[data.rfind(b")") + 2 :].split()
    # fields[0] is field 3 (state); field N is fields[N - 3]
    exit_code = int(fields[49]) if len(fields) > 49 else 0
    return ProcStat(fields[0].decode(), int(fields[6]), int(fields[19]), exit_code)


def start_time(pid: int) -> int | None:
    """A live process's start time (clock ticks since boot), None if it is gone or a
    zombie: with the pid it names one process, even after pid reuse."""
    st = stat(pid)
    return None if st is None or st.state in ("Z", "X") else st.start_time


def thread_group(tid: int) -> int | None:
    """The process (thread group id) of a thread id, None if it is gone."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class Credentials:
    """The fields of ``/proc/<tid>/status`` kvfs uses to apply permission rules that
    depend on more than the uid and gid a FUSE request carries."""

    groups: frozenset[int]
    """Supplementary groups (``Groups:``)."""
    cap_effective: int
    """Effective capability set (``CapEff:``), bit n = capability n."""

    def capable(self, cap: int) -> bool:
        return bool(self.cap_effective >> cap & 1)


def credentials(tid: int) -> Credentials | None:
    """A thread's supplementary groups and effective capabilities (they are per
    thread), None if it is gone or ``/proc`` does not say."""
    groups: frozenset[int] | None = None
    caps: int | None = None
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    groups = frozenset(int(g) for g in line.split()[1:])
                elif line.startswith(b"CapEff:"):
                    caps = int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    if groups is None or caps is None:
        return None
    return Credentials(groups, caps)


def killed(pid: int, start: int) -> bool:
    """Is process ``pid`` (started at ``start``) dying from a signal right now?

    A close from a process that is exiting runs in ``do_exit`` after the exit code is
    set, and the process cannot be reaped until that close returns, so the answer
    is reliable while a FUSE flush from it is being served (``docs/design.md``)."""
    st = stat(pid)
    return st is not None and st.start_time == start and st.killed


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _uses(pid: str, root: str) -> bool:
    """Does process ``pid`` use a path under ``root``: its cwd, root, executable, an
    open file or a mapped one (what ``fuser -m`` looks at)?"""
    base = f"/proc/{pid}"
    links = [f"{base}/cwd", f"{base}/root", f"{base}/exe"]
    with contextlib.suppress(OSError):
        links += [f"{base}/fd/{fd}" for fd in os.listdir(f"{base}/fd")]
    for link in links:
        try:
            if _under(os.readlink(link), root):
                return True
        except OSError:
            continue
    try:
        with open(f"{base}/maps", "rb") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and _under(fields[5].strip().decode(errors="replace"), root):
                    return True
    except OSError:
        pass
    return False


def users_of(root: str) -> list[tuple[int, str]]:
    """(pid, command name) of every process but this one that uses a path under the
    mount point ``root``: what keeps it busy."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid() or not _uses(entry, root):
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # exited meanwhile
        found.append((int(entry), name))
    return sorted(found)


__all__ = [
    "PF_EXITING",
    "Credentials",
    "ProcStat",
    "credentials",
    "killed",
    "start_time",
    "stat",
    "thread_group",
    "users_of",
]
