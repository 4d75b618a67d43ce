"""``kvfs mount --metrics``: a real Prometheus scrape of a real mount (the text format
parsed by prometheus_client's own parser), figures that move with the traffic and
agree with ``kvfs stats``, a taken port refused on one line, and ``-o metrics=``
through ``mount -t fuse.kvfs``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfs.testing import harness
from tests.conftest import META_SIZE, KvfsMount, pattern, require_fuse, wait_for

MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, Any]:
    """name -> {labels tuple: value} (histogram samples under their sample names)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = tuple(sorted(s.labels.items()))
            out.setdefault(s.name, {})[key] = s.value
    return out


def one(metrics: dict[str, Any], name: str, **labels: str) -> float:
    return float(metrics[name][tuple(sorted(labels.items()))])


@pytest.fixture
def metrics_mount(tmp_path: Path) -> Any:
    require_fuse()
    port = free_port()
    image = harness.make_image(tmp_path / "pool.img", 256 << 20)
    mount = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", [])
    mount.start(
        "--format", "--meta-size", META_SIZE, "--label", "scraped", "--metrics", f"127.0.0.1:{port}"
    )
    try:
        yield mount, port
    finally:
        mount.close()


def test_scrape_follows_the_traffic(metrics_mount: Any) -> None:
    mount, port = metrics_mount
    before = scrape(port)
    assert one(before, "kvfs_pool_info", **_info(before)) == 1
    assert _info(before)["label"] == "scraped"
    assert one(before, "kvfs_files") == 0

    (mount.path / "lmcache").mkdir()
    (mount.path / "sglang").mkdir()
    data = {f"lmcache/c{i}": pattern(i, 3 * MIB + 5) for i in range(4)}
    data["sglang/k0"] = pattern("k0", MIB)
    for name, blob in data.items():
        harness.write_file(mount.path / name, blob)
    os.setxattr(mount.path / "sglang", "user.kvfs.quota", b"64M")
    for name, blob in data.items():  # bytes first: the figures are only worth right bytes
        assert (mount.path / name).read_bytes() == blob
    assert not (mount.path / "lmcache" / "absent").exists()

    after = scrape(port)
    stats = mount.stats()
    assert one(after, "kvfs_files") == 5 == stats["store"]["files"]
    written = sum(len(b) for b in data.values())
    assert one(after, "kvfs_written_bytes_total") == written
    read = one(after, "kvfs_read_bytes_total", source="memory") + one(
        after, "kvfs_read_bytes_total", source="device"
    )
    assert read >= written  # the kernel may read ahead past what was asked, never less
    assert read <= mount.stats()["store"]["bytes_read"]  # kernel readahead may still run
    assert one(after, "kvfs_lookups_total", result="miss") >= 1
    assert one(after, "kvfs_directory_used_bytes", directory="lmcache") == 4 * 4 * MIB
    assert one(after, "kvfs_directory_quota_bytes", directory="sglang") == 64 * MIB
    assert one(after, "kvfs_capacity_bytes") == stats["store"]["capacity_bytes"]
    assert one(after, "kvfs_used_bytes") >= written
    # nothing was full: no write waited for room; the headroom is a unit or more
    assert one(after, "kvfs_room_waits_total") == 0 == stats["store"]["room_waits"]
    assert one(after, "kvfs_headroom_bytes") >= stats["store"]["unit_size"]
    assert one(after, "kvfs_eviction_policy_faults_total") == 0

    dev = str(mount.devices[0])
    assert one(after, "kvfs_device_written_bytes_total", device=dev) >= written
    assert one(after, "kvfs_device_errors_total", device=dev) == 0
    assert one(after, "kvfs_device_writable", device=dev) == 1
    writes = one(after, "kvfs_device_request_duration_seconds_count", device=dev, op="write")
    assert 0 < writes <= mount.stats()["devices"][0]["writes"]  # a commit may come between
    inf = one(
        after, "kvfs_device_request_duration_seconds_bucket", device=dev, op="write", le="+Inf"
    )
    assert inf == writes
    assert one(after, "kvfs_journal_commits_total") > one(before, "kvfs_journal_commits_total")
    assert one(after, "kvfs_journal_commit_duration_seconds_count") > 0
    assert one(after, "kvfs_fuse_request_duration_seconds_count", op="write") > 0
    assert one(after, "kvfs_fuse_request_duration_seconds_count", op="read") > 0
    assert "kvfs_checkpoint_duration_seconds_count" in after

    os.setxattr(mount.path, "user.kvfs.checkpoint", b"1")
    wait_for(
        lambda: one(scrape(port), "kvfs_checkpoint_duration_seconds_count") >= 1,
        what="a checkpoint counted",
    )


def test_evictions_by_reason_and_directory(metrics_mount: Any) -> None:
    mount, port = metrics_mount
    quota = mount.path / "q"
    quota.mkdir()
    os.setxattr(quota, "user.kvfs.quota", b"8M")
    blobs = {f"f{i}": pattern(("q", i), 3 * MIB) for i in range(6)}
    for name, blob in blobs.items():
        harness.write_file(quota / name, blob)
    left = {n: b for n, b in blobs.items() if (quota / n).exists()}
    assert len(left) < len(blobs)
    for name, blob in left.items():
        assert (quota / name).read_bytes() == blob
    m = scrape(port)
    evicted = sum(v for k, v in m["kvfs_evictions_total"].items() if ("directory", "q") in k)
    assert evicted == len(blobs) - len(left)
    assert ("reason", "space") not in {kv for k in m["kvfs_evictions_total"] for kv in k}


def test_not_found_and_head(metrics_mount: Any) -> None:
    _, port = metrics_mount
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing", timeout=30)
    assert e.value.code == 404
    e.value.close()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="HEAD")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and r.read() == b""


def test_taken_port_is_one_line_and_mounts_nothing(tmp_path: Path) -> None:
    require_fuse()
    image = harness.make_image(tmp_path / "pool.img", 256 << 20)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "kvfs", "mount", str(mnt), str(image), "--format"]
        r = subprocess.run(
            [*cmd, "--meta-size", META_SIZE, "--metrics", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert lines == [f"kvfs: --metrics 127.0.0.1:{port}: cannot listen (already in use)"], r.stderr
    assert not harness.is_mounted(mnt)
    for bad in ("9480", "127.0.0.1:http", "127.0.0.1:70000"):
        r = subprocess.run(
            [sys.executable, "-m", "kvfs", "mount", str(mnt), str(image), "--metrics", bad],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "HOST:PORT" in r.stderr


def test_metrics_option_through_mount_t(tmp_path: Path) -> None:
    from tests.mount.test_ops import (
        fresh_pool,
        require_installed,
        safe_unmount,
        umount_and_wait_gone,
    )

    require_fuse()
    require_installed()
    img = fresh_pool(tmp_path, label="mt")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    port = free_port()
    try:
        opts = f"metrics=127.0.0.1:{port},log_file={tmp_path / 'kvfs.log'}"
        r = subprocess.run(
            ["mount", "-t", "fuse.kvfs", str(img), str(mnt), "-o", opts],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        (mnt / "x").write_bytes(pattern("x", 8192))
        m = scrape(port)
        assert one(m, "kvfs_files") == 1
        assert _info(m)["label"] == "mt"
        umount_and_wait_gone(mnt)
    finally:
        safe_unmount(mnt)


def _info(metrics: dict[str, Any]) -> dict[str, str]:
    (labels,) = metrics["kvfs_pool_info"]
    return dict(labels)
