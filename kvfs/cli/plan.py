"""``kvfs plan``: what a pool holds for a model, before formatting it.

From a model's shape (a Hugging Face ``config.json`` or the built-in table below):

- KV bytes per token: ``2 * layers * kv_heads * head_dim * dtype bytes`` (K and V of
  every layer; GQA/MQA through ``kv_heads``); for MLA (DeepSeek-V2/V3) the cached
  latent, ``layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes``, as the
  engines that support MLA store it;
- the chunk file an engine writes: ``tokens per chunk * bytes per token`` (LMCache
  256-token chunks, vLLM's fs tier 16-token blocks, SGLang 64-token pages: the engine
  tests check these sizes against the files the real engines write);
- the pool: the same geometry ``kvfs format`` computes (metadata area sized for that
  chunk size, data units), how many chunks and tokens it holds, and how many contexts
  of ``--context-tokens`` that is;
- the ``kvfs format`` line to use, with the recommended ``--unit-size``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from kvfs.common.errors import UserError
from kvfs.common.sizes import format_size, parse_size

HELP = "what a pool holds for a model: chunk size, tokens, unit size"
EXIT_OK = 0
FRAGMENT = 4096
"""A chunk's tail past its last whole unit is stored in 4 KiB fragments."""

DTYPES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}  # fmt: skip
"""KV cache element sizes by the names configs and engines use."""


@dataclass(frozen=True)
class Shape:
    """What decides a model's KV bytes per token."""

    name: str
    layers: int
    kv_heads: int = 0
    head_dim: int = 0
    latent: int = 0
    """MLA: the cached latent per layer and token (``kv_lora_rank + qk_rope_head_dim``)."""
    dtype: str = "bfloat16"

    def bytes_per_token(self, dtype: str | None = None) -> int:
        size = DTYPES[dtype or self.dtype]
        if self.latent:
            return self.layers * self.latent * size
        return 2 * self.layers * self.kv_heads * self.head_dim * size


MODELS = {
    s.name.lower(): s
    for s in (
        Shape("Llama-3-8B", 32, 8, 128),
        Shape("Llama-3-70B", 80, 8, 128),
        Shape("Llama-3.1-405B", 126, 8, 128),
        Shape("Mistral-7B", 32, 8, 128),
        Shape("Qwen2.5-7B", 28, 4, 128),
        Shape("Qwen2.5-32B", 64, 8, 128),
        Shape("Qwen2.5-72B", 80, 8, 128),
        Shape("Qwen3-8B", 36, 8, 128),
        Shape("DeepSeek-V3", 61, latent=512 + 64),
    )
}
"""Common models (layers, KV heads, head dim from their published configs)."""
ENGINE_CHUNKS = {"lmcache": 256, "vllm": 16, "sglang": 64}
"""Tokens per file each engine's disk backend writes by default."""


def load_shape(model: str) -> Shape:
    """A built-in model by name (any case), or a Hugging Face ``config.json``."""
    if model.lower() in MODELS:
        return MODELS[model.lower()]
    if not os.path.exists(model):
        known = ", ".join(s.name for s in MODELS.values())
        raise UserError(f"--model {model}: not a config.json or a known model ({known})")
    try:
        with open(model) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"--model {model}: cannot read it as JSON ({e})") from None
    return shape_of(cfg, os.path.basename(os.path.dirname(os.path.abspath(model))) or model)


def shape_of(cfg: dict[str, Any], name: str) -> Shape:
    """A model's shape from its config (a multimodal config's ``text_config``)."""
    cfg = cfg.get("text_config") or cfg
    try:
        layers = int(cfg["num_hidden_layers"])
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        if dtype not in DTYPES:
            raise UserError(f"config dtype {dtype!r} unknown: give --dtype")
        if cfg.get("kv_lora_rank"):
            latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))
            return Shape(name, layers, latent=latent, dtype=dtype)
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"config.json of {name}: missing or bad field {e}") from None
    return Shape(name, layers, kv_heads, head_dim, dtype=dtype)


@dataclass(frozen=True)
class Plan:
    model: str
    dtype: str
    bytes_per_token: int
    chunk_tokens: int
    chunk_bytes: int
    pool_bytes: int
    devices: int
    unit_size: int
    meta_bytes: int
    data_bytes: int
    stored_bytes_per_chunk: int
    chunks: int
    tokens: int
    chunks_kept: int
    """At the low watermark, where eviction holds a full pool."""
    high_watermark: float
    low_watermark: float
    """The mount's default watermarks for this pool (eviction holds a full pool
    between them)."""
    context_tokens: int
    contexts: int
    format_command: str


UNIT_BUDGET = 1 << 26
"""Units a pool should have at most: the index keeps a map slot and a checksum per
mapped unit (16 bytes of checkpoint and of memory), so 2^26 units are ~1 GiB of it."""


def recommend_unit(pool_bytes: int) -> int:
    """1 MiB (the default, where every benchmark in docs/ ran) unless the pool would
    then have more than :data:`UNIT_BUDGET` units; then the next powers of two, up
    to 16 MiB (a 245 TB drive: 4 MiB). Chunks not a multiple of the unit lose nothing:
    their tails go to 4 KiB fragments."""
    unit = 1 << 20
    while unit < 16 << 20 and pool_bytes // unit > UNIT_BUDGET:
        unit *= 2
    return unit


