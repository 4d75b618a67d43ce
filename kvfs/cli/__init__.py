"""The ``kvfs`` command: format, mount, umount, stats, fsck, upgrade.

Exit codes: 0 success; 1 the operation failed (device error, mount failed);
2 bad usage or input the user can fix (message on one line, no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from kvfs.common import sizes
from kvfs.common.errors import KvfsError, UserError
from kvfs.evict.policy import DEFAULT_POLICY, POLICY_NAMES

log = logging.getLogger("kvfs")

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def parse_size(text: str) -> int:
    """A size option (grammar: :mod:`kvfs.common.sizes`) as bytes, for argparse."""
    try:
        return sizes.parse_size(text)
    except sizes.SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_image_size(text: str) -> int:
    """``--create``'s size: a size above 0 (an image of 0 bytes holds no pool)."""
    value = parse_size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: an image needs a size above 0 (e.g. --create 64G)"
        )
    return value


def parse_seconds(text: str) -> float:
    """A duration in seconds: a finite number >= 0 (``30``, ``0.5``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 30, 0.5)")
    return value


def parse_fraction(text: str) -> float:
    """A share of the pool: a number in [0, 1] (``0.97``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction between 0 and 1")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line that says where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvfs",
        description="KV-cache filesystem on raw NVMe. Sizes are bytes or take a unit: "
        "K/M/G/T/P (also KiB..PiB) are powers of 1024, KB/MB/GB/TB/PB powers of 1000.",
        epilog="kvfs help COMMAND shows a command's options. docs/operations.md: the guide.",
    )
    p.add_argument("--debug", action="store_true", help="verbose logging")
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    common = _Parser(add_help=False)
    common.add_argument(  # after the command too: `kvfs mount --debug ...`
        "--debug", action="store_true", default=argparse.SUPPRESS, help="verbose logging"
    )

    def add(name: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kw)

    f = add("format", help="create an empty pool on devices (destroys data)")
    f.add_argument("devices", nargs="+", metavar="DEVICE", help=DEVICES_HELP)
    _format_options(f)

    m = add("mount", help="mount a pool")
    m.add_argument("mountpoint", help="an empty directory to mount the pool on")
    m.add_argument("devices", nargs="+", metavar="DEVICE", help=DEVICES_HELP)
    m.add_argument("--format", action="store_true", help="format the devices first")
    _format_options(m)
    m.add_argument("--foreground", "-f", action="store_true", help="do not daemonize")
    m.add_argument("--allow-other", action="store_true", help="let other users access it")
    m.add_argument("--cache", type=parse_size, default=256 << 20, help="read cache (256M)")
    m.add_argument("--io-timeout", type=parse_seconds, default=30.0, help="device deadline, s")
    m.add_argument(
        "--log-file",
        help="log here; SIGHUP reopens it (default: stderr in the foreground, syslog "
        "when daemonized)",
    )
    m.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (e.g. 127.0.0.1:9480)",
    )
    m.add_argument("--fuse-option", action="append", default=[], help=argparse.SUPPRESS)
    m.add_argument(
        "--eviction",
        choices=POLICY_NAMES,
        default=DEFAULT_POLICY,
        help=f"eviction order inside kvfs-managed directories ({DEFAULT_POLICY})",
    )
    m.add_argument(
        "--default-policy",
        choices=("kvfs-managed", "engine-managed"),
        default="kvfs-managed",
        help="policy of directories without a user.kvfs.policy xattr",
    )
    m.add_argument(
        "--fresh-grace",
        type=parse_seconds,
        default=5.0,
        help="seconds after a close during which a file is evicted only as a last resort (5)",
    )
    m.add_argument(
        "--high-watermark",
        type=parse_fraction,
        default=0.97,
        help="start evicting above this used fraction (0.97)",
    )
    m.add_argument(
        "--low-watermark",
        type=parse_fraction,
        default=0.94,
        help="evict down to this used fraction (0.94; deeper batches cost hit rate, "
        "see docs/eviction.md)",
    )
    m.add_argument("--no-discard", action="store_true", help="do not TRIM freed extents")
    m.add_argument(
        "--reserve",
        type=parse_fraction,
        default=0.05,
        help="share of the pool only root and the mount's owner may fill (0.05)",
    )
    m.add_argument(
        "--max-file-size",
        type=parse_size,
        default=0,
        help="largest file, e.g. 8G (default: a quarter of the pool; a top-level "
        "directory may set its own with user.kvfs.max_file_size)",
    )
    m.add_argument(
        "--cluster",
        metavar="URL",
        help="share files with other nodes through a Mooncake Store: "
        "mooncake://MASTER_HOST:PORT?metadata=URL[&knob=value...] (docs/cluster.md)",
    )
    m.add_argument(
        "--degraded",
        action="store_true",
        help="mount even if members other than the first are missing: files with data "
        "on a missing member stay listed, but their reads and writes fail (EIO; a full "
        "rewrite with O_TRUNC is allowed) until a mount with every member serves them again",
    )
    m.add_argument(
        "--drop-unreadable",
        action="store_true",
        help="with --degraded: drop the files with data on a missing member instead "
        "(for good: they stay gone when the member returns)",
    )

    ck = add("fsck", help="check (and --repair) an unmounted pool")
    ck.add_argument("devices", nargs="+", metavar="DEVICE", help=DEVICES_HELP)
    ck.add_argument("--repair", action="store_true", help="drop what cannot be trusted")
    ck.add_argument("--no-data", action="store_true", help="skip reading every data unit")

    up = add("upgrade", help="give an unmounted format-version-1 pool backup superblocks, in place")
    up.add_argument("devices", nargs="+", metavar="DEVICE", help="every device of the pool")

    pol = add("policy", help="show or set a top-level directory's policy/quota")
    pol.add_argument("directory", help="a top-level directory of a kvfs mount")
    pol.add_argument(
        "--set",
        choices=("kvfs-managed", "engine-managed"),
        help="kvfs-managed: kvfs evicts in policy order; engine-managed: only orphans",
    )
    pol.add_argument("--quota", help="byte quota, e.g. 100G (0 removes it)")
    pol.add_argument(
        "--max-file-size", help="largest file in the directory, e.g. 8G (0 removes it)"
    )

    u = add("umount", help="unmount and wait for the daemon to finish")
    u.add_argument("mountpoint", help="where the pool is mounted")
    u.add_argument(
        "--timeout", type=parse_seconds, default=60.0, help="seconds to wait for the daemon (60)"
    )
    u.add_argument(
        "--lazy",
        "-z",
        action="store_true",
        help="detach a busy mount now; its daemon ends once the last process using it lets go",
    )

    for parser_ in sub.choices.values():  # one metavar per kind of value
        for action in parser_._actions:
            kind = {
                parse_size: "SIZE",
                parse_image_size: "SIZE",
                parse_seconds: "SECONDS",
                parse_fraction: "FRACTION",
            }
            if action.metavar is None and action.type in kind:
                action.metavar = kind[action.type]
    h = add("help", help="a command's options in full: kvfs help mount")
    h.add_argument("topic", nargs="?", metavar="COMMAND", help="a command (none: all commands)")
    from kvfs.cli import plan, statsview

    statsview.add_arguments(add("stats", help="statistics of a mounted pool"))
    plan.add_arguments(
        add("plan", help="what a pool holds for a model: chunk size, tokens, unit size")
    )
    return p


