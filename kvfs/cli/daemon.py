"""What a mount daemon does around serving: logging (a file, syslog, stderr), the
systemd readiness protocol, and the pidfile ``kvfs umount`` waits on.

The pidfile is keyed by the FUSE connection: the mount's device number in
``/proc/self/mountinfo`` (``0:MINOR``, MINOR being the connection id of
``/sys/fs/fuse/connections/MINOR``), so ``kvfs umount`` finds the daemon of exactly
that mount, however its mountpoint was spelled when it was mounted.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import logging.handlers
import os
import re
import socket
import sys
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
RUN_DIR = os.environ.get("KVFS_RUN_DIR", "/run/kvfs")
"""Where mount daemons keep their pidfiles (``KVFS_RUN_DIR`` overrides it)."""
SYSLOG = os.environ.get("KVFS_SYSLOG", "/dev/log")
"""The syslog socket (journald reads it); ``KVFS_SYSLOG`` overrides it."""
LOG_DIR = os.environ.get("KVFS_LOG_DIR", "/var/log")
"""Where a daemon logs when there is no syslog and no ``--log-file``."""


# ----------------------------------------------------------------------------- mounts
@dataclass(frozen=True)
class Mount:
    devno: str
    """``major:minor`` of the mounted filesystem (for FUSE, minor = connection id)."""
    point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def mounts() -> list[Mount]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            out.append(
                Mount(fields[2], _unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2]))
            )
    return out


def mount_at(path: str) -> Mount | None:
    """The mount on top at exactly ``path`` (works on a dead FUSE mount too)."""
    found = None
    for m in mounts():
        if m.point == path:
            found = m
    return found


def mount_containing(path: str) -> Mount | None:
    """The mount that ``path`` lies on (the longest mount point above it)."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts():
        inside = real == m.point or real.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


KVFS_FSTYPE = "fuse.kvfs"


def stale_kvfs_mount(path: str) -> str | None:
    """The mount point of the kvfs mount ``path`` lies on if that mount's daemon is
    gone (the kernel answers ENOTCONN: only ``kvfs umount`` helps), else None."""
    m = mount_containing(path)
    if m is None or m.fstype != KVFS_FSTYPE:
        return None
    if killed_daemon(m) is not None:  # a request to it would wait forever: ask none
        return m.point
    return m.point if daemon_gone(m.point) else None


def stale_mount_message(point: str) -> str:
    """What to do about a mount whose daemon is gone (the kernel answers ENOTCONN)."""
    return f"{point}: stale kvfs mount (its daemon is gone): run `kvfs umount {point}`"


def daemon_gone(point: str) -> bool:
    """Is the FUSE mount at ``point`` left without its daemon? A statfs always asks
    the daemon (a stat may be answered from the kernel's attribute cache)."""
    try:
        os.statvfs(point)
    except OSError as e:
        return e.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


FUSECTL = "/sys/fs/fuse/connections"
"""The FUSE control filesystem: ``MINOR/abort`` ends every request of a connection."""


def abort_connection(mount: Mount) -> bool:
    """Abort the FUSE connection of ``mount`` (root only; fusectl is mounted first if
    it is not): every request waiting on it ends with ECONNABORTED, as when its
    daemon's ``/dev/fuse`` closes. Needed for a daemon that cannot close it: one
    killed while a thread of it sends a notification (an evicted file's
    ``invalidate_entry``) blocks, unkillably, on a directory lock that a caller
    waiting on the dead daemon holds (its ``open(O_CREAT)`` in that directory): the
    thread keeps the descriptor table, so the kernel never aborts, and both wait
    forever. False: no such connection (gone already) or not allowed."""
    minor = mount.devno.partition(":")[2]
    if not os.path.isdir(os.path.join(FUSECTL, minor)):
        import subprocess

        subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], capture_output=True)
    try:
        with open(os.path.join(FUSECTL, minor, "abort"), "w") as f:
            f.write("1")
    except OSError as e:
        log.debug("abort FUSE connection %s: %s", minor, e)
        return False
    return True


# ----------------------------------------------------------------------------- pidfile
def pidfile_path(devno: str) -> str:
    return os.path.join(RUN_DIR, devno.replace(":", "-") + ".pid")


def ring_path() -> str:
    """Where this daemon's aware ring listens (``kvfs.store.ring``)."""
    return os.path.join(RUN_DIR, f"ring-{os.getpid()}.sock")


def write_pidfile(mountpoint: str) -> str | None:
    """Record this process as the daemon of the mount at ``mountpoint`` (a real path:
    called before the mount serves, nothing may touch it); the path, or
    None where it cannot be written (then ``kvfs umount`` cannot wait for it)."""
    m = mount_at(mountpoint)  # no realpath here: it would stat our own, unserved mount
    if m is None:
        return None
    path = pidfile_path(m.devno)
    try:
        os.makedirs(RUN_DIR, mode=0o755, exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()}\n{m.point}\n")
        os.replace(tmp, path)
    except OSError as e:
        log.debug("no pidfile (%s): %s", path, e)
        return None
    return path


def remove_pidfile(path: str | None) -> None:
    if path is not None and read_pid(path) == os.getpid():
        with contextlib.suppress(OSError):
            os.unlink(path)


def read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.readline())
    except (OSError, ValueError):
        return None


