"""Device times in ``prof.key_averages()`` / ``prof.events()``, as PyTorch gives them for CUDA.

PyTorch fills the "Self TPU" and "TPU total" columns from the kernels attached to each CPU op
(``FunctionEvent.append_kernel``) and lists each device activity as an event of its own; Kineto
gives a Python backend neither. From a window's device trace (``session.py``), each program run
becomes:
- a kernel of the innermost CPU op whose time range holds the run's launch (the op that launched
  it: ``aten::mm`` in Strict, the op that flushed a DeferAndFuse recording, a compiled graph's
  call), so its self device time is that of the programs it launched;
- an event of its own on the device (``DeviceType.PrivateUse1``), named after its XLA module
  (``jit_aten_mm_default``, ``defer_and_fuse``, ``compiled_forward``), as CUDA lists kernels.

Kineto numbers host threads its own way, so a launch is matched to its op by time alone; with
several host threads launching at once (backward on PyTorch's autograd thread alongside the
main one) a run may be charged to an op of the other thread that happens to span it.
"""

from __future__ import annotations

import bisect

from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from torchtpu.profiler.session import DeviceTrace


def _innermost(ops: list, starts: list, start_us: float, end_us: float):
    """The latest-starting op whose range holds [start_us, end_us] (ops sorted by start)."""
    k = bisect.bisect_right(starts, start_us)
    for op in reversed(ops[:k]):
        if op.time_range.end >= end_us:
            return op
    return None


def add_device_times(events: list, trace: DeviceTrace, trace_start_ns: int,
                     use_device: str) -> list:
    """events (PyTorch's parse of one window) with trace's program runs added as above."""
    def us(ns: float) -> float:
        return (ns - trace_start_ns) / 1000

    ops = sorted((e for e in events if e.device_type == DeviceType.CPU and not e.is_async),
                 key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in ops]
    next_id = max((e.id for e in events), default=0) + 1
    added = []
    for i, run in enumerate(trace.programs):
        duration = (run.end_ns - run.start_ns) / 1000
        k = trace.launched_by.get(i)
        if k is not None:
            la = trace.launches[k]
            op = _innermost(ops, starts, us(la.start_ns), us(la.end_ns))
            if op is not None:
                op.append_kernel(run.module, run.device, duration)
        added.append(FunctionEvent(
            id=next_id + i, name=run.module, thread=run.device, start_us=us(run.start_ns),
            end_us=us(run.end_ns), use_device=use_device, device_type=DeviceType.PrivateUse1,
            device_index=run.device, trace_name=run.module, input_shapes=[], stack=[]))
    return events + added