DEVICES_HELP = (
    "block devices (e.g. /dev/nvme0n1) or image files, in the pool's order; a pool's "
    "members may be named in any order when mounting"
)


def version_line() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from kvfs.format.superblock import FORMAT_VERSION

    try:
        release = version("kvfs")
    except PackageNotFoundError:  # run from a checkout without installing
        release = "unknown"
    return f"kvfs {release} (on-device format {FORMAT_VERSION})"


def _format_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="overwrite foreign data or pools")
    p.add_argument("--unit-size", type=parse_size, default=1 << 20, help="extent unit (1M)")
    p.add_argument(
        "--meta-size",
        type=parse_size,
        default=0,
        help="metadata area (default: sized for a full pool of --mean-file-size files)",
    )
    p.add_argument(
        "--mean-file-size",
        type=parse_size,
        default=0,
        help="expected mean file size, sizes the metadata area (default: one unit)",
    )
    p.add_argument(
        "--create",
        type=parse_image_size,
        metavar="SIZE",
        default=0,
        help="create missing image files of SIZE (sparse)",
    )
    p.add_argument("--label", default="", help="a name for the pool (df shows kvfs:LABEL)")


def main(argv: list[str] | None = None) -> int:
    from kvfs.cli import daemon, mounthelper

    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if mounthelper.is_helper_call(argv, set(sub.choices)):  # mount -t fuse.kvfs, fstab
        try:
            argv = mounthelper.translate(argv, sub.choices["mount"])
        except UserError as e:
            print(f"kvfs: {e}", file=sys.stderr)
            return e.exit_code
    args = parser.parse_args(argv)
    if args.command == "help":
        return cmd_help(parser, sub, args.topic)
    if getattr(args, "log_file", None):
        args.log_file = os.path.abspath(args.log_file)  # the daemon chdirs to /
    daemon.configure_logging(args.debug, getattr(args, "log_file", None))
    logging.getLogger("pyfuse3").addFilter(_abandoned_reply)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "format": cmd_format,
        "mount": cmd_mount,
        "umount": cmd_umount,
        "stats": cmd_stats,
        "plan": cmd_plan,
        "policy": cmd_policy,
        "fsck": cmd_fsck,
        "upgrade": cmd_upgrade,
    }
    code = _run_command(commands[args.command], args)
    if getattr(args, "cluster", None):
        _exit_past_the_cluster_client(code)
    return code