def daemon_pid(mount: Mount) -> int | None:
    """The pid of the daemon serving ``mount``, from its pidfile (None if unknown)."""
    pid = read_pid(pidfile_path(mount.devno))
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"kvfs" not in f.read():
                return None  # a stale pidfile whose pid was reused
    except OSError:
        return None
    return pid


def killed_daemon(mount: Mount) -> int | None:
    """The pid in ``mount``'s pidfile if that daemon was killed and cannot finish
    exiting: its leader a zombie while a thread of it lives on (one stuck in a
    notification, see :func:`abort_connection`) and keeps ``/dev/fuse`` open, so any
    request to the mount, a ``statfs`` too, waits forever. None otherwise."""
    pid = read_pid(pidfile_path(mount.devno))
    seen = process_state(pid) if pid is not None else None
    return pid if seen is not None and seen[0] in ("Z", "X") and seen[1] > 1 else None


def process_state(pid: int) -> tuple[str, int] | None:
    """``pid``'s state letter (``R``, ``S``, ``Z``...) and its thread count, from
    ``/proc/PID/status``; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    return fields.get("State", "").strip()[:1], int(fields.get("Threads", "1"))


# ----------------------------------------------------------------------------- notify
def notify(state: str) -> bool:
    """Send ``state`` (``READY=1``, ``STOPPING=1``) to the service manager through
    ``$NOTIFY_SOCKET`` (sd_notify's protocol: one datagram on a unix socket, a name
    starting with ``@`` being abstract). False where there is none."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in "/@":
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as e:
        log.debug("notify %r: %s", state, e)
        return False
    return True


# ----------------------------------------------------------------------------- logging
class ReopenableFileHandler(logging.FileHandler):
    """A log file that SIGHUP reopens at its path (after logrotate moved it)."""

    def reopen(self) -> None:
        with self.lock if self.lock is not None else _nolock():
            if self.stream is not None:
                self.stream.close()
            self.stream = self._open()


class _nolock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_state: dict[str, object] = {"stderr_to_log": False}


class RateLimit(logging.Filter):
    """At most ``burst`` lines of one message (logger and format string: "checksum
    mismatch: inode %d ...") per ``interval`` seconds; the first line after that
    says how many were held back. A failing device cannot flood the log, and the
    count is never lost. DEBUG lines pass (``--debug`` wants them all)."""

    def __init__(self, burst: int = 20, interval: float = 10.0) -> None:
        super().__init__()
        self.burst, self.interval = burst, interval
        self._seen: dict[tuple[str, str], list[float]] = {}  # -> [window start, lines, held]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG:
            return True
        now = time.monotonic()
        key = (record.name, str(record.msg))
        seen = self._seen.get(key)
        if seen is None or now - seen[0] >= self.interval:
            held = int(seen[2]) if seen else 0
            if len(self._seen) > 4096:  # many distinct messages: forget the old windows
                self._seen.clear()
            self._seen[key] = [now, 1, 0]
            if held:
                record.msg = f"{record.msg} [{held} more like this in the last {self.interval:g} s]"
            return True
        if seen[1] < self.burst:
            seen[1] += 1
            return True
        seen[2] += 1
        return False


def configure_logging(debug: bool, log_file: str | None) -> None:
    """One line per event: to ``log_file``, else to stderr (``detach_logging`` moves
    a daemon's stderr logging to syslog)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler: logging.Handler
    handler = ReopenableFileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(RateLimit())
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def syslog_available() -> bool:
    return os.path.exists(SYSLOG)


def default_log_file(mountpoint: str) -> str:
    """A daemon's log file where there is no syslog: ``/var/log/kvfs-mnt-kv.log`` for
    ``/mnt/kv`` (the mount point's path, as systemd names its units)."""
    name = mountpoint.strip("/").replace("/", "-") or "root"
    return os.path.join(LOG_DIR, f"kvfs-{name}.log")


def daemon_logging(log_file: str | None) -> None:
    """A daemon, from its fork on: its log lines go to ``log_file`` (already set up
    by :func:`configure_logging`), else to syslog, never to the caller's terminal
    (which gets one result line). No syslog and no file: they are dropped (the
    caller said so: ``default_log_file`` is used unless it cannot be written)."""
    if log_file:
        return
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            root.removeHandler(h)
    if any(isinstance(h, logging.handlers.SysLogHandler) for h in root.handlers):
        return
    if syslog_available():
        try:
            sys_handler = logging.handlers.SysLogHandler(
                SYSLOG, facility=logging.handlers.SysLogHandler.LOG_DAEMON
            )
        except OSError:
            return
        sys_handler.setFormatter(
            logging.Formatter(f"kvfs[{os.getpid()}]: %(levelname)s %(name)s: %(message)s")
        )
        sys_handler.addFilter(RateLimit())
        root.addHandler(sys_handler)


def detach_logging(log_file: str | None) -> None:
    """A daemon just left its terminal: with a log file, stderr (tracebacks that
    bypass logging) goes to it too; without one, logging goes to syslog (journald
    reads ``/dev/log``; see :func:`daemon_logging`)."""
    if log_file:
        fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        _state["stderr_to_log"] = log_file
        return
    daemon_logging(None)


def reopen_logs() -> None:
    """SIGHUP: reopen the log file at its path (and a daemon's stderr with it)."""
    for h in logging.getLogger().handlers:
        if isinstance(h, ReopenableFileHandler):
            h.reopen()
    path = _state["stderr_to_log"]
    if isinstance(path, str):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
