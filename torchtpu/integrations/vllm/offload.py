"""KV offload to host memory on device "tpu": vLLM's OffloadingConnector with a tpu copy worker.

``kv_offloading_size=GiB`` (``--kv-offloading-size``; backend "native") makes vLLM run its
``OffloadingConnector``: the scheduler keeps prefix blocks that leave device memory in a host
pool (its LRU manager, :class:`vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`) and, when a
later prompt starts with them, has the worker read them back instead of computing them again
(counted as ``vllm:external_prefix_cache_hits``). Everything of that is device-free except the
worker's copies, which vLLM's CPU spec does with CUDA streams and raw-pointer kernels; here
:class:`TpuHostOffloadingSpec` keeps vLLM's manager and :class:`TpuHostOffloadingWorker` copies
whole blocks with ``index_select`` + ``.cpu()`` (device to host) and ``.to(device)`` +
``index_copy_`` (host to device) on the byte views of the layer caches that vLLM's connector
worker makes. Copies are synchronous: a transfer is finished when it is submitted, which is
what the connector's ordering asks of a transfer (stores of step N before step N + 1's writes).

:func:`torchtpu.integrations.vllm.support.configure_kv_transfer` names this spec in vLLM's
connector config (``spec_name`` / ``spec_module_path``), so nothing here is imported unless
offloading is asked for.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class TpuHostOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading (its sizing and LRU manager), with :class:`TpuHostOffloadingWorker`
    doing the worker's copies."""

    def __init__(self, config) -> None:
        if config.canonical_layout:
            raise NotImplementedError(
                "torchtpu.unsupported: vLLM on device 'tpu' has no canonical_layout KV offload "
                "yet (a host region shared by ranks); instead, leave canonical_layout unset")
        super().__init__(config)

    def _uses_shared_region(self) -> bool:
        return False  # each worker keeps its own host tensors

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = TpuHostOffloadingWorker(kv_caches, self.blocks_per_chunk,
                                                   self.num_chunks)
        return self._worker


def _pairs(gpu: GPULoadStoreSpec, host: BlockIDsLoadStoreSpec,
           blocks_per_chunk: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(group, device block ids, host sub-block ids) of a transfer, per KV-cache group.

    A host chunk holds ``blocks_per_chunk`` device blocks; a group's first device block may sit
    in the middle of its first chunk (``block_indices``: the group's first block's index in its
    request), so the host side is the chunks' sub-blocks from that offset on.
    """
    out = []
    device_start = host_start = 0
    for group, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
        skip = first % blocks_per_chunk
        chunks = -(-(size + skip) // blocks_per_chunk)
        ids = host.block_ids[host_start:host_start + chunks].astype(np.int64)
        subs = (ids[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).reshape(-1)
        if size:
            out.append((group, gpu.block_ids[device_start:device_start + size].astype(np.int64),
                        subs[skip:skip + size]))
        device_start += size
        host_start += chunks if size else 0
    if device_start != len(gpu.block_ids) or host_start != len(host.block_ids):
        raise RuntimeError(f"torchtpu.device: KV offload transfer of {len(gpu.block_ids)} "
                           f"device blocks to {len(host.block_ids)} host chunks does not match "
                           f"its groups {list(gpu.group_sizes)}")
    return out


class TpuHostOffloadingWorker(OffloadingWorker):
    """Block copies between the layer caches on device and host tensors of the same bytes.

    ``kv_caches.tensors`` are ``[num_blocks, page_bytes]`` int8 views of the device caches;
    each has a host twin ``[num_chunks * blocks_per_chunk, page_bytes]``, a chunk being
    ``blocks_per_chunk`` consecutive rows.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 num_chunks: int) -> None:
        self.device_tensors = [t.tensor for t in kv_caches.tensors]
        self.host_tensors = [torch.zeros((num_chunks * blocks_per_chunk, t.shape[1]),
                                         dtype=t.dtype) for t in self.device_tensors]
        # the tensors each KV-cache group's layers live in
        self.group_tensors = [sorted({ref.tensor_idx for ref in refs})
                              for refs in kv_caches.group_data_refs]
        self.blocks_per_chunk = blocks_per_chunk
        self.finished: list[TransferResult] = []
        self.stores = self.loads = 0  # transfers done, for tests and logs

    def _transfer(self, job_id: int, gpu: GPULoadStoreSpec, host: LoadStoreSpec,
                  to_host: bool) -> bool:
        start = time.perf_counter()
        size = 0
        for group, device_ids, host_ids in _pairs(gpu, host, self.blocks_per_chunk):
            device_index = torch.from_numpy(device_ids)
            host_index = torch.from_numpy(host_ids)
            for i in self.group_tensors[group]:
                device, stored = self.device_tensors[i], self.host_tensors[i]
                if to_host:
                    stored.index_copy_(0, host_index,
                                       device.index_select(0, device_index.to(device.device))
                                       .cpu())
                else:
                    device.index_copy_(0, device_index.to(device.device),
                                       stored.index_select(0, host_index).to(device.device))
                size += len(device_ids) * device.shape[1]
        if to_host:
            self.stores += 1
        else:
            self.loads += 1
        self.finished.append(TransferResult(job_id, True, size, time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer finished when it was submitted
