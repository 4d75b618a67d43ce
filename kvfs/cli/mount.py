"""``kvfs mount MOUNTPOINT DEV...``: check what can be checked before anything is made
(the mountpoint, the metrics port, the cache against the machine's memory, a cluster
URL), optionally format, then serve the pool: in the foreground, or in a daemon that
reports its readiness (or its error, on one line) to the caller through a pipe.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from functools import partial

from kvfs.cli import mkfs
from kvfs.cli.args import DEVICES_HELP, parse_fraction, parse_seconds, parse_size
from kvfs.cli.outcome import EXIT_FAIL, EXIT_OK, EXIT_USAGE, describe, root_cause
from kvfs.common import sizes
from kvfs.common.errors import UserError
from kvfs.common.heap import release_free_heap
from kvfs.evict.policy import DEFAULT_POLICY, POLICY_NAMES

log = logging.getLogger("kvfs")

HELP = "mount a pool"


def add_arguments(m: argparse.ArgumentParser) -> None:
    m.add_argument("mountpoint", help="an empty directory to mount the pool on")
    m.add_argument("devices", nargs="+", metavar="DEVICE", help=DEVICES_HELP)
    m.add_argument("--format", action="store_true", help="format the devices first")
    mkfs.format_options(m)
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
        default=None,
        help="start evicting above this used fraction (default: keep free twice what "
        "writers have in flight, at most 3%% of the pool or 1 GiB a device)",
    )
    m.add_argument(
        "--low-watermark",
        type=parse_fraction,
        default=None,
        help="evict down to this used fraction (default: as far under the high one; "
        "deeper batches cost hit rate, see docs/eviction.md)",
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
        "--aware-threads",
        type=int,
        default=0,
        metavar="N",
        help="I/O threads serving the aware ring (default: 8 per member, 64 at most)",
    )
    m.add_argument(
        "--no-aware-ring",
        action="store_true",
        help="do not serve the aware ring (kvfs.direct then uses FUSE for users "
        "who cannot open the devices)",
    )
    m.add_argument(
        "--drop-unreadable",
        action="store_true",
        help="with --degraded: drop the files with data on a missing member instead "
        "(for good: they stay gone when the member returns)",
    )


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


def run(args: argparse.Namespace) -> int:
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
        mkfs.run(args)
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


def _run_mount(args: argparse.Namespace, ready: Callable[[], None]) -> int:
    import signal

    import trio

    from kvfs.cli import daemon, progress
    from kvfs.devices.pool import open_pool
    from kvfs.fuse.session import serve
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

        ring = None if getattr(args, "no_aware_ring", False) else daemon.ring_path()
        threads = getattr(args, "aware_threads", 0) or min(64, 8 * len(pool.devices))
        if not 0 < threads <= 1024:
            raise UserError(f"--aware-threads {threads}: give 1 to 1024 threads")
        trio.run(
            partial(
                serve,
                reopen_logs=daemon.reopen_logs,
                stopping=lambda: daemon.notify("STOPPING=1"),
                ring_path=ring,
                ring_threads=threads,
            ),
            store,
            args.mountpoint,
            options,
            up,
            exporter,
        )
    finally:
        if exporter is not None:
            exporter.close()
        daemon.remove_pidfile(pidfile[0] if pidfile else None)
        pool.close()
    return EXIT_OK


__all__ = ["HELP", "add_arguments", "release_free_heap", "run"]
