"""vLLM's worker and model runner on device "tpu": the GPU ones with the device chosen here.

vLLM's GPU worker only knows "cuda" when it picks its device, and its CPU worker calls the
compiled ``_C`` CPU kernels; like vLLM's XPU worker, :class:`TpuWorker` keeps the GPU worker's
scheduling, KV-cache sizing and model loading and replaces only device set-up.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import torch
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory

# torch.accelerator's memory functions assert on a C++ DeviceAllocator, which a Python backend
# has not got; torch.tpu answers the same questions.
_MEMORY = {
    "memory_stats": "memory_stats",
    "memory_reserved": "memory_reserved",
    "memory_allocated": "memory_allocated",
    "max_memory_allocated": "max_memory_allocated",
    "reset_peak_memory_stats": "reset_peak_memory_stats",
    "get_memory_info": "mem_get_info",
}
# the GPU runner makes its streams and events through torch.cuda
_STREAMS = ("Stream", "current_stream", "default_stream", "stream", "set_stream")


def _route_cuda_names_to_tpu() -> None:
    """Point the accelerator and CUDA names vLLM's GPU code calls at torch.tpu (worker only)."""
    for name, tpu_name in _MEMORY.items():
        setattr(torch.accelerator, name, functools.partial(getattr(torch.tpu, tpu_name)))
    torch.accelerator.empty_cache = lambda: None  # PJRT frees buffers when their arrays die
    for name in _STREAMS:
        setattr(torch.cuda, name, getattr(torch.tpu, name))

    def event(*args, blocking=None, **kwargs):
        return torch.tpu.Event(*args, **kwargs)

    torch.cuda.Event = event


class TpuModelRunner(GPUModelRunner):
    """vLLM's GPU model runner, given a "tpu" device."""


class TpuWorker(Worker):
    def init_device(self) -> None:
        if self.device_config.device_type != "tpu":
            raise RuntimeError(
                f"torchtpu.device: TpuWorker runs on device 'tpu', not "
                f"{self.device_config.device!r}; "
                "unset TORCHTPU_VLLM to use vLLM's own platform"
            )
        _route_cuda_names_to_tpu()
        self.device = torch.device("tpu", self.local_rank)
        current_platform.set_device(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        gc.collect()
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
        self._init_workspace_and_model_runner()

    def _make_model_runner(self) -> GPUModelRunner:
        return TpuModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str):
        # no sleep mode on "tpu": PJRT owns device memory, there is no pool to swap out
        return contextlib.nullcontext()
