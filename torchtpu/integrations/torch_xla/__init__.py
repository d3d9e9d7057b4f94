"""PyTorch/XLA's API (``import torch_xla``) on torchtpu: scripts written for it run unchanged.

This package is the layer; ``python -m torchtpu.integrations.torch_xla.install`` makes the
import name ``torch_xla`` resolve to it (``alias.py``), refusing where a real torch_xla is
installed. It only maps names onto torchtpu's public API: the device is "tpu" (``torch.tpu``),
``torch_xla.sync()`` / ``xm.mark_step()`` run what DeferAndFuse holds (``import torch_xla``
switches the process to ``torch.tpu.EagerMode.DEFER_AND_FUSE``, PyTorch/XLA's lazy default;
importing this package by its torchtpu name does not), collectives
and ordinals are ``torch.distributed`` on ``tpu_dist``, ``pl.MpDeviceLoader`` is
``torchtpu.DeviceLoader``, ``met`` is ``torchtpu.metrics``, SPMD meshes are ``DeviceMesh`` (see
``distributed/spmd``). A name it does not map raises, naming it and the torchtpu way
(``torchtpu.unsupported:``). Modules: ``core.xla_model`` (xm), ``runtime`` (xr),
``distributed.parallel_loader`` (pl), ``distributed.xla_multiprocessing`` (xmp),
``distributed.spmd`` (xs), ``debug.metrics`` (met), ``utils.utils`` (xu), ``experimental``,
``backends``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

import torchtpu  # noqa: F401  (registers the device)
from torchtpu.integrations.torch_xla import (  # noqa: F401  # noqa: F401
    _XLAC,
    _internal,
    _missing,
    _step,
    backends,
    debug,
    distributed,
    experimental,
    runtime,
    utils,  # noqa: F401
)
from torchtpu.integrations.torch_xla._compile import compile
from torchtpu.integrations.torch_xla.core import xla_model
from torchtpu.integrations.torch_xla.debug import metrics  # noqa: F401
from torchtpu.integrations.torch_xla.distributed import parallel_loader, spmd, xla_multiprocessing  # noqa: F401
from torchtpu.integrations.torch_xla.distributed.spmd import xla_sharding  # noqa: F401
from torchtpu.integrations.torch_xla.utils import utils as _utils  # noqa: F401
from torchtpu.integrations.torch_xla.version import __version__  # noqa: F401


def device(index: int | None = None) -> torch.device:
    """This process's device, ``tpu:0`` (PyTorch/XLA's ``xla:0``)."""
    return xla_model.xla_device(index)


def devices() -> list[torch.device]:
    return [device()]


def device_count() -> int:
    return 1


def real_devices() -> list[str]:
    return xla_model.xla_real_devices()


def sync(wait: bool = False, reset_scope: bool = True) -> None:
    """Run what is pending as one program, then the step closures (``xm.mark_step``)."""
    _step.sync(wait)


def step():
    return compile()


def manual_seed(seed: int, device=None) -> None:
    torch.tpu.manual_seed(seed)


def launch(fn: Callable, args: tuple = (), start_method: str = "spawn",
           debug_single_process: bool = False):
    """``fn(index, *args)`` on every device: under torchrun in this process (its group started
    here when needed), else through ``xmp.spawn``."""
    if runtime.is_spmd():
        raise NotImplementedError(_missing.text("torch_xla.launch in SPMD mode")
                                  + " (PyTorch/XLA refuses it too)")
    if dist.is_torchelastic_launched():
        if not dist.is_initialized():
            dist.init_process_group("tpu_dist")
        return fn(int(os.environ["LOCAL_RANK"]), *args)
    return xla_multiprocessing.spawn(fn, args=args, nprocs=1 if debug_single_process else None,
                                     start_method=start_method)


__getattr__ = _missing.module_getattr("torch_xla")
