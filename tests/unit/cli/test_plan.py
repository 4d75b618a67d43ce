"""``kvfs plan``: KV bytes per token from published model shapes (MHA/GQA and MLA),
a config.json read as the engines read it, the pool arithmetic checked against a real
``kvfs format`` of the size planned (data capacity) and a real chunk's allocation,
and one-line errors. The chunk sizes the real engines write are checked against the
plan in tests/engines/test_engines.py and tests/engines/test_vllm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfs.cli import plan
from kvfs.common.errors import UserError
from kvfs.testing import harness
from tests.conftest import KvfsMount, pattern

KiB, MiB = 1 << 10, 1 << 20


def kvfs(*args: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvfs", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("model", "per_token"),
    [
        ("Llama-3-8B", 128 * KiB),  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
        ("llama-3-70b", 320 * KiB),  # 80 layers
        ("Qwen2.5-7B", 56 * KiB),  # 28 layers x 4 KV heads
        ("DeepSeek-V3", 61 * 576 * 2),  # MLA: 61 layers x (512 latent + 64 rope) x bf16
    ],
)
def test_bytes_per_token(model: str, per_token: int) -> None:
    assert plan.load_shape(model).bytes_per_token() == per_token


def test_dtype_changes_the_size() -> None:
    shape = plan.load_shape("Llama-3-8B")
    assert shape.bytes_per_token("fp8") * 2 == shape.bytes_per_token() == 128 * KiB
    assert shape.bytes_per_token("float32") == 256 * KiB


def test_config_json(tmp_path: Path) -> None:
    gqa = {  # the fields of Meta-Llama-3-8B's config.json
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(gqa))
    shape = plan.load_shape(str(tmp_path / "llama" / "config.json"))
    assert shape.name == "llama" and shape.head_dim == 128
    assert shape.bytes_per_token() == 128 * KiB
    mla = {  # DeepSeek-V3's
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "hidden_size": 7168,
        "torch_dtype": "bfloat16",
    }
    assert plan.shape_of(mla, "dsv3").bytes_per_token() == 70272
    mm = {"text_config": {**gqa, "torch_dtype": "float16"}}  # a multimodal config
    assert plan.shape_of(mm, "mm").bytes_per_token() == 128 * KiB
    with pytest.raises(UserError, match="missing or bad field"):
        plan.shape_of({"num_hidden_layers": 2}, "broken")


def test_plan_matches_a_real_format(tmp_path: Path) -> None:
    pool = 256 * MiB
    p = plan.make_plan(plan.load_shape("Qwen2.5-7B"), pool, 16)  # vLLM blocks: 896 KiB
    assert p.chunk_bytes == 896 * KiB and p.unit_size == MiB
    assert p.stored_bytes_per_chunk == 896 * KiB  # a tail in fragments, not a whole unit
    img = harness.make_image(tmp_path / "pool.img", pool)
    words = p.format_command.split()
    assert words[:3] == ["kvfs", "format", "DEVICE"]
    r = kvfs("format", img, *words[3:])
    assert r.returncode == 0, r.stderr
    mount = KvfsMount(tmp_path / "mnt", [str(img)], tmp_path / "kvfs.log", [])
    mount.start()
    try:
        assert mount.stats()["store"]["capacity_bytes"] == p.data_bytes
        blob = pattern("chunk", p.chunk_bytes)
        harness.write_file(mount.path / "c", blob)
        assert (mount.path / "c").read_bytes() == blob
        assert os.stat(mount.path / "c").st_blocks * 512 == p.stored_bytes_per_chunk
    finally:
        mount.close()
    assert p.chunks == p.data_bytes // p.stored_bytes_per_chunk
    assert p.tokens == p.chunks * 16
    assert p.contexts == p.chunks_kept * 16 // 32768


def test_unit_grows_only_for_huge_pools() -> None:
    shape = plan.load_shape("Llama-3-8B")
    assert plan.make_plan(shape, 4 << 40, 256).unit_size == MiB
    big = plan.make_plan(shape, 245 * 10**12, 256, devices=4)
    assert big.unit_size == 4 * MiB and big.data_bytes // big.unit_size <= plan.UNIT_BUDGET
    assert "--unit-size 4M" in big.format_command
    assert big.format_command.count("DEVICE") == 4


def test_cli_text_json_and_errors(tmp_path: Path) -> None:
    r = kvfs("plan", "--model", "Llama-3-8B", "--pool", "4T")
    assert r.returncode == 0, r.stderr
    assert "chunk file     256 tokens = 32.0 MiB (33,554,432 bytes)" in r.stdout, r.stdout
    r = kvfs("plan", "--model", "DeepSeek-V3", "--pool", "1T", "--json")
    data = json.loads(r.stdout)
    assert data["bytes_per_token"] == 70272 and data["chunk_bytes"] == 70272 * 256
    for bad in (
        ["--model", "nope", "--pool", "1T"],
        ["--model", "Llama-3-8B", "--pool", "-1T"],
        ["--model", "Llama-3-8B", "--pool", "1T", "--chunk-tokens", "0"],
        ["--model", str(tmp_path), "--pool", "1T"],  # a directory is not a config.json
    ):
        r = kvfs("plan", *bad)
        assert r.returncode != 0 and r.stdout == "", bad
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
