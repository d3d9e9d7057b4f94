"""A target model's step on tpu as ``onboard`` and ``diagnose`` run it: inputs copied to tpu
(keeping ``requires_grad``), the forward and, for backward, the sum of its floating outputs that
require grad; ops without a lowering run on CPU quietly meanwhile (the reports list them).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.utils._pytree import tree_leaves

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


@contextlib.contextmanager
def fallbacks_allowed():
    """Ops without a lowering run on CPU, quietly: the report lists them."""
    old = os.environ.get("TORCHTPU_CPU_FALLBACK")
    os.environ["TORCHTPU_CPU_FALLBACK"] = "silent"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TORCHTPU_CPU_FALLBACK"]
        else:
            os.environ["TORCHTPU_CPU_FALLBACK"] = old


def to_tpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("tpu").requires_grad_(x.requires_grad)
    return x