def make_plan(
    shape: Shape,
    pool_bytes: int,
    chunk_tokens: int,
    dtype: str | None = None,
    context_tokens: int = 32768,
    devices: int = 1,
    unit_size: int = 0,
) -> Plan:
    from kvfs.evict.driver import default_watermarks
    from kvfs.format.geometry import new_pool, unit_for

    per_token = shape.bytes_per_token(dtype)
    chunk = per_token * chunk_tokens
    unit = unit_size or recommend_unit(pool_bytes)
    member = pool_bytes // devices
    targets = [_Target(f"member{i}", member) for i in range(devices)]
    unit = unit_for(targets, unit)
    sbs = new_pool(targets, unit, 0, "", mean_file_size=chunk)
    data = sum(sb.data_units for sb in sbs) * unit
    whole, tail = divmod(chunk, unit)
    stored = whole * unit + -(-tail // FRAGMENT) * FRAGMENT
    chunks = data // stored
    high, low = default_watermarks(data, devices)
    kept = int(data * low) // stored
    command = "kvfs format DEVICE" + (" DEVICE" * (devices - 1))
    command += f" --unit-size {unit >> 20}M"
    command += f" --mean-file-size {chunk}"
    return Plan(
        model=shape.name,
        dtype=dtype or shape.dtype,
        bytes_per_token=per_token,
        chunk_tokens=chunk_tokens,
        chunk_bytes=chunk,
        pool_bytes=pool_bytes,
        devices=devices,
        unit_size=unit,
        meta_bytes=sbs[0].meta_size,
        data_bytes=data,
        stored_bytes_per_chunk=stored,
        chunks=chunks,
        tokens=chunks * chunk_tokens,
        chunks_kept=kept,
        high_watermark=high,
        low_watermark=low,
        context_tokens=context_tokens,
        contexts=kept * chunk_tokens // context_tokens,
        format_command=command,
    )


@dataclass(frozen=True)
class _Target:
    path: str
    size: int
    logical_block: int = 4096
    optimal_io: int = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ", ".join(s.name for s in MODELS.values())
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME|config.json",
        help=f"a Hugging Face config.json, or one of: {names}",
    )
    p.add_argument(
        "--pool", required=True, type=_size, metavar="SIZE", help="the pool's size (e.g. 4T)"
    )
    p.add_argument(
        "--chunk-tokens",
        type=_positive,
        default=256,
        metavar="N",
        help="tokens per file the engine writes (256: LMCache; vLLM fs tier 16, SGLang 64)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        metavar="DTYPE",
        help="KV cache dtype (default: the config's, else bf16; fp8 halves it)",
    )
    p.add_argument(
        "--context-tokens",
        type=_positive,
        default=32768,
        metavar="N",
        help="tokens of one context, for the count of contexts held (32768)",
    )
    p.add_argument(
        "--devices", type=_positive, default=1, metavar="N", help="members the pool spans (1)"
    )
    p.add_argument(
        "--unit-size", type=_size, default=0, metavar="SIZE", help="plan for this unit instead"
    )
    p.add_argument("--json", action="store_true", help="the plan as JSON")


def _size(text: str) -> int:
    value = parse_size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be more than 0 bytes")
    return value


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"{text}: a whole number above 0")
    return int(text)


def run(args: argparse.Namespace) -> int:
    shape = load_shape(args.model)
    p = make_plan(
        shape, args.pool, args.chunk_tokens, args.dtype, args.context_tokens,
        args.devices, args.unit_size,
    )  # fmt: skip
    if args.json:
        print(json.dumps(asdict(p), indent=2))
        return EXIT_OK
    if shape.latent:
        kind = f"{shape.layers} layers x MLA latent {shape.latent}"
    else:
        kind = f"{shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim}"
    print(f"model          {p.model}: {kind}, {p.dtype}")
    print(f"KV per token   {format_size(p.bytes_per_token)} ({p.bytes_per_token:,} bytes)")
    print(
        f"chunk file     {p.chunk_tokens} tokens = {format_size(p.chunk_bytes)} "
        f"({p.chunk_bytes:,} bytes)"
    )
    print(
        f"pool           {format_size(p.pool_bytes)} on {p.devices} device(s): "
        f"{format_size(p.meta_bytes)} metadata, {format_size(p.data_bytes)} for data"
    )
    print(f"unit size      {format_size(p.unit_size)}")
    print(
        f"holds          {p.chunks:,} chunks = {p.tokens:,} tokens "
        f"({format_size(p.stored_bytes_per_chunk)} stored per chunk)"
    )
    print(
        f"kept           {p.chunks_kept:,} chunks once full (eviction keeps "
        f"{format_size(int(p.data_bytes * (1 - p.high_watermark)))}-"
        f"{format_size(int(p.data_bytes * (1 - p.low_watermark)))} free) = "
        f"{p.contexts:,} contexts of {p.context_tokens:,} tokens"
    )
    print(f"format with    {p.format_command}")
    return EXIT_OK


__all__ = ["HELP", "MODELS", "Plan", "Shape", "add_arguments", "load_shape", "make_plan", "run"]
