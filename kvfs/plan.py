"""``kvfs plan``: what a pool holds for a model (being written)."""

from __future__ import annotations

import argparse

from kvfs.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)


def run(args: argparse.Namespace) -> int:
    raise UserError("kvfs plan is not written yet")
