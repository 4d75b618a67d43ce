"""clustersim: score a two-tier cache (node-local kvfs + shared Mooncake Store) on traces.

A sibling of ``tools/kvtrace.py``: same traces, same ``Request`` type, same prefix
rule, same kvfs policies (``kvfs.evict.policy.make_policy``), but ``N`` nodes instead of one.

What is modelled
----------------
- ``N`` nodes, each with a node-local kvfs cache of ``C`` bytes (``--local``, a
  fraction of the trace's footprint = distinct chunks x chunk size; *per node*) that
  evicts with a kvfs policy (``--policy``, default ``kvfs.evict.policy.DEFAULT_POLICY``)
  exactly as ``kvtrace.simulate`` does: leading hits are ``touch()``-ed, written
  chunks ``track()``-ed, victims taken from ``victims()`` until the cache fits, the
  chunk being written is never a victim.  The policy sees the trace's stream id.
- One shared cluster tier (the Mooncake Store) of ``M`` bytes in total (``--cluster``,
  a fraction of the footprint), modelled as one LRU over whole chunks.
- Routing: ``random`` sends each request to a uniformly random node (seeded);
  ``sticky`` is prefix-affine by the request's stream id (node = stream % N).  The
  traces are generated with ``engines = N`` so that a stream is a user / session /
  agent branch, as in ``kvtrace`` (where ``agentic`` sends an agent's parallel
  branches to engines (agent + branch) % engines, i.e. to *different* nodes; the
  document visits of ``docqa-mix`` are all stream 0).  Only a trace with a single
  stream (e.g. Mooncake's) is routed by the hash of its first chunk key instead.
- Per request on node n, the prefix rule of ``kvtrace``: walk the keys in order; a
  key in n's local cache is a local hit, else a key in the cluster is a cluster hit,
  else stop -- that chunk and every later one is a miss (recomputed).  Cluster hits
  are fetched (``chunk_bytes`` moved each) and materialized in n's local cache (they
  stay in the cluster: a shared, inclusive tier).  Misses not already in n's local
  cache are written there, as ``kvtrace.simulate`` writes them.
- Publish modes: ``local-only`` (no cluster tier: per node exactly
  ``kvtrace.simulate``); ``on-close`` (every chunk a node writes after computing it
  is published at once); ``on-evict`` (a chunk is published only when n's local
  cache evicts it: a victim cache).  A publish of a key the cluster already holds is
  skipped (an existence check: no bytes moved, its LRU position unchanged).  A local
  eviction never deletes from the cluster.  Fetched chunks are not re-published in
  ``on-close``; in ``on-evict`` they are, when evicted, if the cluster lost them.
- Scores: token hit rate (prefix rule, local + cluster hits), the share of hit tokens
  the cluster served, network bytes moved = publish bytes + fetch bytes.

What is not modelled
--------------------
No time: a request's lookups, fetches, writes and publishes all complete before the
next request starts, so there are no in-flight chunks, no races between nodes, no
queueing, bandwidth or latency, and no load balancing (``sticky`` can be unbalanced:
see ``node_requests`` in the JSON).  No placement: every fetch and publish counts as
network bytes, even when the Mooncake segment holding it is on the same node.  No
replication, leases, soft pins or Mooncake's own eviction watermarks (plain LRU on
``get``/``put``; an existence check touches nothing).  Local capacity is per node
(N nodes hold N x C in total); the cluster's M is separate from it.  Chunks all have
the same size (``kvtrace.LLAMA3_8B_CHUNK_BYTES``, 32 MiB).  The engines' own GPU
caches are ignored, as in ``kvtrace``.

Run the default set (and write the docs)::

    .venv/bin/python tools/clustersim.py --json docs/bench/clustersim.json \\
        --markdown docs/bench/clustersim.md

Exit codes: 0 success, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shlex
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvtrace
import traces
from kvtrace import LLAMA3_8B_CHUNK_BYTES, Request, prefix_hits

from kvfs.evict.policy import DEFAULT_POLICY, POLICY_NAMES, EvictionPolicy, make_policy

MODES = ("local-only", "on-close", "on-evict")
ROUTINGS = ("random", "sticky")
DEFAULT_WORKLOADS = (
    "qa",
    "qa-steady",
    "agentic",
    "vllm-qa",
    "sharegpt",
    "agent-fanout",
    "docqa-mix",
)
LOCAL_FRACTIONS = (0.1, 0.3)
CLUSTER_FRACTION = 0.5


# -- traces ---------------------------------------------------------------------------


def _scaled(count: int, scale: float, low: int = 1) -> int:
    return max(low, round(count * scale))


def _kvtrace_builder(workload: str) -> Callable[[float, int, int], list[Request]]:
    """``kvtrace.make_trace(workload)`` with the number of engines as a parameter."""

    def build(scale: float, seed: int, engines: int) -> list[Request]:
        if workload == "qa":
            users = _scaled(64, scale)
            return kvtrace.multi_round_qa(kvtrace.QAConfig(users, engines=engines, seed=seed))
        if workload == "qa-steady":
            users, concurrent = _scaled(64, scale, 2), _scaled(32, scale)
            config = kvtrace.QAConfig(users, concurrent=concurrent, engines=engines, seed=seed)
            return kvtrace.multi_round_qa(config)
        config_a = kvtrace.AgenticConfig(_scaled(16, scale), engines=engines, seed=seed)
        return kvtrace.agentic(config_a)

    return build


# name -> build(scale, seed, engines): the kvtrace workloads and the train generators
# of tools/traces.py (the suite's defaults, with engines and the session count exposed)
BUILDERS: dict[str, Callable[[float, int, int], list[Request]]] = {
    **{name: _kvtrace_builder(name) for name in kvtrace.WORKLOADS},
    "vllm-qa": lambda scale, seed, engines: traces.vllm_qa(
        users=_scaled(48, scale), concurrent=_scaled(16, scale), engines=engines, seed=seed
    ),
    "sharegpt": lambda scale, seed, engines: traces.sharegpt(
        sessions=_scaled(300, scale), engines=engines, seed=seed
    ),
    "agent-fanout": lambda scale, seed, engines: traces.agent_fanout(
        agents=_scaled(40, scale), engines=engines, seed=seed
    ),
    "docqa-mix": lambda scale, seed, engines: traces.docqa_mix(
        visits=_scaled(150, scale), chats=_scaled(150, scale), engines=engines, seed=seed
    ),
}


def make_trace(workload: str, nodes: int, scale: float = 1.0, seed: int = 1) -> list[Request]:
    """Return ``workload``'s trace with streams spread over ``nodes`` engines.

    A name of :data:`BUILDERS` is generated with ``engines = nodes``; any other name of
    ``traces.SUITE`` (the held-out ones) comes from ``traces.suite`` as it is (no
    scaling, its own streams).
    """
    if workload in BUILDERS:
        return BUILDERS[workload](scale, seed, nodes)
    if workload in traces.SUITE:
        return traces.suite(names=[workload])[0].requests
    raise ValueError(f"unknown workload {workload!r}")


# -- the cluster tier -----------------------------------------------------------------


class LRUStore:
    """The shared cluster tier: an LRU over whole chunks, ``capacity`` chunks in all."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self.keys: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def get(self, key: int) -> None:
        """A fetch: ``key`` becomes the most recently used."""
        self.keys.move_to_end(key)

    def put(self, key: int) -> bool:
        """Publish ``key`` unless present; evict LRU keys to fit.  True if stored."""
        if key in self.keys or self.capacity == 0:
            return False
        self.keys[key] = None
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)
            self.evictions += 1
        return True


