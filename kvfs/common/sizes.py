"""Byte sizes, written and read the same way everywhere: command-line options, the
quota and maximum-file-size xattrs, ``kvfs plan``, and what kvfs prints.

Grammar (case does not matter, spaces between number and unit allowed)::

    size   := number [unit]
    number := digits ["." digits]          (no sign, no exponent, no inf/nan)
    unit   := "B"
            | "K" | "KiB" | "M" | "MiB" | "G" | "GiB" | "T" | "TiB" | "P" | "PiB"   (1024^n)
            | "KB" | "MB" | "GB" | "TB" | "PB"                                      (1000^n)

so ``4096``, ``1M`` = ``1MiB`` = 1048576, ``1MB`` = 1000000, ``1.5G`` = 1610612736.
A single letter is binary, as in ``truncate -s``, ``dd`` and ``fallocate -l``; the SI
spelling ``MB`` means powers of ten, as in those tools. A value must come out as a
whole number of bytes (``1.3K`` is refused) below 2^63.

Durations (``--io-timeout``, ``kvfs umount --timeout``, ``kvfs stats --interval``)
are plain seconds: a finite decimal number >= 0 (``30``, ``0.5``), no unit.
"""

from __future__ import annotations

import math
import re

__all__ = ["MAX_BYTES", "DurationError", "SizeError", "format_size", "parse_seconds", "parse_size"]

MAX_BYTES = (1 << 63) - 1

_IEC = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_UNITS: dict[str, int] = {
    **_IEC,
    **{f"{k}IB": v for k, v in _IEC.items() if k not in ("", "B")},
    **{f"{k}B": 1000 ** (i + 1) for i, k in enumerate("KMGTP")},
}
_SIZE = re.compile(r"\s*(\d+)(?:\.(\d+))?\s*([A-Za-z]*)\s*")


class SizeError(ValueError):
    """Not a size in the grammar above; the message says why, on one line."""


def parse_size(text: str) -> int:
    """``text`` as bytes (see the module's grammar); :class:`SizeError` otherwise."""
    m = _SIZE.fullmatch(text)
    if m is None:
        if text.strip().startswith("-"):
            raise SizeError(f"{text!r}: a size cannot be negative")
        raise SizeError(f"{text!r} is not a size (e.g. 4096, 512K, 1M, 1.5G, 4T; 1MB = 10^6)")
    whole, frac, unit = m.groups()
    mult = _UNITS.get(unit.upper())
    if mult is None:
        raise SizeError(
            f"{text!r}: unknown unit {unit!r} (B, K/KiB, M/MiB, G/GiB, T/TiB, P/PiB, KB..PB)"
        )
    frac = frac or ""
    scaled = int(whole + frac) * mult
    value, rest = divmod(scaled, int(10 ** len(frac)))
    if rest:
        raise SizeError(f"{text!r} is not a whole number of bytes")
    if value > MAX_BYTES:
        raise SizeError(f"{text!r} is too large (the most is 8 EiB)")
    return value


class DurationError(ValueError):
    """Not a number of seconds; the message says why, on one line."""


def parse_seconds(text: str) -> float:
    """A duration in seconds: a finite number >= 0 (``30``, ``0.5``);
    :class:`DurationError` otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise DurationError(f"{text!r} is not a number of seconds (e.g. 30, 0.5)")
    return value


def format_size(n: float) -> str:
    """Bytes for a person: ``512 B``, ``1.5 KiB``, ``3.00 GiB``, ``245 TiB`` (binary
    units, three significant digits)."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        n /= 1024
        if n < 1024 or unit == "EiB":
            break
    digits = 2 if n < 10 else 1 if n < 100 else 0
    return f"{n:.{digits}f} {unit}"
