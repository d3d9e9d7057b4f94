"""A target model's step on tpu as ``onboard`` and ``diagnose`` run it: inputs copied to tpu
(keeping ``requires_grad``), the forward and, for backward, the sum of its floating outputs that
require grad; ops without a lowering run on CPU quietly meanwhile (the reports list them).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_leaves

from torchtpu import settings
from torchtpu.commands import ToolError


def backward_loss(out) -> torch.Tensor:
    """A scalar every floating output contributes to (their sum), for backward."""
    parts = [t.float().sum() for t in tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not parts:
        raise ToolError("backward: no output of the model requires grad")
    return sum(parts)


def run(model, inputs, backward: bool):
    out = model(*inputs)
    if backward:
        backward_loss(out).backward()
    return out


def fallbacks_allowed() -> contextlib.AbstractContextManager:
    """Ops without a lowering run on CPU, quietly: the report lists them (the fallback policy's
    scoped override, not the user's environment)."""
    return settings.CPU_FALLBACK.overridden("silent")


def to_tpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("tpu").requires_grad_(x.requires_grad)
    return x
