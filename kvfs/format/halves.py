"""The metadata area's two log halves and the checkpoint that starts each one
(``docs/format.md``, "Metadata area: two log halves").

Pure: offsets and bytes only. The journal (:mod:`kvfs.log.journal`) writes these halves
live, piece by piece; recovery (:mod:`kvfs.log.recovery`) reads them back.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from kvfs.format.records import (
    ALIGN,
    KIND_CKPT_BEGIN,
    KIND_CKPT_DATA,
    KIND_CKPT_END,
    Op,
    commit_entry,
    encode_entry,
    encode_ops,
)

CKPT_OPS = 1024
"""Operations per checkpoint entry: ~100 KiB, one ``next()`` of the snapshot, 8 ms on
the loaded 2-core test VM (4096 took 30-48 ms there: the loop stops for one piece)."""


def half_bounds(meta_start: int, meta_size: int, half: int) -> tuple[int, int]:
    """(offset, size) of half 0 or 1 of the metadata area, each a whole number of
    4096-byte blocks."""
    size = (meta_size // 2) // ALIGN * ALIGN
    return meta_start + half * size, size


def checkpoint_end(generation: int, seq: int, count: int, seed: int) -> bytes:
    """The CKPT_END entry of a checkpoint of ``count`` CKPT_DATA entries."""
    return encode_entry(KIND_CKPT_END, generation, seq, count.to_bytes(8, "little"), seed)


def checkpoint_pieces(ops: Iterable[Op], per_piece: int = 0) -> Iterator[bytes]:
    """CKPT_DATA payloads of ``per_piece`` (default CKPT_OPS) operations each, encoded
    lazily: the next piece is taken from ``ops`` only when asked for."""
    per_piece = per_piece or CKPT_OPS
    it = iter(ops)
    while batch := list(itertools.islice(it, per_piece)):
        yield encode_ops(batch)


def encode_checkpoint(
    ops: Iterable[Op], generation: int, seq: int, seed: int
) -> tuple[bytes, int, int]:
    """A whole checkpoint, ending in a COMMIT: (bytes, last sequence number, op count).
    Offline tools only (format, fsck --repair, tools/mounttime.py); the journal
    writes live checkpoints piece by piece."""
    pieces = [encode_entry(KIND_CKPT_BEGIN, generation, seq + 1, b"", seed)]
    seq += 1
    count = 0

    def counted() -> Iterator[Op]:
        nonlocal count
        for op in ops:
            count += 1
            yield op

    for payload in checkpoint_pieces(counted()):
        seq += 1
        pieces.append(encode_entry(KIND_CKPT_DATA, generation, seq, payload, seed))
    n_data = len(pieces) - 1  # CKPT_END holds the number of CKPT_DATA entries
    seq += 1
    pieces.append(checkpoint_end(generation, seq, n_data, seed))
    seq += 1
    pieces.append(commit_entry(generation, seq, seed))
    return b"".join(pieces), seq, count
