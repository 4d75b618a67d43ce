"""One pool, one daemon: a pool is claimed by what its members are, not by their names.

An image file and a loop device over it are the same bytes. Two daemons on one pool
(one through the loop devices, one through the image files) would each replay and
write the metadata log and hand out the same units: the next fsck finds checksum
mismatches and files read EIO. So every name of a live member is refused — by a
second mount, by ``format --force``, by ``fsck`` — and so is one member named twice in
one command. Every test here mounts the real CLI and uses real loop devices (root).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from kvfs.testing import harness
from tests.conftest import loop_unavailable, pattern, require_fuse, write_file

MiB = 1 << 20
IMAGE = 128 * MiB
KVFS = [sys.executable, "-m", "kvfs"]


@pytest.fixture(autouse=True)
def _loops_and_fuse() -> None:
    require_fuse()
    reason = loop_unavailable()
    if reason:
        pytest.skip(reason)


def kvfs(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVFS, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The single ``kvfs: ...`` line of a refused command (which must exit ``code``)."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfs: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def refused_mount(
    mnt: Path, *devices: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``kvfs mount --foreground mnt devices``, which must exit without mounting; if it
    mounts, unmount it and fail (it would otherwise serve until the test ends)."""
    mnt.mkdir(exist_ok=True)
    cmd = [*KVFS, "mount", "--foreground", str(mnt), *devices]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if harness.is_mounted(mnt):
                pytest.fail(f"kvfs mount {' '.join(devices)} mounted a pool that is in use")
            if time.monotonic() > deadline:
                pytest.fail(f"kvfs mount {' '.join(devices)} neither mounted nor exited")
            time.sleep(0.02)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            harness.unmount(mnt)
            proc.kill()
            proc.communicate()
        harness.unmount(mnt)


@contextmanager
def images_and_loops(tmp_path: Path, n: int) -> Iterator[tuple[list[str], list[str]]]:
    """``n`` image files, each attached to a loop device: (images, loop devices)."""
    with ExitStack() as stack:
        images = [str(harness.make_image(tmp_path / f"d{i}.img", IMAGE)) for i in range(n)]
        loops = [stack.enter_context(harness.loop_device(img)) for img in images]
        yield images, loops


def read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def check_clean(devices: list[str]) -> None:
    r = kvfs("fsck", *devices)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 problem(s)" in r.stdout, r.stdout


def test_mount_through_the_images_of_a_pool_mounted_through_loops_is_refused(
    tmp_path: Path,
) -> None:
    mnt = tmp_path / "mnt"
    with images_and_loops(tmp_path, 2) as (images, loops):
        with harness.mounted(mnt, loops, "--format", "--meta-size", "8M") as proc:
            write_file(mnt / "before", pattern("before", 5 * MiB))
            r = refused_mount(tmp_path / "mnt2", *images)
            line = one_line_error(r, 2, images[0], "in use", "kvfs mount", f"pid {proc.pid}")
            assert f"through {loops[0]}" in line, line
            # one image of the two is enough to be refused
            one_line_error(refused_mount(tmp_path / "mnt2", images[1], images[0]), 2, "in use")
            # the first mount keeps working
            write_file(mnt / "after", pattern("after", 5 * MiB))
            assert read(mnt / "before") == pattern("before", 5 * MiB)
            assert read(mnt / "after") == pattern("after", 5 * MiB)
            assert proc.poll() is None
        check_clean(images)
        with harness.mounted(mnt, images):
            assert read(mnt / "after") == pattern("after", 5 * MiB)


def test_mount_through_the_loops_of_a_pool_mounted_through_images_is_refused(
    tmp_path: Path,
) -> None:
    mnt = tmp_path / "mnt"
    images = [str(harness.make_image(tmp_path / f"d{i}.img", IMAGE)) for i in range(2)]
    with harness.mounted(mnt, images, "--format", "--meta-size", "8M") as proc:
        write_file(mnt / "before", pattern("before", 5 * MiB))
        # loop devices attached after the mount started
        with harness.loop_device(images[0]) as l0, harness.loop_device(images[1]) as l1:
            r = refused_mount(tmp_path / "mnt2", l0, l1)
            line = one_line_error(r, 2, l0, f"pid {proc.pid}")
            assert "busy" in line or "in use" in line, line
            write_file(mnt / "after", pattern("after", 3 * MiB))
            assert read(mnt / "before") == pattern("before", 5 * MiB)
    check_clean(images)


def test_mount_of_an_image_whose_loop_device_is_held_is_refused(tmp_path: Path) -> None:
    """A loop device held by some other program (here: this test, O_EXCL, as a mounted
    filesystem holds it) makes its image file busy."""
    img = str(harness.make_image(tmp_path / "d.img", IMAGE))
    assert kvfs("format", img, "--meta-size", "8M").returncode == 0
    with harness.loop_device(img) as loop:
        fd = os.open(loop, os.O_RDONLY | os.O_EXCL)
        try:
            one_line_error(refused_mount(tmp_path / "mnt", img), 2, img, f"through {loop}")
            one_line_error(kvfs("format", "--force", img, "--meta-size", "8M"), 2, img)
        finally:
            os.close(fd)
        # an attached loop device nobody holds is no reason to refuse
        with harness.mounted(tmp_path / "mnt", [img]):
            write_file(tmp_path / "mnt" / "x", pattern("x", MiB))
    check_clean([img])


