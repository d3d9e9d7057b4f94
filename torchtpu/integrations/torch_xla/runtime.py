"""``torch_xla.runtime`` (``xr``): world size, ordinals, device type, the SPMD switch.

torchtpu runs one process per device, as PyTorch does, so PyTorch/XLA's replica ordinals are
``torch.distributed`` ranks: ``world_size()`` and ``global_ordinal()`` come from the default
process group (``tpu_dist``, which ``xmp.spawn`` / ``torch_xla.launch`` start), and are 1 and 0 in
a process without one. ``local_ordinal()`` is torchrun's ``LOCAL_RANK``. In SPMD mode
(``use_spmd()``) PyTorch/XLA's one process drives every device; here each process still drives
one, so ``global_runtime_device_count()`` is the number of processes, which is the number of
devices of the job.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from torchtpu import settings
from torchtpu.integrations.torch_xla import _missing

_spmd = [False]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Processes (devices) taking part in the replication: the default group's size, else 1."""
    return dist.get_world_size() if _initialized() else 1


def global_ordinal() -> int:
    """This process's rank in the default group, 0 without one."""
    return dist.get_rank() if _initialized() else 0


def local_ordinal() -> int:
    """This process's index among the processes of its host (``LOCAL_RANK``), 0 alone."""
    return int(os.environ.get("LOCAL_RANK", "0")) if _initialized() else 0


def process_index() -> int:
    return global_ordinal()


def process_count() -> int:
    return world_size()


def host_index() -> int:
    """Which host this process runs on (``GROUP_RANK`` under torchrun), 0 on one host."""
    return int(os.environ.get("GROUP_RANK", "0")) if _initialized() else 0


def local_process_count() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if _initialized() else 1


def local_device_count() -> int:
    """Devices this process drives: always 1 (one process per device)."""
    return 1


addressable_device_count = local_device_count
addressable_runtime_device_count = local_device_count


def global_device_count() -> int:
    return world_size()


global_runtime_device_count = global_device_count


def runtime_device_attributes(device=None) -> dict:
    """The device's attributes as PyTorch/XLA names them: ``slice_index`` (the TPU slice it is
    in; 0 off a TPU or in one slice), ``name``."""
    from torchtpu.runtime import platform

    d = platform.local_device()
    return {"name": f"{device_type()}:{global_ordinal()}",
            "slice_index": int(getattr(d, "slice_index", 0) or 0)}


def global_runtime_device_attributes() -> list[dict]:
    """One ``runtime_device_attributes`` per rank (each process drives one device; all are
    assumed in this process's slice)."""
    mine = runtime_device_attributes()
    return [{**mine, "name": f"{device_type()}:{rank}"} for rank in range(world_size())]


def device_type() -> str:
    """The platform torchtpu runs on, upper case: ``"TPU"``, ``"GPU"`` or ``"CPU"``."""
    return torch.tpu.get_device_properties().platform.upper()


def use_spmd(auto: bool = False) -> None:
    """Switch SPMD mode on (``xs.Mesh`` / ``mark_sharding``; see ``distributed/spmd``)."""
    if auto:
        raise NotImplementedError(_missing.text("torch_xla.runtime.use_spmd(auto=True)"))
    _spmd[0] = True


def is_spmd() -> bool:
    return _spmd[0]


def initialize_cache(path: str, readonly: bool = False) -> None:
    """PyTorch/XLA's persistent cache switch: torchtpu's compile cache is always on
    (``TORCHTPU_CACHE_DIR``); a path other than that one is refused."""
    configured = settings.CACHE_DIR.get()
    if configured is not None and os.path.abspath(configured) != os.path.abspath(path):
        raise ValueError(f"torchtpu.config: xr.initialize_cache({path!r}) but TORCHTPU_CACHE_DIR "
                         f"is {configured!r}; set TORCHTPU_CACHE_DIR={path} before starting")


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
