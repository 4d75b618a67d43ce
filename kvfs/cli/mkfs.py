"""``kvfs format DEV...``: an empty pool on devices or image files (``--create``
makes missing images, sparse); also what ``kvfs mount --format`` runs first."""

from __future__ import annotations

import argparse
import contextlib
import os

from kvfs.cli.args import DEVICES_HELP, parse_image_size, parse_size
from kvfs.cli.outcome import EXIT_OK

HELP = "create an empty pool on devices (destroys data)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("devices", nargs="+", metavar="DEVICE", help=DEVICES_HELP)
    format_options(p)


def format_options(p: argparse.ArgumentParser) -> None:
    """The options of a new pool (``kvfs format`` and ``kvfs mount --format``)."""
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


def _create_images(args: argparse.Namespace) -> list[str]:
    """``--create``: the missing image files, made sparse; returns those it made."""
    created = []
    for path in args.devices:
        if args.create and not os.path.exists(path):
            with open(path, "xb") as f:
                created.append(path)
                f.truncate(args.create)
    return created


def run(args: argparse.Namespace) -> int:
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


__all__ = ["HELP", "add_arguments", "format_options", "run"]
