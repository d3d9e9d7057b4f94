"""``torch_tpu._loader``: the reference's loader entry points (``load``, ``_init_device``)."""

from __future__ import annotations

import torch

_LOADED: bool = False


def _init_device(device: str = "tpu") -> torch.device:
    """Register the device and return it. Only "tpu" exists here: torchtpu serves TPU, GPU and
    CPU all as "tpu" (the reference's "xla_cuda" / "xla_cpu" devices are this one device)."""
    if device not in ("tpu", "xla_cuda", "xla_cpu"):
        raise ValueError(f"torchtpu.device: unknown device {device!r}; torchtpu's device is 'tpu'")
    from torchtpu.registration import register

    register()
    return torch.device("tpu")


def load(allow_xla_backend: bool | None = None) -> None:
    """Load the backend. ``allow_xla_backend`` is accepted for the reference's signature; torchtpu
    runs on XLA:GPU and XLA:CPU without being asked (``TORCHTPU_PLATFORM`` picks one)."""
    global _LOADED
    _init_device("tpu")
    _LOADED = True
