"""The ``kvfs`` command: format, mount, umount, stats, plan, policy, fsck, upgrade, help.

This module assembles the parser from the commands' modules (each has ``HELP``,
``add_arguments`` and ``run``: :mod:`~kvfs.cli.mkfs` for ``format``,
:mod:`~kvfs.cli.mount`, :mod:`~kvfs.cli.umount`, :mod:`~kvfs.cli.stats`,
:mod:`~kvfs.cli.plan`, :mod:`~kvfs.cli.policy`, :mod:`~kvfs.cli.fsck`,
:mod:`~kvfs.cli.upgrade`) and dispatches; none of them imports it. A command module
imports only light modules at first: what a command needs to run (the store, pyfuse3,
the offline checker) it imports when it runs, so every command starts quickly.

Exit codes (:mod:`kvfs.cli.outcome`): 0 success; 1 the operation failed (device
error, mount failed); 2 bad usage or input the user can fix (message on one line, no
traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvfs.cli import (
    daemon,
    fsck,
    mkfs,
    mount,
    mounthelper,
    plan,
    policy,
    stats,
    umount,
    upgrade,
)
from kvfs.cli.args import Parser, name_values
from kvfs.cli.outcome import EXIT_OK, EXIT_USAGE, run_command
from kvfs.common.errors import UserError

COMMANDS: dict[str, ModuleType] = {
    "format": mkfs,
    "mount": mount,
    "fsck": fsck,
    "upgrade": upgrade,
    "policy": policy,
    "umount": umount,
}
"""The commands ``kvfs --help`` lists before ``help``, in its order."""
MORE_COMMANDS: dict[str, ModuleType] = {"stats": stats, "plan": plan}
"""The commands it lists after ``help``."""


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="kvfs",
        description="KV-cache filesystem on raw NVMe. Sizes are bytes or take a unit: "
        "K/M/G/T/P (also KiB..PiB) are powers of 1024, KB/MB/GB/TB/PB powers of 1000.",
        epilog="kvfs help COMMAND shows a command's options. docs/operations.md: the guide.",
    )
    p.add_argument("--debug", action="store_true", help="verbose logging")
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    common = Parser(add_help=False)
    common.add_argument(  # after the command too: `kvfs mount --debug ...`
        "--debug", action="store_true", default=argparse.SUPPRESS, help="verbose logging"
    )

    def add(name: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kw)

    for name, command in COMMANDS.items():
        command.add_arguments(add(name, help=command.HELP))
    h = add("help", help="a command's options in full: kvfs help mount")
    h.add_argument("topic", nargs="?", metavar="COMMAND", help="a command (none: all commands)")
    for name, command in MORE_COMMANDS.items():
        command.add_arguments(add(name, help=command.HELP))
    for parser_ in sub.choices.values():  # one metavar per kind of value
        name_values(parser_)
    return p


def version_line() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from kvfs.format.superblock import FORMAT_VERSION

    try:
        release = version("kvfs")
    except PackageNotFoundError:  # run from a checkout without installing
        release = "unknown"
    return f"kvfs {release} (on-device format {FORMAT_VERSION})"


def main(argv: list[str] | None = None) -> int:
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
        name: command.run for name, command in {**COMMANDS, **MORE_COMMANDS}.items()
    }
    code = run_command(commands[args.command], args)
    if getattr(args, "cluster", None):
        _exit_past_the_cluster_client(code)
    return code


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


__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
