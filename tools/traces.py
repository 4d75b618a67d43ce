"""The trace suite: generators after published workload descriptions, and real traces.

Every trace is a list of ``kvtrace.Request`` (the chunk keys of a prompt, its token
count, the stream that sent it, the chunk size in tokens). Keys are prefix hashes:
two requests share key i exactly when their first i + 1 chunks are identical.

Generators (each seeded, each with a "train" and a "held-out" parameter set that
differ in shape, not only in seed; ``docs/eviction.md`` says which is which):

- ``vllm-qa``: vLLM production-stack's multi-round QA benchmark (shared 1000-token
  system prompt, a long per-user history, 100-token questions and answers, users
  arriving at a fixed rate, a bounded number of concurrent users, each round sent
  after the previous answer plus a think time);
- ``sharegpt``: ShareGPT-like conversations (turn counts and per-turn prompt and
  answer lengths drawn from log-normal fits of the published ShareGPT statistics:
  median ~3 turns with a long tail, user turns of tens to hundreds of tokens,
  answers of a few hundred), a short shared system prompt, Poisson session arrivals;
- ``agent-fanout``: agents that share one of a few long system prompts (tool
  definitions), grow a context by tool outputs turn by turn and fan out to several
  parallel sub-requests per turn (tool calls) that share the context;
- ``docqa-mix``: long-document QA (documents of 4k-32k tokens chosen by a Zipf law,
  several questions per document visit) interleaved with short chat sessions.

Real traces: ``load_mooncake(path)`` reads a Mooncake FAST'25 trace (JSON lines with
``hash_ids`` of 512-token blocks; github.com/kvcache-ai/Mooncake, ``FAST25-release/
traces``, Apache-2.0). The files are not committed (3 MB and 1.1 MB); get them with
``git clone --depth 1 https://github.com/kvcache-ai/Mooncake`` and pass the
``FAST25-release/traces`` directory as ``--mooncake DIR`` to ``tools/trace_suite.py``.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtrace import Piece, Request, make_request, make_trace

MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_FILES = {
    "mooncake-conversation": "conversation_trace.jsonl",
    "mooncake-synthetic": "synthetic_trace.jsonl",
}


@dataclass(frozen=True)
class Trace:
    """A named trace of the suite, with its split."""

    name: str
    split: str  # "train" or "held-out"
    requests: list[Request]
    source: str


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _timeline(events: list[tuple[float, int, Request]]) -> list[Request]:
    events.sort(key=lambda event: (event[0], event[1]))
    return [request for _, _, request in events]


def vllm_qa(
    users: int = 48,
    concurrent: int = 16,
    rounds: int = 10,
    history: int = 8000,
    qps_users: float = 0.4,
    think: float = 6.0,
    engines: int = 1,
    seed: int = 1,
) -> list[Request]:
    """Multi-round QA after vLLM production-stack's benchmark (scaled down in users
    and history length; the canonical run is 320 users x 10 rounds, 20k history).

    Users arrive ``qps_users`` per second while fewer than ``concurrent`` are active;
    a user's next round starts an answer time (100 tokens) plus an exponential think
    time of mean ``think`` seconds after the previous one.
    """
    rng = random.Random(seed)
    events: list[tuple[float, int, Request]] = []
    active: list[float] = []  # end times of the users in the system (a heap)
    start = 0.0
    for user in range(users):
        start += rng.expovariate(qps_users)
        while active and active[0] <= start:
            heapq.heappop(active)
        if len(active) >= concurrent:
            start = heapq.heappop(active)
        when = start
        pieces: list[Piece] = [("system", 1000), (f"h{user}", history)]
        for round_ in range(rounds):
            pieces.append((f"q{user}.{round_}", 100))
            events.append((when, user, make_request(list(pieces), user % engines)))
            pieces.append((f"a{user}.{round_}", 100))
            when += 2.0 + rng.expovariate(1.0 / think)
        heapq.heappush(active, when)
    return _timeline(events)


def sharegpt(
    sessions: int = 300,
    rate: float = 1.0,
    system: int = 300,
    turn_median: float = 3.0,
    engines: int = 1,
    seed: int = 1,
) -> list[Request]:
    """ShareGPT-like chat: Poisson session arrivals, log-normal turn counts (median
    ``turn_median``, capped at 30), user turns median 60 tokens, answers median 300,
    think time 5-60 s; every turn re-sends the conversation so far."""
    rng = random.Random(seed)
    events: list[tuple[float, int, Request]] = []
    when = 0.0
    for session in range(sessions):
        when += rng.expovariate(rate)
        turns = _lognormal(rng, turn_median, 0.9, 1, 30)
        at = when
        pieces: list[Piece] = [("system", system)]
        for turn in range(turns):
            pieces.append((f"u{session}.{turn}", _lognormal(rng, 60, 1.2, 4, 4000)))
            events.append((at, session, make_request(list(pieces), session % engines)))
            pieces.append((f"r{session}.{turn}", _lognormal(rng, 300, 0.7, 10, 2000)))
            at += rng.uniform(5.0, 60.0)
    return _timeline(events)


def agent_fanout(
    agents: int = 40,
    prompts: int = 3,
    system: int = 3000,
    turns: tuple[int, int] = (4, 16),
    fanout: tuple[int, int] = (1, 5),
    tool_tokens: tuple[float, float] = (600.0, 1.0),
    rate: float = 0.2,
    engines: int = 1,
    seed: int = 1,
) -> list[Request]:
    """Agents with tool-call fan-out and shared system prompts.

    Each agent uses one of ``prompts`` long system prompts (tool definitions), adds
    a task, and per turn fans out to a random number of parallel tool-call requests
    (each the shared context plus its own call); the tool outputs (log-normal,
    median ``tool_tokens[0]``) are then appended to the context for the next turn.
    """
    rng = random.Random(seed)
    events: list[tuple[float, int, Request]] = []
    when = 0.0
    for agent in range(agents):
        when += rng.expovariate(rate)
        at = when
        pieces: list[Piece] = [(f"sys{rng.randrange(prompts)}", system)]
        pieces.append((f"task{agent}", _lognormal(rng, 400, 0.5, 50, 3000)))
        for turn in range(rng.randint(*turns)):
            width = rng.randint(*fanout)
            for branch in range(width):
                call = (f"call{agent}.{turn}.{branch}", _lognormal(rng, 80, 0.5, 8, 600))
                request = make_request([*pieces, call], (agent + branch) % engines)
                events.append((at + branch * 1e-3, agent, request))
            for branch in range(width):
                median, sigma = tool_tokens
                pieces.append(
                    (f"out{agent}.{turn}.{branch}", _lognormal(rng, median, sigma, 20, 8000))
                )
            at += rng.uniform(1.0, 8.0)
    return _timeline(events)


def docqa_mix(
    documents: int = 60,
    visits: int = 150,
    zipf: float = 1.1,
    questions: tuple[int, int] = (1, 4),
    doc_tokens: tuple[int, int] = (4000, 32000),
    chats: int = 150,
    engines: int = 1,
    seed: int = 1,
) -> list[Request]:
    """Long-document QA mixed with chat: a visit picks a document by a Zipf law and
    asks a few questions about it (document + question, 1-4 in a row); chat
    sessions (as in :func:`sharegpt`) arrive in between."""
    rng = random.Random(seed)
    lengths = [rng.randint(*doc_tokens) for _ in range(documents)]
    weights = [1.0 / (rank + 1) ** zipf for rank in range(documents)]
    events: list[tuple[float, int, Request]] = []
    when = 0.0
    for visit in range(visits):
        when += rng.expovariate(0.5)
        doc = rng.choices(range(documents), weights)[0]
        for question in range(rng.randint(*questions)):
            pieces: list[Piece] = [("docsys", 200), (f"doc{doc}", lengths[doc])]
            pieces.append((f"dq{visit}.{question}", _lognormal(rng, 50, 0.6, 8, 400)))
            events.append((when + 3.0 * question, visit, make_request(pieces, 0)))
    chat = sharegpt(sessions=chats, rate=chats / max(when, 1.0), engines=engines, seed=seed + 1)
    return _merge(_timeline(events), chat, rng)


def _merge(a: list[Request], b: list[Request], rng: random.Random) -> list[Request]:
    """Interleave two traces at random, each keeping its own order."""
    out: list[Request] = []
    i = j = 0
    while i < len(a) or j < len(b):
        take_a = j >= len(b) or (i < len(a) and rng.random() < len(a) / (len(a) + len(b)))
        if take_a:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out


def load_mooncake(path: Path, limit: int | None = None) -> list[Request]:
    """Read a Mooncake trace: one request per line, ``hash_ids`` are 512-token prefix
    block ids (equal ids = equal prefix up to that block); one engine (stream 0)."""
    requests: list[Request] = []
    with path.open() as lines:
        for line in lines:
            if not line.strip():
                continue
            row = json.loads(line)
            keys = tuple(int(key) for key in row["hash_ids"])
            tokens = int(row["input_length"])
            requests.append(Request(keys, tokens, 0, MOONCAKE_BLOCK_TOKENS))
            if limit is not None and len(requests) >= limit:
                break
    return requests


# -- the suite ----------------------------------------------------------------------------

Generator = Callable[[], list[Request]]

SUITE: dict[str, tuple[str, str, Generator]] = {
    # name: (split, source, generator)
    "qa": ("train", "kvtrace qa (ours)", lambda: make_trace("qa")),
    "qa-steady": ("train", "kvtrace qa-steady (ours)", lambda: make_trace("qa-steady")),
    "agentic": ("train", "kvtrace agentic (ours)", lambda: make_trace("agentic")),
    "vllm-qa": ("train", "vLLM production-stack multi-round QA", vllm_qa),
    "sharegpt": ("train", "ShareGPT-like chat", sharegpt),
    "agent-fanout": ("train", "agentic, tool-call fan-out", agent_fanout),
    "docqa-mix": ("train", "long-document QA + chat", docqa_mix),
    # held out: other shapes and seeds, never looked at while tuning
    "vllm-qa-h": (
        "held-out",
        "vLLM multi-round QA, 64 users / 24 at a time, 12k history, seed 11",
        lambda: vllm_qa(users=64, concurrent=24, history=12000, think=4.0, seed=11),
    ),
    "sharegpt-h": (
        "held-out",
        "ShareGPT-like, 400 sessions, longer turns, 2 engines, seed 12",
        lambda: sharegpt(sessions=400, rate=1.5, turn_median=4.0, engines=2, seed=12),
    ),
    "agent-fanout-h": (
        "held-out",
        "agentic fan-out, 5 prompts, wider fan-out, seed 13",
        lambda: agent_fanout(agents=50, prompts=5, fanout=(2, 8), seed=13),
    ),
    "docqa-mix-h": (
        "held-out",
        "document QA + chat, 100 documents, flatter Zipf, seed 14",
        lambda: docqa_mix(documents=100, visits=200, zipf=0.8, seed=14),
    ),
}


def suite(mooncake: Path | None = None, names: Sequence[str] | None = None) -> list[Trace]:
    """Build the suite (optionally only ``names``); Mooncake's traces (held out)
    join when ``mooncake`` is the directory holding them."""
    traces: list[Trace] = []
    for name, (split, source, generate) in SUITE.items():
        if names is None or name in names:
            traces.append(Trace(name, split, generate(), source))
    if mooncake is not None:
        for name, file in MOONCAKE_FILES.items():
            path = mooncake / file
            if (names is None or name in names) and path.exists():
                traces.append(Trace(name, "held-out", load_mooncake(path), f"Mooncake {file}"))
    return traces
