"""The LMCache plugin's landing memory (:mod:`kvfs.client.lmcache`) when it cannot be
made: a retrieve still gets a memory object, LMCache's own, and nothing is held.
The landing itself, with the real LMCache, is in ``tests/engines/test_direct.py``."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import kvfs.client.direct
from kvfs.client import lmcache


class _Dtype:
    itemsize = 2


class _Key:
    """A CacheEngineKey's part the plugin uses (hashable, a file name)."""

    def to_string(self) -> str:
        return "model@1@0@abc"


def _backend(tmp_path: Path, landing_chunks: int) -> tuple[Any, list[tuple[Any, ...]]]:
    asked: list[tuple[Any, ...]] = []

    def allocate(*args: Any) -> str:
        asked.append(args)
        return "lmcache's own object"

    cpu = SimpleNamespace(allocate=allocate)
    meta = SimpleNamespace(
        use_mla=False, get_shapes=lambda: [(4, 1024)], get_dtypes=lambda: [_Dtype()]
    )
    config = SimpleNamespace(
        extra_config={"kvfs.path": str(tmp_path), "kvfs.landing_chunks": landing_chunks}
    )
    return lmcache._Backend(config=config, metadata=meta, local_cpu_backend=cpu), asked


def test_a_retrieve_without_landing_memory_gets_lmcaches_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(n: int) -> Any:
        raise OSError(errno.ENOMEM, "no memory for the landing")

    monkeypatch.setattr(kvfs.client.direct, "aligned", no_memory)
    key = _Key()
    for chunks in (16, 0):
        backend, asked = _backend(tmp_path, chunks)
        Path(backend.key_path(key)).write_bytes(bytes(backend.full_chunk_bytes()))
        try:
            assert backend._allocate(key) == "lmcache's own object"
            assert backend._allocate(key) == "lmcache's own object"  # tried once only
            assert len(asked) == 2 and backend.landing_in_use() == 0
            assert backend._landing is None and backend._landing_bytes == 0
        finally:
            backend.close()
