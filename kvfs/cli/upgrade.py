"""``kvfs upgrade DEV...``: give an unmounted format-version-1 pool backup superblocks,
in place, keeping every file. The upgrade itself is :func:`kvfs.cli.offline.upgrade`."""

from __future__ import annotations

import argparse

from kvfs.cli.outcome import EXIT_OK

HELP = "give an unmounted format-version-1 pool backup superblocks, in place"


def add_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument("devices", nargs="+", metavar="DEVICE", help="every device of the pool")


def run(args: argparse.Namespace) -> int:
    """Exit codes: 0 upgraded (or already current), 1 refused (why on one line), 2 bad
    input (not one pool, a device missing or unreadable)."""
    from kvfs.cli.offline import upgrade

    for line in upgrade(args.devices):
        print(f"kvfs: {line}")
    return EXIT_OK


__all__ = ["HELP", "add_arguments", "run"]
