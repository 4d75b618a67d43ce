"""``mount -t fuse.kvfs`` and ``/etc/fstab``: mount.fuse3 runs
``kvfs SOURCE MOUNTPOINT -o OPT,OPT=VALUE``; this turns that into
``kvfs mount MOUNTPOINT DEV... --opt --opt VALUE``.

SOURCE is the pool's devices separated by ``:`` (``/dev/nvme0n1:/dev/nvme1n1``).
Every option of ``kvfs mount`` has an ``-o`` name, taken from the mount subcommand's
parser (so a new option maps by itself): ``--io-timeout 30`` is ``io_timeout=30`` or
``io-timeout=30``, a flag is its bare name (``foreground``, ``allow_other``,
``degraded``). The format-only options (``format``, ``force``, ``unit_size``,
``meta_size``, ``mean_file_size``, ``label``) have none: an fstab line must never
format. ``debug`` is the global ``--debug``. The generic options mount(8),
mount.fuse3 and fstab use are accepted: ``nosuid``, ``nodev``, ``noexec`` and
``dirsync`` are applied to the FUSE mount, the others (``rw``, ``defaults``,
``auto``, ``noauto``, ``user``, ``nofail``, ``_netdev``, ``x-*``, ``atime`` and
friends, ...) are ignored; ``ro`` is refused (a cache must evict); anything else
is a one-line error.
"""

from __future__ import annotations

import argparse

from kvfs.common.errors import UserError

SEPARATOR = ":"
NO_O_NAME = {"format", "force", "unit_size", "meta_size", "mean_file_size", "label", "help"}
APPLIED = {"nosuid", "nodev", "noexec", "dirsync"}
"""Mount flags passed on to the FUSE mount (``--fuse-option``)."""
IGNORED = {
    "rw",
    "defaults",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "owner",
    "group",
    "nofail",
    "_netdev",
    "suid",
    "dev",
    "exec",
    "async",
    "atime",
    "noatime",
    "relatime",
    "norelatime",
    "strictatime",
    "nostrictatime",
    "diratime",
    "nodiratime",
    "lazytime",
    "nolazytime",
    "iversion",
    "noiversion",
    "mand",
    "nomand",
    "silent",
    "loud",
}
IGNORED_PREFIXES = ("x-", "comment=", "context=", "fscontext=", "defcontext=", "rootcontext=")


def is_helper_call(argv: list[str], commands: set[str]) -> bool:
    """``kvfs SOURCE MOUNTPOINT [-o OPTS]``: the first word is not a subcommand."""
    return bool(argv) and not argv[0].startswith("-") and argv[0] not in commands


def translate(argv: list[str], mount_parser: argparse.ArgumentParser) -> list[str]:
    """``SOURCE MOUNTPOINT [-o OPTS]...`` -> the argv of ``kvfs [--debug] mount ...``."""
    words, opts = [], []
    it = iter(argv)
    for a in it:
        if a == "-o":
            value = next(it, None)
            if value is None:
                raise UserError("-o needs a list of options")
            opts.append(value)
        elif a.startswith("-o") and len(a) > 2:
            opts.append(a[2:])
        elif a in ("-n", "-s", "-v", "-f"):  # mount(8)'s own flags, passed by some callers
            continue
        else:
            words.append(a)
    if len(words) != 2:
        raise UserError(
            "usage: kvfs DEV[:DEV...] MOUNTPOINT [-o OPT,...] (as mount -t fuse.kvfs runs "
            "it), or kvfs COMMAND ...: see kvfs --help"
        )
    source, mountpoint = words
    devices = [d for d in source.split(SEPARATOR) if d]
    if not devices:
        raise UserError(f"no devices in {source!r} (separate them with {SEPARATOR!r})")
    names = option_names(mount_parser)
    front, args, fuse = [], [], []
    for group in opts:
        for opt in split_options(group):
            key, eq, value = opt.partition("=")
            norm = key.replace("-", "_")
            if norm == "ro":
                raise UserError(
                    "-o ro: kvfs has no read-only mode (it evicts by itself); mount it rw"
                )
            if norm in APPLIED and not eq:
                fuse += ["--fuse-option", norm]
            elif opt in IGNORED or norm in IGNORED or opt.startswith(IGNORED_PREFIXES):
                continue
            elif norm == "debug" and not eq:
                front.append("--debug")
            elif norm in names:
                flag, takes_value = names[norm]
                if takes_value and not eq:
                    raise UserError(f"-o {key} needs a value: {key}=VALUE")
                if not takes_value and eq:
                    raise UserError(f"-o {key} is a flag: write {key}, without a value")
                args += [flag, value] if takes_value else [flag]
            else:
                raise UserError(f"unknown mount option -o {opt} (see kvfs mount --help)")
    return [*front, "mount", mountpoint, *devices, *args, *fuse]


def split_options(group: str) -> list[str]:
    """``a,b=c,d`` -> ``[a, b=c, d]``; a backslash escapes a comma."""
    out, cur, it = [], "", iter(group)
    for ch in it:
        if ch == "\\":
            cur += next(it, "")
        elif ch == ",":
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [o for o in out if o]


def option_names(mount_parser: argparse.ArgumentParser) -> dict[str, tuple[str, bool]]:
    """``-o`` name (underscores) -> (the long option, whether it takes a value)."""
    names: dict[str, tuple[str, bool]] = {}
    for action in mount_parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.help == argparse.SUPPRESS:
            continue
        name = longs[0][2:].replace("-", "_")
        if name in NO_O_NAME or action.dest in NO_O_NAME:
            continue
        names[name] = (longs[0], action.nargs != 0)
    return names
