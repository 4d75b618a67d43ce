"""How ``policy-v2.bin.gz`` was made: the version 2 policy images (every column
chunk at its column's code; commit 3af337e) of the policies after :func:`workload`,
kept so that every later release is tested against real bytes of that version. Run
from a checkout of that release:

    cd <checkout of 3af337e> && PYTHONPATH=. <venv>/bin/python <this file> OUTDIR

The file: per policy (``NAMES``), a 4-byte little-endian length and the image.
"""

from __future__ import annotations

import gzip
import random
import sys
from pathlib import Path

NAMES = ("kvfs", "lru", "prefix-lru")


def workload(policy: object, seed: int = 5, count: int = 6000) -> None:
    """Keys over three 1024-row chunks, sizes up to past 2^32 (a widened chunk),
    prefix streams, touches, removals and evictions (ghosts)."""
    rng = random.Random(seed)
    for _ in range(count):
        key, op, stream = rng.randrange(3000), rng.random(), rng.randrange(6)
        if op < 0.5:
            size = rng.randrange(1, 1 << 21) if rng.random() < 0.99 else 5 << 32
            policy.track(key, size, stream)  # type: ignore[attr-defined]
        elif op < 0.8:
            policy.touch(key, stream)  # type: ignore[attr-defined]
        elif op < 0.9:
            policy.remove(key)  # type: ignore[attr-defined]
        elif len(policy):  # type: ignore[arg-type]
            policy.remove(next(policy.victims()))  # type: ignore[attr-defined]


def main(out: Path) -> None:
    from kvfs.policy import make_policy

    parts = []
    for name in NAMES:
        policy = make_policy(name)
        workload(policy)
        image = policy.persist()
        parts.append(len(image).to_bytes(4, "little") + image)
    with gzip.open(out / "policy-v2.bin.gz", "wb", compresslevel=9) as f:
        f.write(b"".join(parts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
