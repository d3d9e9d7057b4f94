"""``torch_xla.distributed.parallel_loader`` (``pl``): batches on the device, a step per batch.

``MpDeviceLoader(loader, device)`` is ``torchtpu.DeviceLoader`` (batches copied to "tpu" on a
background thread, ``loader_prefetch_size`` ahead) and, as in PyTorch/XLA, it marks the step:
fetching a batch runs ``xm.mark_step()`` first, every ``batches_per_execution`` batches (and once
after the last), so a loop that only iterates the loader runs one program per step.
``input_sharding`` over a one-device mesh is the batch itself; over several devices it is
refused (see ``spmd``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

import torchtpu
from torchtpu.integrations.torch_xla import _missing, _step


def _check_sharding(input_sharding) -> None:
    if input_sharding is None:
        return
    mesh = getattr(input_sharding, "mesh", None)
    if mesh is None or mesh.size() != 1:
        raise NotImplementedError(_missing.text(
            "torch_xla.distributed.parallel_loader.MpDeviceLoader(input_sharding=) over several "
            "devices") + "; give each process its part of the batch (DistributedSampler)")


class PerDeviceLoader:
    """One device's batches; fetching one first marks the step of the batches before it."""

    def __init__(self, loader: Iterable, device, loader_prefetch_size: int = 8,
                 batches_per_execution: int = 1, input_sharding=None, **_) -> None:
        if torch.device(device).type != "tpu":
            raise ValueError(f"torchtpu.device: MpDeviceLoader needs the tpu device "
                             f"(torch_xla.device()), got {device!r}")
        if batches_per_execution < 1:
            raise ValueError(f"torchtpu.argument: batches_per_execution must be at least 1, "
                             f"got {batches_per_execution}")
        _check_sharding(input_sharding)
        self._loader = torchtpu.DeviceLoader(loader, device, prefetch=max(1, loader_prefetch_size))
        self._every = batches_per_execution

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator:
        since = self._every  # PyTorch/XLA marks the step before the first batch too
        for batch in self._loader:
            if since >= self._every:
                since = 0
                _step.sync()
            since += 1
            yield batch
        _step.sync()

    def next(self):
        raise NotImplementedError(_missing.text("PerDeviceLoader.next()") + "; iterate it")


class MpDeviceLoader(PerDeviceLoader):
    """``pl.MpDeviceLoader(loader, device, **kwargs)``: the loader's batches on device."""


class ParallelLoader:
    """``pl.ParallelLoader(loader, [device])``: one device per process here."""

    def __init__(self, loader: Iterable, devices, **kwargs) -> None:
        devices = list(devices)
        if len(devices) != 1:
            raise ValueError(f"torchtpu.device: ParallelLoader got {len(devices)} devices; "
                             "torchtpu drives one per process ([torch_xla.device()])")
        self._loader = PerDeviceLoader(loader, devices[0], **kwargs)

    def per_device_loader(self, device) -> PerDeviceLoader:
        return self._loader


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
