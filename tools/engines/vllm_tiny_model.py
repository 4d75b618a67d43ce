"""Build a tiny, randomly initialised Llama for vLLM, entirely offline.

A few layers and a small hidden size (``transformers.LlamaForCausalLM`` with a fixed
seed, saved as safetensors) plus a byte-level BPE tokenizer trained here with the
``tokenizers`` library on a generated corpus (deterministic: same seed, same files).
Nothing is downloaded. Run with the vLLM venv's python::

    python tools/engines/vllm_tiny_model.py OUT_DIR

The KV cache of one token is ``2 * layers * kv_heads * head_dim * 4`` bytes in fp32
(the defaults: 8 KiB; tools/engines/vllm_serve_bench.py uses 8 KV heads of 128: 32 KiB,
one 256-token chunk file of 8 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

VOCAB = 512  # byte-level BPE: 256 bytes + merges + specials (padded model vocab)
WORDS = [
    *("cache", "block", "chunk", "prefix", "token", "layer", "head", "value", "key"),
    *("tensor", "engine", "serve", "prompt", "user", "agent", "context", "tier"),
    *("disk", "file", "store", "load", "evict", "hit", "miss", "page"),
]


def corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def build_tokenizer(out: Path, seed: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


def build(
    out: Path,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 4,
    seed: int = 0,
    init_std: float = 0.2,
    head_dim: int | None = None,
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    stamp = out / ".kvfs-tiny-model"
    spec = json.dumps(
        {
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "kv_heads": kv_heads,
            "seed": seed,
            "init_std": init_std,
            "head_dim": head_dim,
        }
    )
    if stamp.exists() and stamp.read_text() == spec:
        return out
    n_tok = build_tokenizer(out, seed)
    assert n_tok <= VOCAB, n_tok
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=8192,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        # far wider than a trained model's init: a random model whose greedy
        # tokens depend on the whole context (a wrong KV block changes them)
        initializer_range=init_std,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    stamp.write_text(spec)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-std", type=float, default=0.2)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = build(Path(a.out), a.layers, a.hidden, a.heads, a.kv_heads, a.seed, a.init_std, a.head_dim)
    print(json.dumps({"model": str(d)}))


if __name__ == "__main__":
    main()
