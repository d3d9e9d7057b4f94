"""Start-up: the backend creator that ``init_process_group`` and ``new_group`` call.

Under torchrun each process knows its host-local index from ``LOCAL_RANK``. Under
``torch.multiprocessing.spawn`` with an explicit ``init_method`` it does not, so the default
group's creation finds it through the store (ranks that share a host name share a host) and
records it in ``runtime.platform``; from then on ``tpu:{local rank}`` names this process's device
too and ``device_count()`` counts the host's processes.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from torchtpu.runtime import platform


def _host_slot(store: dist.Store, rank: int, size: int) -> tuple[int, int]:
    """(host-local index, processes on this host), from every rank's host name in the store."""
    store.set(f"tpu_dist/host/{rank}", socket.gethostname())
    names = [store.get(f"tpu_dist/host/{r}").decode() for r in range(size)]
    mine = names[rank]
    local = [r for r, name in enumerate(names) if name == mine]
    return local.index(rank), len(local)


def _check_device() -> None:
    from torchtpu.device import control

    if not control.is_available():
        raise RuntimeError(
            "torchtpu.distributed: tpu_dist needs the tpu device, but torchtpu found none (JAX "
            "saw no usable "
            "device); check TORCHTPU_PLATFORM, or use backend='gloo' for CPU tensors"
        )


def _check_devices_for(local_world: int) -> None:
    """More processes on this host than it has devices: each process needs a device of its own.

    Only counted where one process sees the whole host (several local devices); XLA:CPU gives
    every process a device of its own.
    """
    visible = len(platform.devices())
    if visible > 1 and local_world > visible:
        raise RuntimeError(
            f"torchtpu.distributed: tpu_dist: {local_world} processes on this host, but it has "
            f"{visible} "
            f"{platform.platform()} devices: run at most one process per device "
            f"(torchrun --nproc-per-node {visible})"
        )


def create(options, backend_options=None) -> dist.ProcessGroup:
    """``dist.Backend.register_backend``'s creator (extended API)."""
    from torchtpu.distributed.group import TpuProcessGroup

    _check_device()
    store, rank, size = options.store, options.group_rank, options.group_size
    if not dist.is_initialized():  # the default group: every process of the job
        if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
            slot = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        else:
            slot = _host_slot(store, rank, size)
        platform.set_process_slot(*slot)
        _check_devices_for(slot[1])
    return TpuProcessGroup(store, rank, size, options.timeout,
                           list(options.global_ranks_in_group or []))
