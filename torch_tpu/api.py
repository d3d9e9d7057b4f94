"""``torch_tpu.api``: the reference's core API (``tpu_device``)."""

from __future__ import annotations

import torch

from torch_tpu._loader import _init_device


def tpu_device() -> torch.device:
    """The device this process drives, as ``torch.device``."""
    _init_device("tpu")
    return torch.device("tpu", torch.tpu.current_device())


__all__ = ["tpu_device"]
