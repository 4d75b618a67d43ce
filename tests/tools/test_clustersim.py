"""Tests of tools/clustersim.py: node-local kvfs caches over a shared LRU cluster tier."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import clustersim as cs
import kvtrace as kt  # the module clustersim itself uses (tools/ is on sys.path)
import traces

from kvfs.evict.policy import make_policy

CHUNK = 1000  # bytes per chunk in small simulations
SMALL_QA = kt.QAConfig(users=12, rounds=4, history_tokens=1500, arrival_rounds=2.0)
SMALL_AGENTIC = kt.AgenticConfig(agents=6, turns=5, parallel=3)


def _qa(engines: int = 4) -> list[kt.Request]:
    return kt.multi_round_qa(dataclasses.replace(SMALL_QA, engines=engines))


def _agentic() -> list[kt.Request]:
    return kt.agentic(SMALL_AGENTIC)


def _sim(
    trace: list[kt.Request],
    nodes: int,
    mode: str,
    local: float,
    cluster: float,
    routing: str = "random",
    policy: str = "adaptive",
    seed: int = 1,
) -> cs.ClusterResult:
    chunks = kt.footprint_chunks(trace)
    return cs.simulate_cluster(
        trace, nodes, mode, routing, int(chunks * local) * CHUNK, int(chunks * cluster) * CHUNK,
        CHUNK, policy, seed,
    )  # fmt: skip


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
@pytest.mark.parametrize("fraction", [0.1, 0.4])
def test_one_node_local_only_is_kvtrace_simulate(policy: str, fraction: float) -> None:
    trace = _qa()
    capacity = int(kt.footprint_chunks(trace) * fraction) * CHUNK
    expected = kt.simulate(trace, make_policy(policy), capacity, CHUNK)
    got = _sim(trace, 1, "local-only", fraction, 0.5, policy=policy)
    assert got.hit_tokens == expected.hit_tokens
    assert got.local_hit_chunks == expected.hit_chunks
    assert got.local_writes * CHUNK == expected.bytes_written
    assert got.local_evictions == expected.evictions
    assert got.cluster_hit_chunks == got.publishes == got.network_bytes == 0


@pytest.mark.parametrize("mode", ["on-close", "on-evict"])
def test_one_node_with_a_big_local_cache_gains_nothing_from_the_cluster(mode: str) -> None:
    trace = _qa()
    alone = _sim(trace, 1, "local-only", 1.0, 0.5)
    tiered = _sim(trace, 1, mode, 1.0, 0.5)
    assert tiered.local_evictions == 0
    assert tiered.hit_tokens == alone.hit_tokens
    assert tiered.cluster_hit_chunks == tiered.cluster_hit_tokens == 0
    assert tiered.fetch_bytes == 0
    if mode == "on-evict":
        assert tiered.publishes == 0  # nothing evicted, nothing published


def test_one_node_on_evict_is_a_victim_cache() -> None:
    trace = _qa()
    alone = _sim(trace, 1, "local-only", 0.1, 0.5)
    tiered = _sim(trace, 1, "on-evict", 0.1, 0.5)
    assert tiered.cluster_hit_chunks > 0
    assert tiered.hit_rate > alone.hit_rate + 0.05
    assert 0 < tiered.publishes <= tiered.local_evictions


@pytest.mark.parametrize("make", [_qa, _agentic])
def test_random_routing_on_close_beats_local_only(make: object) -> None:
    trace = make()  # type: ignore[operator]
    alone = _sim(trace, 4, "local-only", 0.1, 0.5)
    shared = _sim(trace, 4, "on-close", 0.1, 0.5)
    assert shared.hit_rate > alone.hit_rate + 0.05
    assert 0 < shared.cluster_share < 1


def test_an_unbounded_on_close_cluster_is_one_unbounded_cache() -> None:
    trace = _agentic()  # the prefix rule must hold across tiers: local, cluster, local...
    single = kt.simulate(trace, make_policy("lru"), 10**12, CHUNK)
    shared = _sim(trace, 4, "on-close", 0.05, 1.0)
    assert shared.hit_tokens == single.hit_tokens
    assert shared.publishes == kt.footprint_chunks(trace)  # every chunk once, none again
    assert shared.cluster_evictions == 0
    victim = _sim(trace, 4, "on-evict", 0.05, 1.0)
    assert victim.hit_tokens < shared.hit_tokens  # unevicted chunks stay private


@pytest.mark.parametrize("mode", cs.MODES)
@pytest.mark.parametrize("routing", cs.ROUTINGS)
def test_bytes_moved_accounting(mode: str, routing: str) -> None:
    trace = _qa()
    result = _sim(trace, 4, mode, 0.1, 0.3, routing)
    assert result.fetch_bytes == result.cluster_hit_chunks * CHUNK
    assert result.publish_bytes == result.publishes * CHUNK
    assert result.network_bytes == result.fetch_bytes + result.publish_bytes
    # every qa key is a full chunk, so hit tokens count the hit chunks exactly
    hits = result.local_hit_chunks + result.cluster_hit_chunks
    assert result.hit_tokens == hits * kt.CHUNK_TOKENS
    assert result.cluster_hit_tokens == result.cluster_hit_chunks * kt.CHUNK_TOKENS
    assert sum(result.node_requests) == len(trace)
    if mode == "local-only":
        assert result.network_bytes == 0
    else:
        assert result.cluster_hit_chunks > 0 and result.publishes > 0
    if mode == "on-close":
        assert result.publishes <= result.local_writes
    if mode == "on-evict":
        assert result.publishes <= result.local_evictions


def test_a_cluster_of_zero_bytes_changes_nothing() -> None:
    trace = _qa()
    alone = _sim(trace, 4, "local-only", 0.1, 0.0)
    for mode in ("on-close", "on-evict"):
        result = _sim(trace, 4, mode, 0.1, 0.0)
        assert (result.hit_tokens, result.network_bytes) == (alone.hit_tokens, 0)


def test_lru_store_evicts_least_recently_used() -> None:
    store = cs.LRUStore(2)
    assert store.put(1) and store.put(2)
    assert not store.put(1)  # present: skipped, not refreshed
    store.get(1)
    assert store.put(3)
    assert 1 in store and 3 in store and 2 not in store
    assert store.evictions == 1 and len(store) == 2
    assert not cs.LRUStore(0).put(1)


def test_sticky_routes_by_stream_and_keeps_sessions_local() -> None:
    trace = _qa(engines=4)
    pick = cs.router("sticky", trace, 4, seed=1)
    assert all(pick(request) == request.stream % 4 for request in trace)
    # the loop-resistant policy: on this small QA loop it keeps a session's chain
    # while its node sees the session again, which is what sticky routing buys
    # (the default policy's shadows need more traffic than 12 requests a node to
    # follow it: docs/eviction.md)
    sticky = _sim(trace, 4, "local-only", 0.1, 0.5, "sticky", policy="kvfs")
    scattered = _sim(trace, 4, "local-only", 0.1, 0.5, "random", policy="kvfs")
    assert sticky.hit_rate > scattered.hit_rate + 0.05


def test_sticky_on_a_single_stream_trace_hashes_the_first_key() -> None:
    trace = [kt.make_request([(f"s{i % 5}", 600), (f"u{i}", 300)], 0) for i in range(40)]
    pick = cs.router("sticky", trace, 4, seed=1)
    by_prefix: dict[int, set[int]] = {}
    for request in trace:
        by_prefix.setdefault(request.keys[0], set()).add(pick(request))
    assert all(len(nodes) == 1 for nodes in by_prefix.values())
    assert len({node for nodes in by_prefix.values() for node in nodes}) > 1


def test_determinism_by_seed() -> None:
    def run(seed: int) -> list[dict[str, object]]:
        rows = cs.score(["qa"], 4, ["random"], [0.1], 0.5, CHUNK, "lru", 0.15, seed)
        return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_traces_are_the_kvtrace_and_suite_traces() -> None:
    for workload in kt.WORKLOADS:
        assert cs.make_trace(workload, 4, 0.25, 2) == kt.make_trace(workload, 0.25, 2)
    for name in ("vllm-qa", "agent-fanout"):
        assert cs.make_trace(name, 1) == traces.SUITE[name][2]()
    streams = {request.stream for request in cs.make_trace("vllm-qa", 3, 0.5)}
    assert streams == {0, 1, 2}


def test_cli_writes_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_md = tmp_path / "c.json", tmp_path / "c.md"
    argv = ["--nodes", "2", "--workloads", "qa", "--local", "0.2", "--scale", "0.1"]
    argv += ["--policy", "lru", "--json", str(out_json), "--markdown", str(out_md)]
    assert cs.main(argv) == 0
    document = json.loads(out_json.read_text())
    assert len(document["rows"]) == 2 * len(cs.MODES)
    assert {row["mode"] for row in document["rows"]} == set(cs.MODES)
    assert "--nodes 2" in document["command"] and "--nodes 2" in out_md.read_text()
    assert "| qa | 20% | sticky |" in capsys.readouterr().out
    assert cs.main(["--nodes", "0"]) == 2


def test_cluster_hits_are_materialized_locally() -> None:
    keys = kt.make_request([("sys", 1024)], 0).keys  # 4 chunks
    trace = [kt.Request(keys, 1024, stream) for stream in (0, 1, 1)]  # node 0, 1, 1
    result = cs.simulate_cluster(trace, 2, "on-close", "sticky", 10 * CHUNK, 10 * CHUNK, CHUNK)
    assert result.publishes == 4 and result.local_writes == 4
    assert result.cluster_hit_chunks == 4  # the 2nd request fetches ...
    assert result.local_hit_chunks == 4  # ... and the 3rd finds them on node 1
    assert result.hit_tokens == 2 * 1024 and result.cluster_share == 0.5
