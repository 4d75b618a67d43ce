"""The command line for a person: the size grammar, one-line errors, --version,
help for every option, ``kvfs help CMD``, ``--debug`` after the command, and no
traceback when a pipe's reader leaves."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvfs import cli
from kvfs.cli import outcome
from kvfs.common import sizes
from kvfs.common.errors import InvalidArgument, UserError
from kvfs.evict.groups import parse_quota

KVFS = [sys.executable, "-m", "kvfs"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("0", 0),
        ("1K", 1024),
        ("1k", 1024),
        ("1KiB", 1024),
        ("1KB", 1000),
        ("1M", 1 << 20),
        ("1MiB", 1 << 20),
        ("1MB", 10**6),
        ("1.5G", 3 << 29),
        ("4T", 4 << 40),
        ("4TB", 4 * 10**12),
        ("2P", 2 << 50),
        (" 8 G ", 8 << 30),
        ("512B", 512),
        ("0.5K", 512),
    ],
)
def test_size_grammar(text: str, expected: int) -> None:
    assert sizes.parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("inf", "not a size"),
        ("nan", "not a size"),
        ("1e30", "not a size"),
        ("-5G", "negative"),
        ("abc", "not a size"),
        ("", "not a size"),
        ("1.3K", "whole number"),
        ("1X", "unknown unit"),
        ("9E", "unknown unit"),
        ("8192P", "too large"),
        ("0x10", "not a size"),
    ],
)
def test_size_refusals(text: str, why: str) -> None:
    with pytest.raises(sizes.SizeError, match=why) as e:
        sizes.parse_size(text)
    assert "\n" not in str(e.value)


def test_format_size() -> None:
    assert sizes.format_size(0) == "0 B"
    assert sizes.format_size(1023) == "1023 B"
    assert sizes.format_size(1536) == "1.50 KiB"
    assert sizes.format_size(200 << 20) == "200 MiB"
    assert sizes.format_size(245 * 10**12) == "223 TiB"


def test_quota_xattrs_use_the_same_grammar() -> None:
    assert parse_quota(b"100G") == 100 << 30
    assert parse_quota(b"1MB") == 10**6
    assert parse_quota(b"5368709120") == 5 << 30
    for bad in (b"-5G", b"abc", b"inf", b"1e30"):
        with pytest.raises(InvalidArgument):
            parse_quota(bad)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVFS, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "argv",
    [
        ["format", "--unit-size", "inf", "/nonexistent"],
        ["format", "--unit-size", "1e30", "/nonexistent"],
        ["mount", "--cache", "abc", "/mnt", "/nonexistent"],
        ["mount", "--io-timeout", "nan", "/mnt", "/nonexistent"],
        ["mount", "--high-watermark", "2", "/mnt", "/nonexistent"],
        ["umount", "--timeout", "-1", "/mnt"],
        ["mount", "/mnt"],
        ["nosuchcommand"],
    ],
)
def test_bad_arguments_are_one_line(argv: list[str]) -> None:
    r = run(*argv)
    assert r.returncode == 2, r
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("kvfs"), lines
    assert "Traceback" not in r.stderr


def test_cache_larger_than_memory_is_refused(tmp_path: str) -> None:
    r = run("mount", "--cache", "1P", str(tmp_path), "/nonexistent")
    assert r.returncode == 2
    assert "memory" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_version() -> None:
    r = run("--version")
    assert r.returncode == 0
    assert r.stdout.startswith("kvfs 0.") and "on-device format" in r.stdout


def test_every_option_has_help() -> None:
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.help == argparse.SUPPRESS:
                continue
            label = "/".join(action.option_strings) or action.dest
            assert action.help, f"kvfs {name} {label} has no help"
        assert sub._choices_actions, name
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert all(helps.values()), helps


def test_help_command() -> None:
    r = run("help", "mount")
    assert r.returncode == 0
    assert "--metrics" in r.stdout and "SECONDS" in r.stdout
    r = run("help", "nope")
    assert r.returncode == 2 and "commands:" in r.stderr


def test_debug_after_the_command() -> None:
    args = cli._parser().parse_args(["umount", "--debug", "/mnt"])
    assert args.debug is True
    args = cli._parser().parse_args(["--debug", "umount", "/mnt"])
    assert args.debug is True
    args = cli._parser().parse_args(["umount", "/mnt"])
    assert args.debug is False


def test_root_cause_unwraps_nursery_errors() -> None:
    inner = UserError("the pool is busy")
    group = BaseExceptionGroup("nursery", [ExceptionGroup("inner", [ValueError("x"), inner])])
    assert outcome.root_cause(group) is inner
    assert outcome.describe(ExceptionGroup("g", [FileNotFoundError(2, "No such file", "/x")])) == (
        "/x: No such file"
    )


def test_no_traceback_when_the_pipe_closes() -> None:
    """`kvfs help mount | head -1`: the reader leaves after one line."""
    cmd = f"{sys.executable} -m kvfs help mount | head -1"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith("usage: kvfs mount")
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_progress_draws_only_on_a_terminal() -> None:
    """fsck and a mount's index load show progress on a terminal, never in a pipe."""
    import io
    import os
    import select
    import time

    from kvfs.cli import progress

    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            with progress.Progress("fsck: reading data", 10, "files", stream=tty) as p:
                for _ in range(10):
                    p.advance()
                    time.sleep(progress.INTERVAL / 3)
            with progress.Ticker("kvfs: loading", lambda: "42 files", delay=0, stream=tty):
                time.sleep(progress.INTERVAL * 3)
        shown = ""
        while select.select([master], [], [], 0.5)[0]:  # all of it, however it is split
            shown += os.read(master, 65536).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert "fsck: reading data:" in shown and "of 10 files" in shown and "%" in shown
    assert "kvfs: loading: 42 files" in shown
    assert shown.endswith("\r")  # the line is erased at the end
    pipe = io.StringIO()
    with progress.Progress("fsck", 10, "files", stream=pipe) as p:
        for _ in range(10):
            p.advance()
            time.sleep(progress.INTERVAL / 3)
    assert pipe.getvalue() == ""


