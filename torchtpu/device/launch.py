"""The one way device programs are launched: ``run(label, fn, args)``, and its three hooks.

Every place that runs a device program (the executors' per-op programs, view readers and writers,
DeferAndFuse's fused programs, compiled graphs, captured replays, XLA collectives) calls
``run``; ``label`` names what the program runs (an op overload, a string, or None for ``fn``'s
own name). Upper layers set the hooks, fields of the one interface up (``device/hooks.py``):

- ``HOOKS.launch_observer``: None, the default, costs one attribute read per program. An
  observer (``torchtpu/profiler/`` sets one while a profiler with ``ProfilerActivity.TPU``
  records, and ``device/memory_limit.py`` while a limit is set) runs the program itself, as
  ``observer(label, fn, args)``.
- ``HOOKS.launch_refused``: when the runtime refuses a launch for want of device memory (XLA's
  ``RESOURCE_EXHAUSTED`` status, or its "Out of memory" text), ``refused(label, fn, args, error)``
  returns the exception raised in its place (``device/memory_limit.py``: a
  ``torch.OutOfMemoryError`` naming the program, its line and the largest live tensors). It is
  asked only on that error path: a launch that runs pays nothing for it. Host waits on results
  go through ``wait``, which turns a refusal reported late (XLA:CPU allocates a program's
  temporaries as it runs) into the same error.
- ``HOOKS.peer_lost``: on any failure of a launch or a host wait, ``lost(error)`` returns the
  exception raised in its place when a dead peer process caused it (an XLA collective whose peer
  died: ``distributed/peers.py`` names the lost rank), else None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchtpu.device.hooks import HOOKS


def run(label: Any, fn: Callable, args: tuple) -> Any:
    """fn(*args), through the observer when one is set; a refusal for memory as
    ``HOOKS.launch_refused`` makes it."""
    observe = HOOKS.launch_observer
    try:
        return fn(*args) if observe is None else observe(label, fn, args)
    except Exception as e:
        replacement = _replacement(label, fn, args, e)
        if replacement is None:
            raise
        raise replacement from e


def wait(fn: Callable, *args) -> Any:
    """fn(*args), a host wait on launched programs' results (a copy to the host, a
    ``block_until_ready``): a runtime that allocates a program's temporaries as it runs (XLA:CPU)
    reports a refusal for them here, made into what ``HOOKS.launch_refused`` makes of it."""
    try:
        return fn(*args)
    except Exception as e:
        replacement = _replacement("an earlier program (its results waited for here)", fn,
                                   args, e)
        if replacement is None:
            raise
        raise replacement from e


def _replacement(label: Any, fn: Callable, args: tuple, e: Exception) -> Exception | None:
    """What the hooks make of a failed launch or wait: None to raise e itself."""
    handler, peer = HOOKS.launch_refused, HOOKS.peer_lost
    if handler is not None and out_of_memory(e):
        return handler(label, fn, args, e)
    return None if peer is None else peer(e)


def out_of_memory(e: BaseException) -> bool:
    """Whether e is the runtime refusing an allocation (not one already turned into torch's
    ``OutOfMemoryError``)."""
    if isinstance(e, torch.OutOfMemoryError):
        return False
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text
