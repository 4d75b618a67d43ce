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