def test_log_lines_are_rate_limited() -> None:
    """A flood of one message (a failing device's checksum errors) keeps `burst`
    lines per window; the next line says how many were held back."""
    import io
    import logging
    import time

    from kvfs.cli.daemon import RateLimit

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RateLimit(burst=5, interval=0.2))
    logger = logging.getLogger("kvfs.test-ratelimit")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for i in range(100):
            logger.error("checksum mismatch: inode %d", i)
        logger.warning("another message")
        time.sleep(0.25)
        logger.error("checksum mismatch: inode %d", 100)
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[:5] == [f"checksum mismatch: inode {i}" for i in range(5)]
    assert lines[5] == "another message"
    assert lines[6] == "checksum mismatch: inode 100 [95 more like this in the last 0.2 s]"
    assert len(lines) == 7


# ---------------------------------------------------------------------- what a new user hits
def one_line_error(r: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert r.returncode == code, r
    assert r.stdout == "" and "Traceback" not in r.stderr, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_mount8_order_is_answered_with_the_right_one(tmp_path: Path) -> None:
    img = tmp_path / "pool.img"
    img.write_bytes(b"")
    mnt = tmp_path / "mnt"
    for exists in (False, True):  # the mountpoint (second here) missing, then there
        if exists:
            mnt.mkdir()
        line = one_line_error(run("mount", str(img), str(mnt)))
        assert "kvfs mount MOUNTPOINT DEVICE" in line, line
        assert f"kvfs mount {mnt} {img}" in line, line


def test_create_needs_a_size_above_zero(tmp_path: Path) -> None:
    mnt, img = tmp_path / "mnt", tmp_path / "pool.img"
    mnt.mkdir()
    line = one_line_error(run("mount", "--format", "--create", "0", str(mnt), str(img)))
    assert "--create" in line and "above 0" in line, line
    assert not img.exists()


def test_create_without_format_is_refused_before_creating(tmp_path: Path) -> None:
    mnt, img = tmp_path / "mnt", tmp_path / "pool.img"
    mnt.mkdir()
    line = one_line_error(run("mount", "--create", "64M", str(mnt), str(img)))
    assert "--format" in line, line
    assert not img.exists()


def test_a_failed_create_leaves_no_image_and_a_retry_works(tmp_path: Path) -> None:
    img = tmp_path / "pool.img"
    line = one_line_error(run("format", "--create", "10M", str(img)))
    assert "too small" in line, line
    assert not img.exists(), "the image kvfs made for a format that failed is left"
    r = run("format", "--create", "256M", str(img))
    assert r.returncode == 0, r.stderr
    assert img.stat().st_size == 256 << 20


def test_an_existing_image_is_kept_when_its_format_fails(tmp_path: Path) -> None:
    img = tmp_path / "mine.img"
    with open(img, "wb") as f:
        f.truncate(10 << 20)
    one_line_error(run("format", "--create", "10G", str(img)))
    assert img.stat().st_size == 10 << 20, "an image kvfs did not make is the user's"


def test_a_busy_metrics_port_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    mnt, img = tmp_path / "mnt", tmp_path / "pool.img"
    mnt.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["mount", "--format", "--create", "256M", "--metrics", f"127.0.0.1:{port}"]
        line = one_line_error(run(*argv, str(mnt), str(img)))
    assert "--metrics" in line and "in use" in line, line
    assert not img.exists(), "an image was created (and formatted) before the refusal"
