"""``torch_xla.experimental.assume_pure``: ``PureModule`` and ``assume_pure``.

PyTorch/XLA traces a function or module marked pure once, through JAX, and reuses the trace.
torchtpu already reuses each program by its structure (per op, per DeferAndFuse run, per
compiled graph), so the mark changes no result: ``PureModule(m)`` calls ``m`` and
``assume_pure(fn)`` is ``fn``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchtpu.integrations.torch_xla import _missing


class PureModule(torch.nn.Module):
    """``module``, marked pure: its forward is the module's own."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def assume_pure(fn: Callable) -> Callable:
    return fn


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
