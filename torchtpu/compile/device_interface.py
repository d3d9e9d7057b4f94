"""The Dynamo device interface for "tpu", so Dynamo treats tpu tensors as a real device.

torch ships a placeholder ``TpuInterface`` that looks for another package; this one answers from
``torch.tpu`` (torchtpu's device module). It replaces the placeholder after Dynamo's own
registrations have run, since those would otherwise overwrite it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo import device_interface as di


def _tpu():
    return torch.tpu


class TpuInterface(di.DeviceInterface):
    class device:  # noqa: N801 (the name Dynamo looks up)
        def __new__(cls, device: torch.types.Device) -> Any:
            return _tpu().device(device)

    class Worker:
        @staticmethod
        def set_device(device: int) -> None:
            _tpu().set_device(device)

        @staticmethod
        def current_device() -> int:
            return _tpu().current_device()

        @staticmethod
        def get_device_properties(device: torch.types.Device = None) -> Any:
            return _tpu().get_device_properties(device)

    @staticmethod
    def current_device() -> int:
        return _tpu().current_device()

    @staticmethod
    def set_device(device: torch.types.Device) -> None:
        _tpu().set_device(device)

    @staticmethod
    def device_count() -> int:
        return _tpu().device_count()

    @staticmethod
    def is_available() -> bool:
        return _tpu().is_available()

    @staticmethod
    def synchronize(device: torch.types.Device = None) -> None:
        _tpu().synchronize(device)

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True

    @classmethod
    def is_dtype_supported(cls, dtype: torch.dtype, including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def memory_allocated(device: torch.types.Device = None) -> int:
        return _tpu().memory_allocated(device)

    @staticmethod
    def get_compute_capability(device: torch.types.Device = None) -> str:
        return ""


def register() -> None:
    di.get_registered_device_interfaces()  # runs Dynamo's built-in registrations first
    di.register_interface_for_device("tpu", TpuInterface)