def _run_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """The command's exit code; its errors as one line on stderr."""
    try:
        try:
            return command(args)
        except BaseExceptionGroup as group:  # a trio nursery's: report what went wrong
            raise root_cause(group) from None
    except UserError as e:
        print(f"kvfs: {e}", file=sys.stderr)
        return e.exit_code
    except KvfsError as e:
        print(f"kvfs: {e}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return EXIT_FAIL
    except BrokenPipeError:  # `kvfs ... | head`: the reader left; nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error flushing stdout at exit
        return EXIT_OK


def _exit_past_the_cluster_client(code: int) -> None:
    """End a mount that set up a Mooncake client with ``os._exit``, once its logs and
    output are flushed: the interpreter's own exit would close that client, which can
    hold the process for many seconds when the master is gone (kvfs.cluster.client._KEPT).
    Returns when no client was made."""
    from kvfs import cluster

    if not cluster.clients_made():
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def root_cause(e: BaseException) -> BaseException:
    """The exception a person should read: inside exception groups (trio nurseries),
    the first kvfs error if there is one, else the first leaf."""
    leaves: list[BaseException] = []
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, BaseExceptionGroup):
            stack.extend(reversed(x.exceptions))
        else:
            leaves.append(x)
    ours = [x for x in leaves if isinstance(x, (UserError, KvfsError))]
    return (ours or leaves or [e])[0]


def describe(e: BaseException) -> str:
    """One line for a person: the message, not the exception's repr."""
    e = root_cause(e)
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}"
    return str(e) or type(e).__name__


def cmd_help(
    parser: argparse.ArgumentParser, sub: argparse._SubParsersAction[Any], topic: str | None
) -> int:
    if topic is None:
        parser.print_help()
        return EXIT_OK
    if topic not in sub.choices:
        names = ", ".join(c for c in sub.choices if c != "help")
        print(f"kvfs help: no command {topic!r} (commands: {names})", file=sys.stderr)
        return EXIT_USAGE
    sub.choices[topic].print_help()
    return EXIT_OK


def _abandoned_reply(record: logging.LogRecord) -> bool:
    """pyfuse3 logs an ERROR when the kernel refuses a reply with ENOENT: the kernel
    no longer waits for that request (the mount is going away, or the request was
    interrupted), so nothing was lost. Logged as a warning, not an error."""
    if record.levelno >= logging.ERROR and "failed with No such file or directory" in str(
        record.msg % record.args if record.args else record.msg
    ):
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def _create_images(args: argparse.Namespace) -> list[str]:
    """``--create``: the missing image files, made sparse; returns those it made."""
    created = []
    for path in args.devices:
        if args.create and not os.path.exists(path):
            with open(path, "xb") as f:
                created.append(path)
                f.truncate(args.create)
    return created


