"""tools/policy_lab.py: the decayed-score reference order behaves as documented."""

from __future__ import annotations

import sys

import pytest

from tests.tools import load_tool

lab = load_tool("policy_lab")


def test_a_key_used_twice_outlives_newer_keys_used_once() -> None:
    policy = lab.DecayPolicy(half=1.0)
    for key in range(10):
        policy.track(key, 100, None)
    policy.touch(0, None)  # 0: score ~2, now in a higher class
    for key in range(10, 14):
        policy.track(key, 100, None)
    order = list(policy.victims())
    assert order[:9] == list(range(1, 10))  # the used-once keys, oldest first
    assert order.index(0) > order.index(13)  # one doubling = one horizon of extra life
    assert sorted(order) == list(range(14))


def test_the_score_decays_and_survives_an_eviction_as_a_ghost() -> None:
    policy = lab.DecayPolicy(half=0.5)
    for key in range(100):
        policy.track(key, 100, None)
    policy.remove(5)
    assert 5 not in policy and 5 not in list(policy.victims())
    policy.track(5, 100, None)  # its ghost: score 1 decayed + 1 > 1
    assert policy._state[5][0] > 1.0
    for key in range(100, 10_000):  # many turnovers later the score is ~1 again
        policy.track(key, 100, None)
        if key - 100 >= 100:
            policy.remove(key - 100)
    policy.touch(5, None)
    assert policy._state[5][0] < 2.2


def test_a_prompt_leaves_deepest_chunk_first_and_partial_blocks_before_full_ones() -> None:
    policy = lab.DecayPolicy(half=1.0, partial=1.0)
    for key in (1, 2, 3):
        policy.track(key, 100, "engine")
    policy.track(4, 40, "engine")  # a partial last block
    assert list(policy.victims()) == [4, 3, 2, 1]


def test_victims_skip_what_the_caller_keeps_and_bad_options_are_refused() -> None:
    policy = lab.DecayPolicy()
    for key in range(5):
        policy.track(key, 100, None)
    seen = []
    for key in policy.victims():
        seen.append(key)
        if key % 2:
            policy.remove(key)
    assert sorted(seen) == list(range(5)) and len(policy) == 3
    with pytest.raises(ValueError):
        lab.DecayPolicy(half=0)
    assert lab.main(["--candidates", "lru:half=1"]) == 2


def test_sized_simulation_charges_a_partial_block_its_share() -> None:
    kt = sys.modules["kvtrace"]
    trace = [kt.Request((1, 2, 3), 2 * 512 + 128, 0, 512)] * 3
    policy = lab.DecayPolicy()
    result = lab.simulate_sized(trace, policy, capacity=10_000, chunk=1000)
    assert result.hit_chunks == 6 and result.hit_tokens == 2 * (2 * 512 + 128)
    assert policy._state[3][4] == 250 and policy._state[1][4] == 1000


def test_a_candidate_runs_as_the_adaptive_policys_recency_expert() -> None:
    """``--adaptive`` puts a candidate in the default policy's place of ``prefix-lru``:
    the adaptive policy reads its expert's bytes and sizes, so the candidate keeps
    them as the slot-table policies do."""
    kt = sys.modules["kvtrace"]
    trace = [kt.Request((i, i + 1, i + 2), 3 * 512 - 100, 0, 512) for i in range(0, 60, 2)]
    policy = lab.with_recency(lambda: lab.DecayPolicy(half=1.0, partial=1.0))
    result = lab.simulate_sized(trace, policy, capacity=8_000, chunk=1000)
    assert 0 < result.hit_tokens < result.prompt_tokens and result.evictions > 0
    expert = policy.recency
    assert expert._bytes == sum(state[4] for state in expert._state.values()) <= 8_000
    partial = kt.chunk_size(trace[0], 2, 1000)
    assert partial < 1000 and {expert.size_of(k) for k in expert._state} == {1000, partial}
    assert isinstance(policy.duel.shadows[0], lab.DecayPolicy)  # its shadow is one too
