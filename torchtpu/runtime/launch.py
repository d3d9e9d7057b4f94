"""The one hook on device program launches, for observers such as ``torch.profiler``.

Every place that runs a device program (the executors' per-op programs, view readers and writers,
DeferAndFuse's fused programs, compiled graphs) reads ``observer`` first. None, the default,
costs one global read per program. An observer (``torchtpu/profiler/`` sets one while a profiler
with ``ProfilerActivity.TPU`` records) runs the program itself, as ``observer(label, fn, args)``:
``label`` names what the program runs (an op overload, a string, or None for ``fn``'s own name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

observer: Callable[[Any, Callable, tuple], Any] | None = None