def cmd_format(args: argparse.Namespace) -> int:
    from kvfs.devices.pool import format_pool

    created = _create_images(args)
    try:
        sbs = format_pool(
            args.devices,
            unit_size=args.unit_size,
            meta_size=args.meta_size,
            force=args.force,
            label=args.label,
            mean_file_size=args.mean_file_size,
        )
    except BaseException:  # an image we just made and could not format is no use
        for path in created:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    unit = sbs[0].unit_size
    cap = sum(sb.data_units for sb in sbs) * unit
    print(
        f"formatted {len(sbs)} device(s): {cap / 2**30:.2f} GiB of data in "
        f"{unit >> 10} KiB units, {sbs[0].meta_size >> 20} MiB metadata"
    )
    if len({sb.device_size for sb in sbs}) > 1:
        print("devices differ in size; all of each is used:")
        for path, sb in zip(args.devices, sbs, strict=True):
            print(
                f"  device {sb.device_index + 1} {path}: {sb.device_size / 2**30:.2f} GiB, "
                f"{sb.data_units} units = {sb.data_units * unit / 2**30:.2f} GiB of data"
            )
    return EXIT_OK


def _check_mountpoint(path: str) -> None:
    from kvfs.cli import daemon

    stale = daemon.stale_kvfs_mount(path)
    if stale is not None:
        raise UserError(daemon.stale_mount_message(stale))
    if not os.path.isdir(path):
        raise UserError(f"{path}: mountpoint does not exist or is not a directory")
    if os.path.ismount(path):
        raise UserError(f"{path}: something is already mounted there")
    if os.listdir(path):
        raise UserError(f"{path}: mountpoint is not empty")


def _check_order(mountpoint: str, devices: list[str]) -> None:
    """mount(8)'s order (device first) given to ``kvfs mount``: say the right one."""
    import stat

    try:
        first = os.stat(mountpoint).st_mode
    except OSError:
        return
    if not (stat.S_ISBLK(first) or stat.S_ISREG(first)) or len(devices) != 1:
        return
    if os.path.isdir(devices[0]) or not os.path.exists(devices[0]):
        raise UserError(
            f"{mountpoint} is a device or image, not a directory: the order is "
            f"kvfs mount MOUNTPOINT DEVICE... (kvfs mount {devices[0]} {mountpoint})"
        )


def cmd_mount(args: argparse.Namespace) -> int:
    if args.drop_unreadable and not args.degraded:
        raise UserError("--drop-unreadable is an option of --degraded mounts")
    _check_order(args.mountpoint, args.devices)
    args.mountpoint = os.path.realpath(args.mountpoint)  # the daemon chdirs to /
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.cache > ram // 2:
        raise UserError(
            f"--cache {sizes.format_size(args.cache)} is more than half of this machine's "
            f"memory ({sizes.format_size(ram)})"
        )
    if args.cluster:
        from kvfs import cluster

        cluster.parse_url(args.cluster)  # a bad URL is a usage error before anything
        cluster.check_client()
    _check_mountpoint(args.mountpoint)
    if not os.path.exists("/dev/fuse"):
        raise UserError("/dev/fuse is missing: load the fuse module or install fuse3")
    missing = [d for d in args.devices if not os.path.exists(d)]
    if args.create and missing and not args.format:
        raise UserError(f"{missing[0]} does not exist: --create makes an empty image; add --format")
    if args.metrics:  # a taken port is refused before anything is created or formatted
        from kvfs.fuse import metrics

        args.exporter = metrics.bind(args.metrics)
    if not args.foreground:
        _daemon_log_file(args)
    if args.format:
        cmd_format(args)
    if args.foreground:
        return _run_mount(args, lambda: None)
    return _daemonize(args)


