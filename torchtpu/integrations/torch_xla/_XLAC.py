"""``torch_xla._XLAC``: the two C++ binding names scripts print or assert with, over this layer:
``_xla_metrics_report()`` (``met.metrics_report()``) and ``_get_xla_sharding_spec(t)`` (the
sharding text ``xs.mark_sharding`` recorded, ``""`` for none, as PyTorch/XLA gives)."""

from __future__ import annotations

import torch

from torchtpu.integrations.torch_xla import _missing
from torchtpu.integrations.torch_xla.debug import metrics
from torchtpu.integrations.torch_xla.distributed import spmd


def _xla_metrics_report() -> str:
    return metrics.metrics_report()


def _get_xla_sharding_spec(t: torch.Tensor) -> str:
    wrapped = spmd.wrap_if_sharded(t)
    return wrapped.sharding_spec if isinstance(wrapped, spmd.XLAShardedTensor) else ""


__getattr__ = _missing.module_getattr("torch_xla._XLAC")
