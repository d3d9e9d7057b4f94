"""Ray Train on tpu: ``ray.train.torch.get_device()`` / ``get_devices()`` give each worker its
tpu device when its process group is tpu_dist (``TorchConfig(backend="tpu_dist")``).

Ray picks a worker's torch device from the accelerators it scheduled for it (CUDA GPUs, "TPU"
resources on a real TPU slice for torch_xla, ...), and gives CPU otherwise, so on a machine
without Ray "TPU" resources the standard loop (``prepare_model(model.to(get_device()))``) put
the model on CPU and DDP's first all-reduce failed. Every device query of Ray Train and Ray
Data goes through ``ray.air._internal.torch_utils.get_devices``, which ``patch`` wraps once that
module is imported: with a tpu_dist default group it answers this process's device
(``tpu:LOCAL_RANK``); otherwise Ray's own answer stands.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def _tpu_dist() -> bool:
    """Whether this process's default group is served by tpu_dist (alone or beside gloo)."""
    from torchtpu.distributed import BACKENDS

    if not dist.is_available() or not dist.is_initialized():
        return False
    names = str(dist.get_backend()).lower().split(",")
    return any(name.rsplit(":", 1)[-1] in BACKENDS for name in names)


def devices(ray_devices: Callable[[], list]) -> list[torch.device]:
    """This worker's devices: its tpu device under tpu_dist, else what Ray says."""
    if not _tpu_dist():
        return ray_devices()
    from torchtpu.runtime import platform

    return [torch.device("tpu", platform.process_slot()[0])]


def patch() -> None:
    """Wrap Ray's device choice (``ray.air._internal.torch_utils.get_devices``)."""
    from ray.air._internal import torch_utils

    patch_module(torch_utils)


def patch_module(torch_utils) -> None:
    """Wrap ``torch_utils.get_devices`` in ``devices`` (idempotent)."""
    original = torch_utils.get_devices
    if getattr(original, "_torchtpu", False):
        return

    def get_devices() -> list[torch.device]:
        return devices(original)

    get_devices._torchtpu = True
    get_devices.__doc__ = original.__doc__
    torch_utils.get_devices = get_devices
