"""kvtrace: generate KV-cache chunk traces and score eviction policies on them.

Two workloads from ``docs/workloads.md`` become traces of requests: multi-round QA,
in two modes ("qa": all users arrive once, concurrency ramps up and down; "qa-steady":
a constant number of concurrent users, a finished user replaced by a new one, as in
vLLM's benchmark), and agentic shared-context bursts ("agentic").  A request is
the list of its 256-token chunk keys (key = hash of the whole prefix up to and
including the chunk, so identical prefixes share keys) plus a stream id (the engine
process that sends it).

``simulate()`` replays a trace against a policy from :mod:`kvfs.evict.policy` at a capacity
in bytes; ``simulate_belady()`` replays it against the prefix-aware offline optimum;
``replay()`` replays it against a real directory (a kvfs mount) and measures.
Scores follow the prefix rule: a chunk is a hit only if every earlier chunk of the
request was one.

Reproduce the table in docs/eviction.md::

    .venv/bin/python tools/kvtrace.py

Exit codes: 0 success, 1 replay saw errors (short reads, corrupt data, I/O errors),
2 bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the kvfs package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfs.evict.policy import POLICY_NAMES, EvictionPolicy, make_policy

CHUNK_TOKENS = 256
LLAMA3_8B_CHUNK_BYTES = 32 * 1024 * 1024  # 256 tokens x 128 KiB/token (docs/workloads.md)
CAPACITY_FRACTIONS = (0.1, 0.3, 0.5)
WORKLOADS = ("qa", "qa-steady", "agentic")
_INF = sys.maxsize

Piece = tuple[str, int]  # (segment name, token count): a run of tokens unique to the name


@dataclass(frozen=True)
class Request:
    """One engine request: its chunk keys, its prompt length, its stream and the
    tokens per chunk (a final partial chunk, as in Mooncake's traces, counts only
    its own tokens)."""

    keys: tuple[int, ...]
    tokens: int
    stream: int
    chunk_tokens: int = CHUNK_TOKENS

    def hit_tokens(self, hits: int) -> int:
        """Tokens served by the first ``hits`` chunks."""
        return min(hits * self.chunk_tokens, self.tokens)


@dataclass(frozen=True)
class QAConfig:
    """Multi-round QA, scaled down from 320 users / 10 rounds / 1000 + 20000 tokens."""

    users: int = 64
    rounds: int = 10
    system_tokens: int = 1000
    history_tokens: int = 5000
    question_tokens: int = 100
    answer_tokens: int = 100
    arrival_rounds: float = 5.0  # users join spread over this many round intervals
    engines: int = 4
    seed: int = 1
    concurrent: int = 0  # > 0: steady mode, this many users at once (see multi_round_qa)


@dataclass(frozen=True)
class AgenticConfig:
    """Agents with a long growing context, tool outputs per turn, parallel requests."""

    agents: int = 16
    turns: int = 16
    parallel: int = 4
    system_tokens: int = 2000
    task_tokens: int = 1000
    tool_tokens: tuple[int, int] = (200, 2000)
    action_tokens: int = 50
    suffix_tokens: tuple[int, int] = (100, 400)
    arrival_turns: float = 4.0  # agents join spread over this many turn intervals
    engines: int = 4
    seed: int = 1


# -- trace generation -------------------------------------------------------------------


def chunk_keys(pieces: Sequence[Piece], chunk_tokens: int = CHUNK_TOKENS) -> tuple[int, ...]:
    """Return the keys of the full chunks of a prompt made of ``pieces``.

    Key i hashes key i-1 and the description of chunk i's tokens, so two prompts share
    key i exactly when their first (i+1) * chunk_tokens tokens are identical.
    A partial final chunk gets no key (engines store whole chunks only).
    """
    keys: list[int] = []
    current: list[tuple[str, int, int]] = []
    filled, previous = 0, b""
    for name, count in pieces:
        start = 0
        while start < count:
            take = min(count - start, chunk_tokens - filled)
            current.append((name, start, start + take))
            start, filled = start + take, filled + take
            if filled == chunk_tokens:
                digest = hashlib.blake2b(previous + repr(current).encode(), digest_size=8)
                previous = digest.digest()
                keys.append(int.from_bytes(previous, "little") >> 1)
                current, filled = [], 0
    return tuple(keys)


def make_request(pieces: Sequence[Piece], stream: int) -> Request:
    """Return the request whose prompt is ``pieces``, sent by ``stream``."""
    return Request(chunk_keys(pieces), sum(count for _, count in pieces), stream)


def multi_round_qa(config: QAConfig = QAConfig()) -> list[Request]:
    """Generate a multi-round QA trace: every round re-sends the whole conversation.

    A user sends round r one interval (x0.8..1.2 jitter) after round r-1; requests
    are ordered by time.  Prompt of round r = system prompt + user history +
    (question, answer) of all earlier rounds + this round's question.

    Arrival mode (``concurrent == 0``): all ``users`` join spread over
    ``arrival_rounds`` intervals, so concurrency ramps up to ``users`` and down again.
    Steady mode (``concurrent > 0``, like vLLM's multi-round QA benchmark): that many
    users join spread over ``arrival_rounds`` intervals; when one finishes (one
    interval after its last round) a new user takes its place, until ``users`` users
    have started, so concurrency stays at ``concurrent`` for most of the trace.
    """
    rng = random.Random(config.seed)
    events: list[tuple[float, int, int]] = []
    slots = config.concurrent if config.concurrent > 0 else config.users
    free = [config.arrival_rounds * slot / max(slots, 1) for slot in range(slots)]
    heapq.heapify(free)
    for user in range(config.users):
        when = heapq.heappop(free)
        for round_ in range(config.rounds):
            events.append((when, user, round_))
            when += rng.uniform(0.8, 1.2)
        heapq.heappush(free, when if config.concurrent > 0 else _INF)
    events.sort()
    return [_qa_request(config, user, round_) for _, user, round_ in events]


def _qa_request(config: QAConfig, user: int, round_: int) -> Request:
    pieces: list[Piece] = [("system", config.system_tokens), (f"h{user}", config.history_tokens)]
    for past in range(round_):
        pieces += [(f"q{user}.{past}", config.question_tokens)]
        pieces += [(f"a{user}.{past}", config.answer_tokens)]
    pieces.append((f"q{user}.{round_}", config.question_tokens))
    return make_request(pieces, user % config.engines)


def agentic(config: AgenticConfig = AgenticConfig()) -> list[Request]:
    """Generate agentic bursts: per turn, ``parallel`` requests share the agent's context.

    Context of agent a at turn t = shared system prompt + a's task + for every earlier
    turn a tool output (random length) and an action.  Each parallel request adds its
    own short instruction suffix and goes to engine (a + p) % engines.
    """
    rng = random.Random(config.seed)
    tools = {
        (a, t): rng.randint(*config.tool_tokens)
        for a in range(config.agents)
        for t in range(config.turns)
    }
    events: list[tuple[float, int, int, int]] = []
    for a in range(config.agents):
        when = config.arrival_turns * a / max(config.agents, 1)
        for t in range(config.turns):
            events += [(when + p * 1e-6, a, t, p) for p in range(config.parallel)]
            when += rng.uniform(0.5, 1.5)
    events.sort()
    return [_agentic_request(config, tools, rng, a, t, p) for _, a, t, p in events]


def _agentic_request(
    config: AgenticConfig,
    tools: dict[tuple[int, int], int],
    rng: random.Random,
    agent: int,
    turn: int,
    branch: int,
) -> Request:
    pieces: list[Piece] = [("system", config.system_tokens), (f"task{agent}", config.task_tokens)]
    for past in range(turn):
        pieces += [(f"tool{agent}.{past}", tools[agent, past])]
        pieces += [(f"act{agent}.{past}", config.action_tokens)]
    pieces.append((f"ask{agent}.{turn}.{branch}", rng.randint(*config.suffix_tokens)))
    return make_request(pieces, (agent + branch) % config.engines)


def make_trace(workload: str, scale: float = 1.0, seed: int = 1) -> list[Request]:
    """Return the default trace of ``workload`` with user/agent counts times ``scale``.

    "qa": 64 users arriving over 5 round intervals; "qa-steady": 64 users, 32 at a
    time (so both have the same footprint); "agentic": 16 agents.
    """
    if workload == "qa":
        return multi_round_qa(QAConfig(users=max(1, round(64 * scale)), seed=seed))
    if workload == "qa-steady":
        users, concurrent = max(2, round(64 * scale)), max(1, round(32 * scale))
        return multi_round_qa(QAConfig(users=users, concurrent=concurrent, seed=seed))
    if workload == "agentic":
        return agentic(AgenticConfig(agents=max(1, round(16 * scale)), seed=seed))
    raise ValueError(f"unknown workload {workload!r}")


def footprint_chunks(trace: Iterable[Request]) -> int:
    """Return the number of distinct chunk keys in ``trace``."""
    return len({key for request in trace for key in request.keys})


# -- simulation -------------------------------------------------------------------------


@dataclass
class SimResult:
    """Outcome of one replay; ``hit_rate`` is the prefix-rule token hit rate."""

    policy: str
    capacity_bytes: int
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_chunks: int = 0
    bytes_written: int = 0
    evictions: int = 0
    errors: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prefix_hits(keys: Sequence[int], cached: object) -> int:
    """Return how many leading keys are in ``cached`` (stop at the first miss)."""
    hits = 0
    for key in keys:
        if key not in cached:  # type: ignore[operator]
            break
        hits += 1
    return hits


def simulate(
    trace: Sequence[Request],
    policy: EvictionPolicy,
    capacity_bytes: int,
    chunk_bytes: int = LLAMA3_8B_CHUNK_BYTES,
    evict_first: bool = False,
    sized: bool = False,
) -> SimResult:
    """Replay ``trace`` against ``policy`` holding at most ``capacity_bytes``.

    Per request: leading cached chunks are hits and get ``touch()``; then every
    chunk not cached is written (``track()``) and victims are removed until the
    cache fits again.  The chunk being written (an open file) is never a victim.
    ``evict_first``: the mount's order of events instead -- room is made before
    the chunk is tracked (a write reserves its units before its file's close
    tells the policy of it).  ``sized``: a prompt's partial last chunk (only
    Mooncake's traces have keys past the last full chunk's tokens) takes its
    tokens' share of ``chunk_bytes``, as the smaller file an engine stores for it;
    otherwise every chunk takes ``chunk_bytes``.
    """
    result = SimResult(policy.name, capacity_bytes)
    started, used = time.perf_counter(), 0
    sizes: dict[int, int] = {}
    for request in trace:
        hits = prefix_hits(request.keys, policy)
        result.prompt_tokens += request.tokens
        result.hit_tokens += request.hit_tokens(hits)
        result.hit_chunks += hits
        for key in request.keys[:hits]:
            policy.touch(key, request.stream)
        for index, key in enumerate(request.keys[hits:], hits):
            if key in policy:
                continue
            size = chunk_size(request, index, chunk_bytes) if sized else chunk_bytes
            if evict_first:
                used -= _evict(policy, used + size - capacity_bytes, None, sizes, result)
            policy.track(key, size, request.stream)
            sizes[key] = size
            used += size
            result.bytes_written += size
            if not evict_first:
                used -= _evict(policy, used - capacity_bytes, key, sizes, result)
    result.seconds = time.perf_counter() - started
    return result


def chunk_size(request: Request, index: int, chunk_bytes: int) -> int:
    """The bytes of chunk ``index`` of ``request``: its tokens' share of ``chunk_bytes``
    (a full chunk, or the prompt's partial last one; at least one byte)."""
    tokens = request.tokens - index * request.chunk_tokens
    if tokens >= request.chunk_tokens or tokens <= 0:
        return chunk_bytes
    return max(1, chunk_bytes * tokens // request.chunk_tokens)


def _evict(
    policy: EvictionPolicy,
    excess: int,
    keep: int | None,
    sizes: dict[int, int],
    result: SimResult,
) -> int:
    """Remove victims until ``excess`` bytes are freed; return the bytes freed."""
    freed = 0
    if excess <= 0:
        return 0
    for victim in policy.victims():
        if victim == keep:
            continue
        policy.remove(victim)
        result.evictions += 1
        freed += sizes.pop(victim)
        if freed >= excess:
            break
    return freed


def next_uses(trace: Sequence[Request]) -> list[list[int]]:
    """For each request and key, the index of the next request using that key (or INF)."""
    upcoming: dict[int, int] = {}
    result: list[list[int]] = [[] for _ in trace]
    for index in range(len(trace) - 1, -1, -1):
        keys = trace[index].keys
        result[index] = [upcoming.get(key, _INF) for key in keys]
        for key in keys:
            upcoming[key] = index
    return result


@dataclass
class _BeladyCache:
    """Resident set of the offline optimum with a lazy max-heap on (next use, depth)."""

    entries: dict[int, tuple[int, int]] = field(default_factory=dict)
    heap: list[tuple[int, int, int]] = field(default_factory=list)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def set(self, key: int, next_use: int, depth: int) -> None:
        self.entries[key] = (next_use, depth)
        heapq.heappush(self.heap, (-next_use, -depth, key))

    def pop_victim(self, keep: int) -> int | None:
        """Remove and return the resident key used furthest in the future (deepest on ties)."""
        deferred: list[tuple[int, int, int]] = []
        victim = None
        while self.heap:
            item = heapq.heappop(self.heap)
            key = item[2]
            if self.entries.get(key) != (-item[0], -item[1]):
                continue  # stale heap entry
            if key == keep:
                deferred.append(item)
                continue
            victim = key
            del self.entries[key]
            break
        for item in deferred:
            heapq.heappush(self.heap, item)
        return victim


def simulate_belady(
    trace: Sequence[Request],
    capacity_bytes: int,
    chunk_bytes: int = LLAMA3_8B_CHUNK_BYTES,
    sized: bool = False,
) -> SimResult:
    """Replay ``trace`` against the prefix-aware offline optimum (Belady's MIN).

    Same write path as :func:`simulate`; the victim is the resident chunk whose next
    use is furthest away, and on a tie the deepest chunk (largest index in its
    prefix).  Every request using a chunk also uses all of its prefix, so a prefix
    never has a later next use than its chunk: the cached set stays prefix-closed and
    no chunk is kept whose predecessor is gone (such a chunk could not be a hit at its
    next use, only save a rewrite).  Chunks never used again go first.  ``sized``: as
    in :func:`simulate` (the same order; with chunks of two sizes it is a reference
    point, no longer the byte-optimal choice).
    """
    result = SimResult("belady", capacity_bytes)
    started, used = time.perf_counter(), 0
    cache = _BeladyCache()
    sizes: dict[int, int] = {}
    for request, upcoming in zip(trace, next_uses(trace), strict=True):
        hits = prefix_hits(request.keys, cache)
        result.prompt_tokens += request.tokens
        result.hit_tokens += request.hit_tokens(hits)
        result.hit_chunks += hits
        for depth, (key, next_use) in enumerate(zip(request.keys, upcoming, strict=True)):
            if key not in cache:
                size = chunk_size(request, depth, chunk_bytes) if sized else chunk_bytes
                sizes[key] = size
                used += size
                result.bytes_written += size
            cache.set(key, next_use, depth)
            while used > capacity_bytes:
                victim = cache.pop_victim(key)
                if victim is None:
                    break
                used -= sizes.pop(victim)
                result.evictions += 1
    result.seconds = time.perf_counter() - started
    return result


def run_policy(
    name: str,
    trace: Sequence[Request],
    capacity_bytes: int,
    chunk_bytes: int,
    evict_first: bool = False,
) -> SimResult:
    """Simulate policy ``name`` ("belady" or a kvfs.evict.policy name)."""
    if name == "belady":
        return simulate_belady(trace, capacity_bytes, chunk_bytes)
    return simulate(trace, make_policy(name), capacity_bytes, chunk_bytes, evict_first)


# -- replay against a directory ---------------------------------------------------------


def chunk_file_name(key: int, model: str = "model") -> str:
    """Return an LMCache-style file name for ``key``."""
    return f"{model}@1@0@{key:016x}@bfloat16.pt"


def chunk_payload(key: int, size: int) -> bytes:
    """Return the deterministic content of chunk ``key`` (its key bytes, repeated)."""
    pattern = key.to_bytes(8, "little")
    return (pattern * (size // 8 + 1))[:size]


def _read_chunk(path: Path, key: int, size: int) -> bool | None:
    """Read one chunk: True = verified hit, False = miss (ENOENT), None = error."""
    try:
        with open(path, "rb", buffering=0) as file:
            data = file.read(size + 1)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    return True if data == chunk_payload(key, size) else None


def _write_chunk(path: Path, key: int, size: int) -> bool:
    """Write one chunk with a single write(); False on an I/O error (e.g. ENOSPC)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags, 0o644)
        try:
            written = os.write(fd, chunk_payload(key, size))
        finally:
            os.close(fd)
    except OSError:
        return False
    return written == size


def replay(trace: Sequence[Request], directory: Path, chunk_bytes: int = 64 * 1024) -> SimResult:
    """Replay ``trace`` against files in ``directory``; the filesystem does the evicting.

    A hit is a chunk file that reads back whole and correct, counted under the prefix
    rule; a missing file is a miss; a short, long or wrong read or an I/O error counts
    in ``errors`` (and as a miss).  Missing chunks are then written like LMCache does.
    """
    result = SimResult("replay", 0)
    started = time.perf_counter()
    for request in trace:
        result.prompt_tokens += request.tokens
        hits = 0
        for key in request.keys:
            verdict = _read_chunk(directory / chunk_file_name(key), key, chunk_bytes)
            result.errors += verdict is None
            if not verdict:
                break
            hits += 1
        result.hit_tokens += request.hit_tokens(hits)
        result.hit_chunks += hits
        _store_missing(request.keys[hits:], directory, chunk_bytes, result)
    result.seconds = time.perf_counter() - started
    return result


def _store_missing(
    keys: Sequence[int], directory: Path, chunk_bytes: int, result: SimResult
) -> None:
    for index, key in enumerate(keys):
        path = directory / chunk_file_name(key)
        if index > 0 and path.exists():
            continue  # the first key missed or failed to read: always rewrite it
        if _write_chunk(path, key, chunk_bytes):
            result.bytes_written += chunk_bytes
        else:
            result.errors += 1


# -- report -----------------------------------------------------------------------------


def score(
    workloads: Sequence[str],
    policies: Sequence[str],
    fractions: Sequence[float],
    chunk_bytes: int = LLAMA3_8B_CHUNK_BYTES,
    scale: float = 1.0,
    seed: int = 1,
) -> list[dict[str, object]]:
    """Simulate every (workload, capacity fraction, policy); return one row each."""
    rows: list[dict[str, object]] = []
    for workload in workloads:
        trace = make_trace(workload, scale, seed)
        footprint = footprint_chunks(trace) * chunk_bytes
        for fraction in fractions:
            for name in policies:
                result = run_policy(name, trace, int(footprint * fraction), chunk_bytes)
                rows.append(_row(workload, fraction, footprint, result))
    return rows


def _row(workload: str, fraction: float, footprint: int, result: SimResult) -> dict[str, object]:
    row: dict[str, object] = {"workload": workload, "capacity_fraction": fraction}
    row["footprint_bytes"] = footprint
    row.update(asdict(result))
    row["hit_rate"] = round(result.hit_rate, 4)
    row["seconds"] = round(result.seconds, 3)
    return row


def format_table(rows: Sequence[dict[str, object]]) -> str:
    """Render rows as a fixed-width table (hit %, TiB written, evictions)."""
    lines = [
        f"{'workload':9} {'cap':>4} {'policy':7} {'hit %':>6} {'written GiB':>12} {'evictions':>9}",
    ]
    for row in rows:
        written = int(str(row["bytes_written"])) / 2**30
        lines.append(
            f"{row['workload']!s:9} {float(str(row['capacity_fraction'])):4.0%} "
            f"{row['policy']!s:7} {100 * float(str(row['hit_rate'])):6.1f} "
            f"{written:12.0f} {row['evictions']!s:>9}"
        )
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    parser.add_argument(
        "--policies", default=",".join((*POLICY_NAMES, "belady")), help="comma-separated"
    )
    parser.add_argument(
        "--capacities", default="0.1,0.3,0.5", help="fractions of the trace footprint"
    )
    parser.add_argument("--chunk-bytes", type=int, default=LLAMA3_8B_CHUNK_BYTES)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply users/agents")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print JSON rows instead")
    parser.add_argument("--replay", type=Path, metavar="DIR", help="replay into DIR instead")
    parser.add_argument(
        "--replay-chunk-bytes", type=int, default=64 * 1024, help="file size in --replay"
    )
    return parser.parse_args(argv)


def _run_replay(args: argparse.Namespace, workloads: Sequence[str]) -> int:
    if not args.replay.is_dir():
        print(f"kvtrace: {args.replay} is not a directory", file=sys.stderr)
        return 2
    rows = []
    for workload in workloads:
        trace = make_trace(workload, args.scale, args.seed)
        result = replay(trace, args.replay, args.replay_chunk_bytes)
        rows.append(_row(workload, 0.0, 0, result))
        if not args.json:
            print(
                f"{workload}: token hit rate {result.hit_rate:.1%}, "
                f"{result.bytes_written} bytes written, {result.errors} errors, "
                f"{result.seconds:.1f} s"
            )
    if args.json:
        print(json.dumps(rows, indent=1))
    return 1 if any(row["errors"] for row in rows) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; see the module docstring for exit codes."""
    args = _parse_args(argv)
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    try:
        policies = [name for name in args.policies.split(",") if name]
        fractions = [float(text) for text in args.capacities.split(",") if text]
        for name in policies:
            if name != "belady" and name not in POLICY_NAMES:
                raise ValueError(f"unknown policy {name!r}")
        if args.chunk_bytes <= 0 or args.replay_chunk_bytes <= 0 or args.scale <= 0:
            raise ValueError("sizes and scale must be positive")
    except ValueError as error:
        print(f"kvtrace: {error}", file=sys.stderr)
        return 2
    if args.replay is not None:
        return _run_replay(args, workloads)
    rows = score(workloads, policies, fractions, args.chunk_bytes, args.scale, args.seed)
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
