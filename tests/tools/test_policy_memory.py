"""tools/policy_memory.py --turnover: it measures what a mount holds, and only the
evictor's share of it."""

from __future__ import annotations

from kvfs.evict.policy import make_policy
from tests.tools import load_tool

memory = load_tool("policy_memory")


def test_a_turnover_reuses_evicted_files_inode_numbers_as_a_mount_does() -> None:
    n = 400
    reused = memory.turnover_bytes(n, "kvfs")
    assert reused["tracked"] == n
    # each evicted file left the namespace and the next one made took its number
    # (one more while a dropped view is still referenced)
    assert n <= reused["inode_numbers"] <= n + 2
    distinct = memory.turnover_bytes(n, "kvfs", reuse=False)
    assert distinct["tracked"] == n
    assert distinct["inode_numbers"] == 2 * n
    for row in (reused, distinct):
        parts = row["after_turnover_by_module"]
        assert set(parts) >= {"evict/slots.py", "evict/gone.py", "evict/evictor.py"}
        assert abs(sum(parts.values()) - row["after_turnover_per_file"]) <= 0.1 * len(parts)
        assert row["after_turnover_per_file"] > row["first_fill_per_file"] > 0


def test_only_memory_allocated_under_the_evictor_counts() -> None:
    def action() -> object:
        policy = make_policy("lru")
        for key in range(2000):
            policy.track(key, 100, None)
        return policy, bytearray(4 << 20)  # the caller's own memory: not counted

    total, parts, (policy, own) = memory._evictor_share(action)
    assert len(policy) == 2000 and len(own) == 4 << 20
    assert 0 < total < 1 << 20
    assert total == sum(parts.values())
    assert all(name.startswith("evict/") for name in parts)


def test_a_clock_started_past_2_to_the_32_costs_the_policy_no_more() -> None:
    """``--clock-from``: the policy's clock starts where a long-lived mount's is, and
    its tables cost what they do from 0 (before issue 30's session 19 the last-use
    column took 8 bytes a row from there: +4 B a file)."""
    n = 1100  # two chunks of rows
    start = 1 << 32
    late = memory.turnover_bytes(n, "kvfs", clock_from=start)
    early = memory.turnover_bytes(n, "kvfs")
    assert late["tracked"] == early["tracked"] == n
    slots = [row["after_turnover_by_module"]["evict/slots.py"] for row in (early, late)]
    assert slots[1] <= slots[0] + 1.0, slots
    policy = make_policy("adaptive")
    memory._start_clock(policy, start)
    assert policy.loop._clock == start  # type: ignore[attr-defined]
