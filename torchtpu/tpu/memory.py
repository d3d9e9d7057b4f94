"""``torch.tpu.memory``: what ``torch.cuda.memory`` offers, for device "tpu".

The figures (``memory_allocated``, ``memory_stats``, ...) are ``torch.tpu``'s own; the memory
history (``_record_memory_history``, ``_snapshot``, ``_dump_snapshot``) is in CUDA's snapshot
format (``device/memory_history.py``), so PyTorch's visualizer reads it:
``python -m torch.cuda._memory_viz trace_plot snapshot.pickle -o trace.html`` or
pytorch.org/memory_viz.
"""

from __future__ import annotations

import sys
from typing import Any

from torchtpu.device import memory_history as _history


def _record_memory_history(enabled: str | None = "all", context: str | None = "all",
                           stacks: str = "all", max_entries: int = sys.maxsize,
                           device: Any = None, clear_history: bool = False,
                           **kwargs: Any) -> None:
    _history.record_memory_history(enabled, context, stacks, max_entries, device,
                                   clear_history, **kwargs)


_record_memory_history.__doc__ = _history.record_memory_history.__doc__


def _snapshot(device: Any = None, augment_with_fx_traces: bool = False) -> dict:
    """The live allocations and the recorded history, as ``torch.cuda.memory._snapshot()``."""
    return _history.snapshot(device)


def _dump_snapshot(filename: str = "dump_snapshot.pickle",
                   augment_with_fx_traces: bool = False) -> None:
    """Pickle :func:`_snapshot` to ``filename`` for ``torch.cuda._memory_viz``."""
    _history.dump_snapshot(filename)


def __getattr__(name: str):
    # memory_allocated, memory_stats, memory_summary...: torch.tpu's own
    from torchtpu import tpu

    if name.startswith("_") or not hasattr(tpu, name):
        raise AttributeError(f"module 'torch.tpu.memory' has no attribute {name!r}")
    return getattr(tpu, name)
