"""What every command's arguments share: the parser class (a usage error on one
line), the types of option values (sizes in the grammar of :mod:`kvfs.common.sizes`,
seconds, fractions) with one metavar per kind, and the help of a device list."""

from __future__ import annotations

import argparse
import math
from typing import NoReturn

from kvfs.cli.outcome import EXIT_USAGE
from kvfs.common import sizes

DEVICES_HELP = (
    "block devices (e.g. /dev/nvme0n1) or image files, in the pool's order; a pool's "
    "members may be named in any order when mounting"
)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line that says where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see: {self.prog} --help)\n")


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
    """A duration in seconds (:func:`kvfs.common.sizes.parse_seconds`), for argparse."""
    try:
        return sizes.parse_seconds(text)
    except sizes.DurationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_fraction(text: str) -> float:
    """A share of the pool: a number in [0, 1] (``0.97``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction between 0 and 1")
    return value


METAVARS = {
    parse_size: "SIZE",
    parse_image_size: "SIZE",
    parse_seconds: "SECONDS",
    parse_fraction: "FRACTION",
}
"""One metavar per kind of value, for the options that name none themselves."""


def name_values(parser: argparse.ArgumentParser) -> None:
    """Give each option of ``parser`` typed above its kind's metavar (``SIZE``...)."""
    for action in parser._actions:
        if action.metavar is None and action.type in METAVARS:
            action.metavar = METAVARS[action.type]


__all__ = [
    "DEVICES_HELP",
    "Parser",
    "name_values",
    "parse_fraction",
    "parse_image_size",
    "parse_seconds",
    "parse_size",
]