def _daemon_log_file(args: argparse.Namespace) -> None:
    """Where a daemon without ``--log-file`` logs: syslog, or where there is none a
    file (``daemon.default_log_file``), which the "mounted" line names."""
    from kvfs.cli import daemon

    args.log_note = ""
    if args.log_file or daemon.syslog_available():
        return
    path = daemon.default_log_file(args.mountpoint)
    try:
        daemon.configure_logging(args.debug, path)
    except OSError as e:
        args.log_note = f"; no syslog ({daemon.SYSLOG} missing) and {path}: {e.strerror}: "
        args.log_note += "its logs are lost (pass --log-file FILE)"
        return
    args.log_file = path
    args.log_note = f"; no syslog ({daemon.SYSLOG} missing): it logs to {path}"


def _daemonize(args: argparse.Namespace) -> int:
    """Fork; the child mounts and reports readiness (or its error) through a pipe."""
    from kvfs.cli import daemon

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        if getattr(args, "exporter", None) is not None:
            args.exporter.close()  # the daemon's now
        with os.fdopen(rfd) as r:
            msg = r.read()
        if msg.startswith("ok"):
            print(f"kvfs: mounted {args.mountpoint} (pid {pid}){args.log_note}")
            return EXIT_OK
        print(msg.removeprefix("usage:").strip() or "kvfs: mount failed", file=sys.stderr)
        return EXIT_USAGE if msg.startswith("usage:") else EXIT_FAIL
    os.close(rfd)
    os.setsid()
    os.umask(0o022)
    daemon.daemon_logging(args.log_file)  # its log lines never reach the terminal
    w = os.fdopen(wfd, "w")

    def ready() -> None:
        w.write("ok\n")
        w.close()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # never hold the caller's pipes: `$(kvfs mount ...)` returns
            os.dup2(devnull, fd)
        os.close(devnull)
        os.chdir("/")
        daemon.detach_logging(args.log_file)  # the log file, or syslog

    try:
        code = _run_mount(args, ready)
    except BaseException as e:
        cause = root_cause(e)
        if isinstance(cause, UserError):
            if not w.closed:
                w.write(f"usage:kvfs: {cause}\n")
                w.close()
            os._exit(cause.exit_code)
        if not w.closed:
            w.write(f"kvfs: mount failed: {describe(cause)}\n")
            w.close()
        else:
            log.error("mount ended: %s", describe(cause))
        os._exit(EXIT_FAIL)
    os._exit(code)