class _Either:
    """Membership in a node's local cache or in the cluster tier (for ``prefix_hits``)."""

    def __init__(self, local: EvictionPolicy, cluster: LRUStore | None) -> None:
        self.local, self.cluster = local, cluster

    def __contains__(self, key: object) -> bool:
        return key in self.local or (self.cluster is not None and key in self.cluster)


# -- simulation -----------------------------------------------------------------------


@dataclass
class ClusterResult:
    """Outcome of one cluster replay; ``hit_rate`` is the prefix-rule token hit rate."""

    mode: str
    routing: str
    nodes: int
    policy: str
    local_bytes: int
    cluster_bytes: int
    chunk_bytes: int
    prompt_tokens: int = 0
    hit_tokens: int = 0
    cluster_hit_tokens: int = 0
    local_hit_chunks: int = 0
    cluster_hit_chunks: int = 0
    local_writes: int = 0  # chunks written to a local cache after a miss (computed)
    local_evictions: int = 0
    publishes: int = 0
    cluster_evictions: int = 0
    node_requests: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def cluster_share(self) -> float:
        """The share of hit tokens served by the cluster tier."""
        return self.cluster_hit_tokens / self.hit_tokens if self.hit_tokens else 0.0

    @property
    def fetch_bytes(self) -> int:
        return self.cluster_hit_chunks * self.chunk_bytes

    @property
    def publish_bytes(self) -> int:
        return self.publishes * self.chunk_bytes

    @property
    def network_bytes(self) -> int:
        return self.publish_bytes + self.fetch_bytes


