"""A vLLM offloading spec for the CPU build: vLLM's own tiering, a host-memory copy.

vLLM 0.32's ``TieringOffloadingSpec`` (CPU primary tier + secondary tiers such as
``fs``) refuses to build its worker unless the platform is CUDA-alike or XPU: its
``CPUOffloadingWorker`` copies blocks with CUDA streams and the ``swap_blocks`` DMA
kernels. On the CPU build the "device" KV cache already lives in host memory, so the
only thing missing is a device<->CPU-tier copy that is a plain memory copy.

:class:`HostTieringSpec` subclasses ``TieringOffloadingSpec`` and replaces only the
worker: the scheduler side (``OffloadingConnectorScheduler``,
``TieringOffloadingManager``, the CPU primary tier and its eviction policy, every
secondary tier, back-pressure, the shared ``/dev/shm`` offload region whose
memoryview the ``fs`` tier reads and writes) is vLLM's, unchanged. Load it with the
connector's out-of-tree hook::

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {
        "spec_name": "HostTieringSpec", "spec_module_path": "vllm_host_spec",
        "cpu_bytes_to_use": ..., "secondary_tiers": [{"type": "fs", "root_dir": ...}]}

(``tools/engines`` on ``PYTHONPATH`` of the engine processes). The copies are
synchronous: ``submit_store`` runs at the start of the step after the one that
computed the KV (vLLM defers stores to ``start_kv_transfers``), ``submit_load``
before the forward pass that needs the KV, so each is complete when it returns.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

logger = init_logger(__name__)


class HostCopyWorker(OffloadingWorker):
    """Moves KV blocks between the engine's KV cache (host memory on the CPU build)
    and the CPU tier's chunks in the shared offload region.

    Engine KV tensor ``t``: ``(num_blocks, page)`` int8 rows. Its CPU-tier view:
    ``(num_chunks, blocks_per_chunk * page)`` rows of the region (row stride = the
    chunk's bytes over all tensors). Engine block ``i`` of a transfer group starting
    at logical block ``b0`` lands in sub-block ``(b0 % bpc + i) % bpc`` of chunk
    ``(b0 % bpc + i) // bpc`` of that group's chunks."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        self._region: SharedOffloadRegion | None = region
        self._bpc = blocks_per_chunk
        self._refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        self._dev: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []  # (num_chunks, bpc, page) views
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            dev = t.tensor.view(torch.int8).view(-1, page)
            assert dev.device.type == "cpu", dev.device
            rows = region.create_next_worker_view(page * blocks_per_chunk)
            self._dev.append(dev)
            self._host.append(
                rows.as_strided(
                    (rows.shape[0], blocks_per_chunk, page),
                    (rows.stride(0), page, 1),
                    rows.storage_offset(),
                )
            )
        self._done: list[TransferResult] = []
        self.bytes_stored = 0
        self.bytes_loaded = 0

    def _positions(
        self, dev_spec: GPULoadStoreSpec, host_ids: np.ndarray
    ) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per group: (group index, engine block ids, chunk ids, sub-block ids)."""
        out = []
        dev_off = host_off = 0
        for g, (n, b0) in enumerate(zip(dev_spec.group_sizes, dev_spec.block_indices, strict=True)):
            if n == 0:
                continue
            skip = int(b0) % self._bpc
            n_chunks = -(-(n + skip) // self._bpc)
            pos = np.arange(skip, skip + n)
            chunks = host_ids[host_off : host_off + n_chunks][pos // self._bpc]
            out.append(
                (
                    g,
                    torch.from_numpy(dev_spec.block_ids[dev_off : dev_off + n].astype(np.int64)),
                    torch.from_numpy(chunks.astype(np.int64)),
                    torch.from_numpy((pos % self._bpc).astype(np.int64)),
                )
            )
            dev_off += n
            host_off += n_chunks
        assert dev_off == len(dev_spec.block_ids) and host_off == len(host_ids)
        return out

    def _copy(
        self, job_id: int, dev_spec: GPULoadStoreSpec, host: LoadStoreSpec, store: bool
    ) -> bool:
        assert isinstance(host, BlockIDsLoadStoreSpec)
        t0 = time.perf_counter()
        nbytes = 0
        for g, dev_ids, chunks, subs in self._positions(dev_spec, host.block_ids):
            for ref in self._refs[g]:
                size = ref.page_size_bytes
                dev, h = self._dev[ref.tensor_idx], self._host[ref.tensor_idx]
                if store:
                    h[chunks, subs, :size] = dev[dev_ids, :size]
                else:
                    dev[dev_ids, :size] = h[chunks, subs, :size]
                nbytes += size * len(dev_ids)
        if store:
            self.bytes_stored += nbytes
        else:
            self.bytes_loaded += nbytes
        self._done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is complete when submit_* returns

    def shutdown(self) -> None:
        self._dev.clear()
        self._host.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class HostTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with :class:`HostCopyWorker` as its worker."""

    def create_worker(self, kv_caches: CanonicalKVCaches) -> Any:
        # the same region the scheduler side maps (engine id, chunk geometry); one
        # worker (rank 0): the CPU build here runs TP 1
        assert self.config.parallel.world_size == 1, "HostTieringSpec: TP/PP 1 only"
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise
        logger.info(
            "HostTieringSpec: host-copy worker, %d CPU-tier chunks of %d bytes",
            self.num_chunks,
            self.kv_bytes_per_chunk,
        )
        return worker

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # the parent refuses non-CUDA platforms here; the host copy needs no device
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        assert self._worker is not None
        return self._worker
