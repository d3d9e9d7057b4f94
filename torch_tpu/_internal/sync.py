"""``torch_tpu._internal.sync``: run what DeferAndFuse holds pending, and ask whether a value
exists yet.

``synchronize()`` runs everything pending; ``synchronize(t)`` or ``synchronize([t, ...])`` runs
what those tensors need (DTensors: their local shards). ``wait=False`` (the default, as in the
reference) starts the work and returns; ``wait=True`` also waits for the values.
"""

from __future__ import annotations

import torch

from torchtpu.tpu import is_materialized as _is_materialized
from torchtpu.tpu import synchronize as _synchronize


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def synchronize(tensors: torch.Tensor | list | None = None, wait: bool = False) -> None:
    if tensors is None:
        return _synchronize(None, wait=wait)
    group = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    return _synchronize([_local(t) for t in group], wait=wait)


def is_materialized(tensor: torch.Tensor) -> bool:
    return _is_materialized(_local(tensor))


__all__ = ["is_materialized", "synchronize"]