def router(
    routing: str, trace: Sequence[Request], nodes: int, seed: int
) -> Callable[[Request], int]:
    """Return the function picking a request's node (see the module docstring)."""
    if routing == "random":
        rng = random.Random(seed)
        return lambda request: rng.randrange(nodes)
    if routing != "sticky":
        raise ValueError(f"unknown routing {routing!r}")
    if len({request.stream for request in trace}) > 1:
        return lambda request: request.stream % nodes

    def by_first_key(request: Request) -> int:
        if not request.keys:
            return 0
        digest = hashlib.blake2b(request.keys[0].to_bytes(8, "little"), digest_size=8)
        return int.from_bytes(digest.digest(), "little") % nodes

    return by_first_key


def simulate_cluster(
    trace: Sequence[Request],
    nodes: int,
    mode: str,
    routing: str,
    local_bytes: int,
    cluster_bytes: int,
    chunk_bytes: int = LLAMA3_8B_CHUNK_BYTES,
    policy: str = DEFAULT_POLICY,
    seed: int = 1,
) -> ClusterResult:
    """Replay ``trace`` on ``nodes`` local caches of ``local_bytes`` each over a
    cluster tier of ``cluster_bytes`` (ignored in ``local-only``) in publish ``mode``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    result = ClusterResult(mode, routing, nodes, policy, local_bytes, cluster_bytes, chunk_bytes)
    result.node_requests = [0] * nodes
    started = time.perf_counter()
    pick = router(routing, trace, nodes, seed)
    locals_ = [make_policy(policy) for _ in range(nodes)]
    used = [0] * nodes
    cluster = None if mode == "local-only" else LRUStore(cluster_bytes // chunk_bytes)

    def publish(key: int) -> None:
        if cluster is not None and cluster.put(key):
            result.publishes += 1

    def store(node: int, key: int, stream: int) -> None:
        """Write ``key`` to ``node``'s cache and evict to fit (kvtrace's write path)."""
        local = locals_[node]
        local.track(key, chunk_bytes, stream)
        used[node] += chunk_bytes
        excess, freed = used[node] - local_bytes, 0
        if excess <= 0:
            return
        for victim in local.victims():
            if victim == key:
                continue
            local.remove(victim)
            result.local_evictions += 1
            if mode == "on-evict":
                publish(victim)
            freed += chunk_bytes
            if freed >= excess:
                break
        used[node] -= freed

    for request in trace:
        node = pick(request)
        result.node_requests[node] += 1
        local = locals_[node]
        hits = prefix_hits(request.keys, _Either(local, cluster))
        result.prompt_tokens += request.tokens
        result.hit_tokens += request.hit_tokens(hits)
        fetched: list[int] = []
        for index, key in enumerate(request.keys[:hits]):
            if key in local:
                local.touch(key, request.stream)
                result.local_hit_chunks += 1
            else:
                fetched.append(key)
                tokens = request.hit_tokens(index + 1) - request.hit_tokens(index)
                result.cluster_hit_tokens += tokens
        assert cluster is not None or not fetched
        for key in fetched:  # fetch all first: materializing may publish (on-evict)
            assert cluster is not None
            cluster.get(key)
            result.cluster_hit_chunks += 1
        for key in fetched:  # then materialize locally (it stays in the cluster)
            store(node, key, request.stream)
        for key in request.keys[hits:]:
            if key in local:
                continue
            result.local_writes += 1
            store(node, key, request.stream)
            if mode == "on-close":
                publish(key)
    if cluster is not None:
        result.cluster_evictions = cluster.evictions
    result.seconds = time.perf_counter() - started
    return result


# -- report ---------------------------------------------------------------------------


def score(
    workloads: Sequence[str],
    nodes: int = 4,
    routings: Sequence[str] = ROUTINGS,
    local_fractions: Sequence[float] = LOCAL_FRACTIONS,
    cluster_fraction: float = CLUSTER_FRACTION,
    chunk_bytes: int = LLAMA3_8B_CHUNK_BYTES,
    policy: str = DEFAULT_POLICY,
    scale: float = 1.0,
    seed: int = 1,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Simulate every (workload, local fraction, routing, mode); return one row each."""
    rows: list[dict[str, Any]] = []
    for workload in workloads:
        trace = make_trace(workload, nodes, scale, seed)
        chunks = kvtrace.footprint_chunks(trace)
        cluster_bytes = int(chunks * cluster_fraction) * chunk_bytes
        for fraction in local_fractions:
            local_bytes = int(chunks * fraction) * chunk_bytes
            for routing in routings:
                for mode in MODES:
                    result = simulate_cluster(
                        trace, nodes, mode, routing, local_bytes, cluster_bytes, chunk_bytes,
                        policy, seed,
                    )  # fmt: skip
                    row = _row(workload, len(trace), chunks, fraction, cluster_fraction, result)
                    rows.append(row)
            if progress:
                print(f"  {workload} {fraction:.0%} done", file=sys.stderr, flush=True)
    return rows


