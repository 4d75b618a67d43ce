"""A new pool's first checkpoint: the format's root-only image
(``kvfs.format.nsparts.root_snapshot``, written by ``kvfs.devices.pool`` without the
index) is byte for byte the image of a namespace that made its root."""

from __future__ import annotations

import stat
import time

import pytest

from kvfs.format.nsimage import image_payloads
from kvfs.format.nsparts import root_snapshot
from kvfs.index.namespace import ROOT_INO, Namespace


@pytest.mark.parametrize("uid, gid", [(0, 0), (1000, 100), (65534, 65534)])
def test_the_root_only_image_is_the_image_of_a_namespace_with_its_root(
    monkeypatch: pytest.MonkeyPatch, uid: int, gid: int
) -> None:
    now = 1_700_000_000_123_456_789
    monkeypatch.setattr(time, "time_ns", lambda: now)
    ns = Namespace(lambda ops: None)
    ns.init_root(uid, gid)
    made = list(ns.snapshot_payloads())
    written = list(image_payloads(root_snapshot(uid, gid, now, stat.S_IFDIR | 0o755)))
    assert written == made
    fresh = Namespace(lambda ops: None)
    for payload in written:
        fresh.load_payload(payload)
    fresh.finish_load()
    root = fresh.inodes[ROOT_INO]
    assert (root.uid, root.gid, root.nlink, root.mtime_ns) == (uid, gid, 2, now)
    assert root.mode == stat.S_IFDIR | 0o755 and not root.entries
