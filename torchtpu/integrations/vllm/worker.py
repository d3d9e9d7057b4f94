"""vLLM's worker and model runner on device "tpu": the GPU ones with the device chosen here.

vLLM's GPU worker only knows "cuda" when it picks its device, and its CPU worker calls the
compiled ``_C`` CPU kernels; like vLLM's XPU worker, :class:`TpuWorker` keeps the GPU worker's
scheduling, KV-cache sizing and model loading and replaces only device set-up.
"""

from __future__ import annotations

import gc

import torch
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory


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