def _row(
    workload: str,
    requests: int,
    chunks: int,
    fraction: float,
    cluster_fraction: float,
    result: ClusterResult,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "workload": workload,
        "requests": requests,
        "footprint_chunks": chunks,
        "local_fraction": fraction,
        "cluster_fraction": cluster_fraction,
    }
    row.update(asdict(result))
    row["hit_rate"] = round(result.hit_rate, 4)
    row["cluster_share"] = round(result.cluster_share, 4)
    row["fetch_bytes"] = result.fetch_bytes
    row["publish_bytes"] = result.publish_bytes
    row["network_bytes"] = result.network_bytes
    row["seconds"] = round(result.seconds, 3)
    return row


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown, one line per (workload, local fraction, routing): hit % per mode,
    the cluster's share of the hits and the network GiB moved per cluster mode."""
    head = ["workload", "local", "routing", "local-only hit %"]
    for mode in MODES[1:]:
        head += [f"{mode} hit %", f"{mode} cluster share %", f"{mode} net GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells: dict[tuple[str, float, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        cell = cells.setdefault((row["workload"], row["local_fraction"], row["routing"]), {})
        cell[row["mode"]] = row
    for (workload, fraction, routing), by in cells.items():
        line = [workload, f"{fraction:.0%}", routing, f"{100 * by['local-only']['hit_rate']:.1f}"]
        for mode in MODES[1:]:
            row = by[mode]
            line += [f"{100 * row['hit_rate']:.1f}", f"{100 * row['cluster_share']:.1f}"]
            line.append(f"{row['network_bytes'] / 2**30:,.0f}")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = (*BUILDERS, *(name for name in traces.SUITE if name not in BUILDERS))
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS),
                        choices=names, metavar="NAME", help=f"of {', '.join(names)}")  # fmt: skip
    parser.add_argument("--routing", nargs="+", default=list(ROUTINGS), choices=ROUTINGS)
    parser.add_argument("--local", nargs="+", type=float, default=list(LOCAL_FRACTIONS),
                        help="local capacity per node, fractions of the footprint")  # fmt: skip
    parser.add_argument("--cluster", type=float, default=CLUSTER_FRACTION,
                        help="cluster capacity in all, a fraction of the footprint")  # fmt: skip
    parser.add_argument("--policy", choices=POLICY_NAMES, default=DEFAULT_POLICY)
    parser.add_argument("--chunk-bytes", type=int, default=LLAMA3_8B_CHUNK_BYTES)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply users/agents")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the rows here")
    parser.add_argument("--markdown", type=Path, metavar="PATH", help="write the table here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; see the module docstring for exit codes."""
    args = _parse_args(argv)
    fractions = [*args.local, args.cluster]
    if args.nodes < 1 or args.chunk_bytes <= 0 or args.scale <= 0 or min(fractions) < 0:
        print("clustersim: nodes, sizes, scale and fractions must be positive", file=sys.stderr)
        return 2
    command = shlex.join([".venv/bin/python", "tools/clustersim.py", *sys.argv[1:]])
    if argv is not None:
        command = shlex.join([".venv/bin/python", "tools/clustersim.py", *argv])
    started = time.perf_counter()
    rows = score(
        args.workloads, args.nodes, args.routing, args.local, args.cluster,
        args.chunk_bytes, args.policy, args.scale, args.seed, progress=True,
    )  # fmt: skip
    table = format_table(rows)
    print(table)
    seconds = time.perf_counter() - started
    print(f"({seconds:.0f} s)", file=sys.stderr)
    if args.json is not None:
        document = {"command": command, "rows": rows}
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(_markdown(command, table, args))
    return 0


def _markdown(command: str, table: str, args: argparse.Namespace) -> str:
    return (
        "# clustersim: node-local kvfs over a shared Mooncake Store (simulated)\n\n"
        f"Produced by `tools/clustersim.py` (model and assumptions: its docstring):\n\n"
        f"    {command}\n\n"
        f"{args.nodes} nodes, local capacity per node and cluster capacity in all as "
        f"fractions of each trace's footprint (cluster {args.cluster:.0%}), local policy "
        f"`{args.policy}`, {args.chunk_bytes // 2**20} MiB chunks, seed {args.seed}. "
        "Hit % is the prefix-rule token hit rate (local + cluster hits); cluster share is "
        "the share of the hit tokens the cluster served; net GiB = publishes + fetches.\n\n"
        f"{table}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
