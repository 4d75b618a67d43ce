"""tools/nsmem.py: the namespace's memory, after a turnover as the store evicts and
writers replace files, with the names engines give."""

from __future__ import annotations

import re

import pytest

from kvfs.index.namespace import Namespace
from kvfs.testing.harness import fill_namespace, lmcache_name
from tests.tools import load_tool

nsmem = load_tool("nsmem")


def test_a_turnover_replaces_every_file_in_the_rows_it_freed() -> None:
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    fill_namespace(ns, 3000, 1000)
    before = {ns.inodes[i].name for i in ns.inodes if not ns.inodes[i].is_dir}
    rows = ns.next_ino
    nsmem.turnover(ns, 3000, lmcache_name)
    files = [ns.inodes[i] for i in ns.inodes if not ns.inodes[i].is_dir]
    assert len(files) == 3000 == ns.file_count
    # random victims: some old files are left, most went, every new one is written
    assert 0 < len({f.name for f in files} & before) < 3000 // 2
    assert all(f.size == 1 << 20 and f.nunits == 1 for f in files if f.name not in before)
    # each new file took a freed row (one may wait while the victim's view is held)
    assert rows <= ns.next_ino <= rows + 1


def test_the_tool_reports_the_turnover_and_the_names_it_was_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for names in ("chunk", "lmcache"):
        nsmem.main(["3000", "--turnover", "--names", names, "--lookups", "500"])
        out = capsys.readouterr().out
        assert f"files 3,000 names {names} " in out
        assert "after a turnover (3,000 files replaced" in out and "3,000 files\n" in out
        assert re.search(r"lookup [0-9.]+ µs per name \(500 names\)", out), out
    # (the names themselves: test_a_turnover_replaces_every_file_in_the_rows_it_freed)


def test_the_daemons_turnover_evicts_by_the_policy_and_keeps_its_ghosts() -> None:
    """``--evictor``: every file is tracked as a writer's, each victim is the
    evictor's first candidate (the oldest of an LRU order here), and every evicted
    file's ghost is kept by name, as on a mount."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    fill_namespace(ns, 2000, 2000, lmcache_name)
    first = {ns.inodes[i].name for i in ns.inodes if not ns.inodes[i].is_dir}
    evictor = nsmem.Evictor(
        ns, policy="lru", alive=lambda pid: 7, thread_group=lambda tid: tid, grace=0
    )

    def later(i: int) -> bytes:  # names the fill did not use
        return lmcache_name(10**6 + i)

    nsmem.turnover_evicted(ns, 1500, later, evictor)
    names = {ns.inodes[i].name for i in ns.inodes if not ns.inodes[i].is_dir}
    assert len(names) == 2000 == ns.file_count == len(evictor.policy)
    # LRU: the 1500 victims were the first fill's least recently used (its oldest,
    # unless read lately); no new file went
    assert len(names & first) == 500 and lmcache_name(0) not in names
    assert {later(1500 + k) for k in range(1500)} <= names


def test_the_tool_reports_the_daemons_state(capsys: pytest.CaptureFixture[str]) -> None:
    nsmem.main(["2000", "--turnover", "--names", "lmcache", "--evictor", "adaptive"])
    out = capsys.readouterr().out
    assert re.search(r"the evictor \(adaptive\): 2,000 tracked, [0-9,]+ ghosts by name", out), out
    assert re.search(r"the eviction state by part, B/file: [0-9.]+ in all \(.*loop expert", out)
    assert "gone " in out and "the namespace whole " in out
    assert "recency expert " not in out  # (one table since session 29)
    assert re.search(
        r"RSS in neither: -?[0-9.]+ \(the small-object allocator's slack -?[0-9.]+\)", out
    )


def test_the_small_object_allocators_slack_grows_with_objects_that_come_and_go() -> None:
    """Small objects freed among ones kept leave their pools in use: their blocks
    stay the allocator's, and the slack counts them (what the RSS holds for no
    structure)."""
    before = nsmem.small_object_slack()
    assert before is not None and before > 0
    # 32-byte blocks: more than the free blocks there are (at most ``before``) can
    # hold, so most land in new pools, and 63 of 64 are freed in each
    many = [float(i) for i in range((2 * before + 8_000_000) // 32)]
    kept = many[::64]
    del many
    after = nsmem.small_object_slack()
    assert after is not None and after - before > 3_000_000
    del kept


def test_footprint_counts_what_an_object_holds_once() -> None:
    from array import array

    big = array("q", range(1000))
    holder = {"a": [big, big], "b": (big, 10**20)}
    seen: set[int] = set()
    size = nsmem.footprint(holder, seen)
    alone = nsmem.footprint(big, set())
    assert alone >= 8000 and alone < size < 2 * alone  # big once, beside the rest
    assert nsmem.footprint({"again": big}, seen) < 1000  # already counted: not again
    assert nsmem.footprint(nsmem.footprint, set()) == 0  # functions are not followed
