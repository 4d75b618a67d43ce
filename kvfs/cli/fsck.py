"""``kvfs fsck DEV...``: check (and ``--repair``) an unmounted pool. The check itself
is :func:`kvfs.cli.offline.fsck`."""

from __future__ import annotations

import argparse

from kvfs.cli.args import DEVICES_HELP

HELP = "check (and --repair) an unmounted pool"


def add_arguments(ck: argparse.ArgumentParser) -> None:
    ck.add_argument("devices", nargs="+", metavar="DEVICE", help=DEVICES_HELP)
    ck.add_argument("--repair", action="store_true", help="drop what cannot be trusted")
    ck.add_argument("--no-data", action="store_true", help="skip reading every data unit")


def run(args: argparse.Namespace) -> int:
    """Exit codes as e2fsck: 0 clean, 1 corrected, 4 uncorrected, 8 operational error."""
    from kvfs.cli.offline import fsck

    return fsck(args.devices, repair=args.repair, check_data=not args.no_data)


__all__ = ["HELP", "add_arguments", "run"]
