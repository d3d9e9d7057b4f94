"""The tpu platform's device communicator: vLLM's tensor-parallel collectives over ``tpu_dist``.

For each parallel group vLLM's ``GroupCoordinator`` makes a device group with the platform's
``dist_backend`` and a gloo group for host-side coordination, and hands both to the platform's
device communicator. On device "tpu" the device group is a ``tpu_dist`` group (torchtpu's
process group: XLA collectives on a TPU or GPU, host memory and gloo on XLA:CPU), so the
all-reduce after each row-parallel linear layer and the all-gather of the vocabulary-parallel
logits are ``torch.distributed`` collectives on tpu tensors, as vLLM's base communicator makes
them. vLLM's CPU communicator cannot serve them: its shared-memory kernels read raw data
pointers, which a tpu tensor's are not.

:class:`TpuCommunicator` counts what it served (``calls``, read per worker through
``TpuWorker.communication``), so a test or a user can tell the collectives ran over tpu_dist.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)

from torchtpu.distributed import BACKENDS


class TpuCommunicator(DeviceCommunicatorBase):
    """vLLM's base device communicator, checked to run on a tpu_dist device group."""

    def __init__(self, cpu_group, device: torch.device | None = None, device_group=None,
                 unique_name: str = "", *args, **kwargs) -> None:
        super().__init__(cpu_group, device, device_group, unique_name, *args, **kwargs)
        backend = None if device_group is None else str(dist.get_backend(device_group))
        if backend is None or not any(name in backend.lower() for name in BACKENDS):
            raise RuntimeError(
                f"torchtpu.distributed: vLLM's group {unique_name!r} on device 'tpu' needs a "
                f"tpu_dist device group, got {backend!r}: the tpu platform's dist_backend "
                "must be 'tpu_dist'")
        self.calls: collections.Counter = collections.Counter()

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        self.calls["all_reduce"] += 1
        return super().all_reduce(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls["all_gather"] += 1
        return super().all_gather(input_, dim)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        self.calls["gather"] += 1
        return super().gather(input_, dst, dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls["reduce_scatter"] += 1
        return super().reduce_scatter(input_, dim)