def release_free_heap() -> None:
    """Give the heap that recovery freed back to the kernel (glibc ``malloc_trim``):
    decoding a checkpoint's pieces leaves hundreds of MiB free but mapped at 10^7
    files, which the daemon would otherwise keep as RSS. No-op without glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)


def _run_mount(args: argparse.Namespace, ready: Callable[[], None]) -> int:
    import signal

    import trio

    from kvfs.cli import daemon, progress
    from kvfs.devices.pool import open_pool
    from kvfs.fuse.ops import serve
    from kvfs.store.facade import Store, StoreConfig

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # never unmounts; reopens logs once serving
    pidfile: list[str | None] = []
    from kvfs.fuse import metrics

    exporter = getattr(args, "exporter", None)
    if exporter is None and args.metrics:
        exporter = metrics.bind(args.metrics)  # UserError if taken
    pool = open_pool(args.devices, degraded=args.degraded, heal=True)
    try:
        try:
            config = StoreConfig(
                cache_bytes=args.cache,
                io_timeout=args.io_timeout,
                eviction_policy=args.eviction,
                default_policy=args.default_policy,
                fresh_grace=args.fresh_grace,
                high_watermark=args.high_watermark,
                low_watermark=args.low_watermark,
                discard=not args.no_discard,
                reserve=args.reserve,
                max_file_size=args.max_file_size,
            )
        except ValueError as e:
            raise UserError(str(e)) from None
        store = Store(pool, config)
        if args.cluster:
            from kvfs.cluster import Cluster, parse_url

            store.subscribe(Cluster(store, parse_url(args.cluster)))

        def loading() -> str:  # on the progress thread: plain counters only
            read = sum(d.statistics().bytes_read for d in pool.devices)
            return f"{store.ns.file_count:,} files, {sizes.format_size(read)} of metadata read"

        with progress.Ticker("kvfs: loading the index", loading):
            report = store.load(drop_unreadable=args.drop_unreadable)
        release_free_heap()
        log.info(
            "pool loaded: %d files, %d dirs in %.2f s (dropped %d incomplete)",
            report.files,
            report.directories,
            report.seconds,
            report.dropped_incomplete,
        )
        if pool.missing:
            log.warning(
                "degraded: %d file(s) unreadable, %d dropped (data on a missing member)",
                report.unreadable,
                report.dropped_unreadable,
            )
        label = pool.superblocks[0].label
        fsname = f"kvfs:{label}" if label else os.path.abspath(args.devices[0])
        options = {f"fsname={fsname.replace(',', '_')}", "subtype=kvfs"}
        options |= {"default_permissions", "noatime", *args.fuse_option}
        if args.allow_other:
            options.add("allow_other")

        def up() -> None:  # the pidfile first: `kvfs umount` may follow at once
            pidfile.append(daemon.write_pidfile(args.mountpoint))
            ready()
            daemon.notify(f"READY=1\nMAINPID={os.getpid()}")

        trio.run(serve, store, args.mountpoint, options, up, exporter)
    finally:
        if exporter is not None:
            exporter.close()
        daemon.remove_pidfile(pidfile[0] if pidfile else None)
        pool.close()
    return EXIT_OK


def cmd_umount(args: argparse.Namespace) -> int:
    from kvfs.cli import daemon
    from kvfs.common import procs

    path = os.path.realpath(args.mountpoint)
    mount = daemon.mount_at(path)
    if mount is None:
        raise UserError(f"{path} is not mounted")
    if mount.fstype != KVFS_FSTYPE:
        raise UserError(f"{path} is a {mount.fstype} mount, not kvfs; refusing to unmount it")
    pid = daemon.daemon_pid(mount)  # its pidfile, keyed by the FUSE connection
    stuck = daemon.killed_daemon(mount)
    if stuck is not None and daemon.abort_connection(mount):
        # killed while a thread of it waited in the kernel: it can neither answer nor
        # exit, and every request to the mount (the statfs below too) would wait
        print(
            f"kvfs: {path}: its daemon (pid {stuck}) was killed but could not exit; "
            "aborted its FUSE connection (waiting callers get ECONNABORTED)"
        )
        pid = stuck
    pids = [] if pid is None else [pid]
    dead = daemon.daemon_gone(path)  # only the kernel's mount is left
    if pid is None and not dead:  # a daemon of a release before pidfiles, or one exiting
        log.warning("%s: no pidfile for its daemon; not waiting for it to exit", path)
    # who keeps it: read before a lazy unmount hides their paths, after a failed one
    users = procs.users_of(path) if args.lazy and not dead else []
    cmd = ["fusermount3", "-u", *(["-z"] if dead or args.lazy else []), path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        users = users or ([] if dead else procs.users_of(path))
        if users:
            raise UserError(
                f"{path} is busy: used by {_listed(users)}; end them, or detach it now "
                f"with `kvfs umount --lazy {path}` (its daemon then ends when they let go)",
                EXIT_FAIL,
            )
        raise UserError(f"unmount failed: {r.stderr.strip()}", EXIT_FAIL)
    if args.lazy and users:
        end = f"its daemon (pid {pid})" if pid is not None else "its daemon"
        print(f"kvfs: {path} detached; {end} ends once these let go of it: {_listed(users)}")
        return EXIT_OK
    deadline = time.monotonic() + args.timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    if any(_alive(p) for p in pids):
        raise UserError("kvfs daemon still running after unmount", EXIT_FAIL)
    if dead:
        print(f"kvfs: {path}: the daemon had died; its mount is cleaned up")
    return EXIT_OK


KVFS_FSTYPE = "fuse.kvfs"


def _listed(users: list[tuple[int, str]], most: int = 5) -> str:
    """``pid 123 (python3), pid 456 (bash)``, at most ``most`` of them."""
    text = ", ".join(f"pid {pid} ({name})" for pid, name in users[:most])
    return text + (f" and {len(users) - most} more" if len(users) > most else "")


def _alive(pid: int) -> bool:
    """Still running: not exited, or exited but with threads of it still ending (a
    zombie leader whose last thread is still tearing the memory down, which a parent's
    wait does not report yet)."""
    from kvfs.cli import daemon

    seen = daemon.process_state(pid)
    return seen is not None and (seen[0] not in ("Z", "X") or seen[1] > 1)


def cmd_stats(args: argparse.Namespace) -> int:
    from kvfs.cli import statsview

    return statsview.run(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from kvfs.cli import plan

    return plan.run(args)


def cmd_fsck(args: argparse.Namespace) -> int:
    """Exit codes as e2fsck: 0 clean, 1 corrected, 4 uncorrected, 8 operational error."""
    from kvfs.cli.fsck import fsck

    return fsck(args.devices, repair=args.repair, check_data=not args.no_data)


def cmd_upgrade(args: argparse.Namespace) -> int:
    """Exit codes: 0 upgraded (or already current), 1 refused (why on one line), 2 bad
    input (not one pool, a device missing or unreadable)."""
    from kvfs.cli.fsck import upgrade

    for line in upgrade(args.devices):
        print(f"kvfs: {line}")
    return EXIT_OK


_WHERE = "policy and quota apply to top-level directories of the mount"


def _check_policy_target(args: argparse.Namespace, mountpoint: str) -> None:
    """UserError (nothing changed) unless ``args.directory`` is where its settings
    take effect: a top-level directory of the mount, or the root for its policy
    alone (a quota or size limit there would hold only for the root's own files).
    The daemon refuses the same xattrs elsewhere (EINVAL), for ``setfattr`` too."""
    d = args.directory
    real = os.path.realpath(d)
    if real == os.path.realpath(mountpoint):
        given = [f"--{n}" for n in ("quota", "max_file_size") if getattr(args, n) is not None]
        if given:
            raise UserError(
                f"{d} is the mount root: {' and '.join(g.replace('_', '-') for g in given)} "
                "apply to top-level directories (the pool's size bounds the mount, "
                "`kvfs mount --max-file-size` sets a mount-wide limit); nothing changed"
            )
        return
    if os.path.dirname(real) != os.path.realpath(mountpoint) or not os.path.isdir(real):
        what = "a nested directory" if os.path.isdir(real) else "not a directory"
        raise UserError(
            f"{d} is not a top-level directory of the mount {mountpoint} ({what}): "
            f"{_WHERE}; nothing changed"
        )


def cmd_policy(args: argparse.Namespace) -> int:
    """Policy, quota and maximum file size are the xattrs user.kvfs.policy,
    user.kvfs.quota and user.kvfs.max_file_size of a top-level directory."""
    from kvfs.cli import daemon

    d = args.directory
    mount = daemon.mount_containing(d)
    if mount is None or mount.fstype != KVFS_FSTYPE:
        where = f"a {mount.fstype} mount" if mount else "no mount"
        raise UserError(f"{d} is not inside a kvfs mount (it is on {where}); nothing changed")
    _check_policy_target(args, mount.point)
    try:
        if args.set:
            os.setxattr(d, "user.kvfs.policy", args.set.encode())
        for name, value in (("quota", args.quota), ("max_file_size", args.max_file_size)):
            if value is None:
                continue
            try:
                nbytes = sizes.parse_size(value)
            except sizes.SizeError as e:
                raise UserError(f"--{name.replace('_', '-')}: {e}; nothing changed") from None
            if nbytes == 0:
                with contextlib.suppress(OSError):
                    os.removexattr(d, f"user.kvfs.{name}")
            else:
                os.setxattr(d, f"user.kvfs.{name}", value.strip().encode())
        values = {}
        for name in ("policy", "quota", "max_file_size"):
            try:
                values[name] = os.getxattr(d, f"user.kvfs.{name}").decode()
            except OSError:
                values[name] = "(default)"
                continue
            if name != "policy":
                with contextlib.suppress(sizes.SizeError):
                    values[name] += f" ({sizes.format_size(sizes.parse_size(values[name]))})"
    except OSError as e:
        if e.errno == errno.EINVAL:  # values are checked above: the daemon refused the place
            raise UserError(f"{d}: {e.strerror}: {_WHERE}; nothing changed") from None
        raise UserError(f"{d}: {e.strerror}") from None
    print(
        f"{d}: policy {values['policy']}, quota {values['quota']}, "
        f"max file size {values['max_file_size']}"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
