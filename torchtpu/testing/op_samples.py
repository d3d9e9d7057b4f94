"""OpInfo samples as the conformance checks handle them: their tensors, whether they are plain
(strided dense CPU tensors only), and their copies on a device. ``opinfo`` (results),
``errors`` (error inputs) and ``refusals`` all check samples copied this way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def tensors(sample) -> list[torch.Tensor]:
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def plain(sample) -> bool:
    return all(type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized
               and not t.is_nested and t.device.type == "cpu" for t in tensors(sample))


def device_value(v: Any) -> Any:
    """v, a ``device=`` argument naming the CPU, pointed at tpu instead."""
    if (isinstance(v, torch.device) and v.type == "cpu") or (isinstance(v, str) and v == "cpu"):
        return "tpu"
    return v


def copy(sample, device: str, cpu_args: bool = False):
    """A detached copy of sample on device; leaves keep requires_grad, device= args follow."""

    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().to(device, copy=True).requires_grad_(t.requires_grad)

    moved = sample.transform(move)
    if cpu_args:
        moved.args = copy(sample, "cpu").args
    if device == "tpu":
        moved.args = tuple(device_value(a) for a in moved.args)
        moved.kwargs = {k: device_value(v) for k, v in moved.kwargs.items()}
    return moved