def test_format_force_of_the_image_behind_a_mounted_loop_is_refused(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    with images_and_loops(tmp_path, 1) as ([img], [loop]):
        with harness.mounted(mnt, [loop], "--format", "--meta-size", "8M") as proc:
            write_file(mnt / "keep", pattern("keep", 6 * MiB))
            os.sync()
            head = read(Path(img))[: 2 * MiB]
            r = kvfs("format", "--force", img, "--meta-size", "8M")
            line = one_line_error(r, 2, img, "in use", f"pid {proc.pid}", f"through {loop}")
            assert "kvfs mount at" in line, line
            assert read(Path(img))[: 2 * MiB] == head, "the superblock was overwritten"
            assert read(mnt / "keep") == pattern("keep", 6 * MiB)
        check_clean([loop])
        with harness.mounted(mnt, [loop]):
            assert read(mnt / "keep") == pattern("keep", 6 * MiB)


def test_format_force_of_the_loop_of_a_mounted_image_is_refused(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    img = str(harness.make_image(tmp_path / "d.img", IMAGE))
    with harness.mounted(mnt, [img], "--format", "--meta-size", "8M") as proc:
        write_file(mnt / "keep", pattern("keep", 6 * MiB))
        with harness.loop_device(img) as loop:
            r = kvfs("format", "--force", loop, "--meta-size", "8M")
            line = one_line_error(r, 2, loop, f"pid {proc.pid}", f"through {img}")
            assert "busy" in line or "in use" in line, line
        assert read(mnt / "keep") == pattern("keep", 6 * MiB)
    check_clean([img])
    with harness.mounted(mnt, [img]):
        assert read(mnt / "keep") == pattern("keep", 6 * MiB)


def test_fsck_of_a_mounted_pool_is_refused_by_any_name(tmp_path: Path) -> None:
    """fsck --repair would rewrite the log under the daemon; a read-only fsck would
    read a log that is being written and report false damage: both are refused."""
    mnt = tmp_path / "mnt"
    with images_and_loops(tmp_path, 2) as (images, loops):
        with harness.mounted(mnt, loops, "--format", "--meta-size", "8M") as proc:
            write_file(mnt / "keep", pattern("keep", 4 * MiB))
            for names in (images, loops, [images[1], loops[0]]):
                for repair in (["--repair"], []):
                    r = kvfs("fsck", *names, *repair)
                    assert r.returncode == 8, (names, repair, r.stdout, r.stderr)
                    assert f"pid {proc.pid}" in r.stdout, r.stdout
                    assert "in use" in r.stdout or "busy" in r.stdout, r.stdout
            assert read(mnt / "keep") == pattern("keep", 4 * MiB)
        check_clean(images)


def test_an_image_and_its_loop_named_together_are_refused(tmp_path: Path) -> None:
    with images_and_loops(tmp_path, 2) as (images, loops):
        assert kvfs("format", *images, "--meta-size", "8M").returncode == 0
        heads = [read(Path(i))[: 2 * MiB] for i in images]
        for names, same in (
            ([images[0], loops[0]], (images[0], loops[0])),
            ([loops[1], images[0], images[1]], (loops[1], images[1])),
        ):
            one_line_error(refused_mount(tmp_path / "mnt", *names), 2, "named twice", *same)
            r = kvfs("format", "--force", *names, "--meta-size", "8M")
            one_line_error(r, 2, "named twice")
            assert kvfs("fsck", *names).returncode == 8
        # a hard link is the same file too
        os.link(images[0], tmp_path / "link.img")
        r = kvfs("format", "--force", images[0], tmp_path / "link.img", "--meta-size", "8M")
        one_line_error(r, 2, "named twice")
        assert [read(Path(i))[: 2 * MiB] for i in images] == heads
        check_clean(loops)


def test_a_loop_over_a_loop_is_the_same_device(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    with images_and_loops(tmp_path, 1) as ([img], [loop]), harness.loop_device(loop) as upper:
        one_line_error(kvfs("format", "--force", img, upper), 2, "named twice", img, upper)
        with harness.mounted(mnt, [upper], "--format", "--meta-size", "8M") as proc:
            write_file(mnt / "keep", pattern("keep", 2 * MiB))
            for name in (img, loop):
                r = kvfs("format", "--force", name, "--meta-size", "8M")
                one_line_error(r, 2, name, f"pid {proc.pid}")
            one_line_error(refused_mount(tmp_path / "mnt2", img), 2, img, f"through {upper}")
        check_clean([img])
