"""Hugging Face Accelerate: its single-process default device becomes "tpu".

Accelerate 1.15 picks the default device from a fixed list of backends and ends on CPU for any
other; Transformers' ``Trainer`` meanwhile puts the model on ``tpu:0`` (it knows the
``torch.accelerator`` type "tpu") while Accelerate's data loaders move every batch to CPU, and
the first layer fails on mixed devices. ``ACCELERATE_TORCH_DEVICE`` and ``cpu=True`` still win.
"""

from __future__ import annotations

import torch


def patch() -> None:
    from accelerate.state import PartialState

    listed = PartialState.default_device

    def default_device(self) -> torch.device:
        device = listed.fget(self)
        if device.type == "cpu" and torch.tpu.is_available():
            return torch.device("tpu", torch.tpu.current_device())
        return device

    PartialState.default_device = property(default_device, doc=listed.__doc__)
