"""``torch_xla.distributed.xla_multiprocessing`` (``xmp``): one process per device.

``spawn(fn, args, nprocs)`` starts the processes with ``torch.multiprocessing`` (spawned, fresh),
each with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...)
and the default process group initialized on ``tpu_dist``, and calls ``fn(index, *args)`` there;
``xm`` collectives and ordinals then work as in PyTorch/XLA. As there, ``nprocs`` is ``None``
(every device of the host) or 1 (``fn(0, *args)`` in this process); the device count is
PyTorch/XLA's ``{TPU,GPU,CPU}_NUM_DEVICES`` when set, else on XLA:CPU 1 and on TPU/GPU what JAX
counts in a short child process (this process must not open the devices its children need).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtpu import settings
from torchtpu.integrations.torch_xla import _missing

_PROBE = ("import json, jax; d = jax.local_devices(); "
          "print(json.dumps([d[0].platform, len(d)]))")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_count() -> int:
    """Devices of this host for nprocs=None (see the module), without opening them here."""
    for kind in ("TPU", "GPU", "CPU"):
        if os.environ.get(f"{kind}_NUM_DEVICES"):
            return int(os.environ[f"{kind}_NUM_DEVICES"])
    wanted = settings.PLATFORM.get()
    if wanted == "cpu":
        return 1
    env = dict(os.environ)
    if wanted:
        env["JAX_PLATFORMS"] = wanted
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         env=env, timeout=300)
    if out.returncode:
        raise RuntimeError(f"torchtpu.device: counting this host's devices failed: "
                           f"{out.stderr.strip().splitlines()[-1:]}")
    platform, count = json.loads(out.stdout.strip().splitlines()[-1])
    return 1 if platform == "cpu" else count


def _rank(index: int, fn: Callable, args: tuple, nprocs: int, port: int) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("tpu_dist", init_method=f"tcp://127.0.0.1:{port}", rank=index,
                            world_size=nprocs)
    try:
        fn(index, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, args: tuple = (), nprocs: int | None = None, join: bool = True,
          daemon: bool = False, start_method: str = "spawn"):
    """``fn(index, *args)`` in one process per device (see the module)."""
    if nprocs == 1:
        return fn(0, *args)
    if nprocs is not None:
        raise ValueError(f"torchtpu.argument: xmp.spawn(nprocs={nprocs}): PyTorch/XLA takes "
                         "nprocs=1 or None (every device); set CPU_NUM_DEVICES (XLA:CPU), "
                         "TPU_NUM_DEVICES or GPU_NUM_DEVICES to use fewer")
    count = device_count()
    return mp.start_processes(_rank, args=(fn, tuple(args), count, _free_port()),
                              nprocs=count, join=join, daemon=daemon, start_method=start_method)


class MpModelWrapper:
    """``xmp.MpModelWrapper(model)``: ``.to(device)`` gives the model on the device."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def to(self, device) -> torch.nn.Module:
        return self._model.to(device)


class MpSerialExecutor:
    """``xmp.MpSerialExecutor().run(fn)``: fn() (one device per process: nothing to serialize)."""

    def run(self, fn: Callable):
        return fn()


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
