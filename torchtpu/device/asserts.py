"""Data checks the device runs: CUDA's device-side asserts, raised as Python errors instead.

Some checks CPU makes need an argument's values: an index in bounds, a mask's count. Where those
values are on the host for the asking (the CPU platform, a value already computed) the dispatcher
checks them at the call. Where reading them would stall the device (a TPU or GPU) or run a
DeferAndFuse recording early, the check runs on the device instead: a tiny program computes
``[bad, value]`` next to the op (recorded into the same fused program while deferring), and the
first host read after it (``.item()``, ``.cpu()``, printing, ``torch.tpu.synchronize()``) reads
the flags and raises the error CPU would have raised, naming the op and the line that called it.
As on CUDA, the failing op's result is garbage until then; unlike CUDA, the process goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from torchtpu.device import tensors

# A program that never reads to the host would let flags pile up: past this many, those already
# computed are read (their ops ran long ago, so that waits for little). Flags still pending in a
# DeferAndFuse recording stay: reading them would run the recording early.
MAX_PENDING = 64

_pending: list = []  # (flags: [bad, value] array or pending value, error(value), where)


def add(flags, error: Callable[[int], Exception], where: str) -> None:
    """Raise ``error(value)`` at the next host read if flags (an int array ``[bad, value]``,
    computed or pending) says bad; where says which call it came from."""
    _pending.append((flags, error, where))
    if len(_pending) > MAX_PENDING:
        _raise(computed_only=True)


def raise_pending() -> None:
    """Read every pending flag; raise the first failed check's error (all are cleared). On a
    thread other than the main one (a torch_xla step closure's worker) only the flags already
    computed: reading the others would run the main thread's DeferAndFuse recording early, in
    the middle of its step; they are read at a later host read."""
    if _pending:
        _raise(computed_only=threading.current_thread() is not threading.main_thread())


def _computed(flags) -> bool:
    return not (isinstance(flags, tensors.Deferred) and flags.resolve() is flags)


def _raise(computed_only: bool) -> None:
    checked = [p for p in _pending if not computed_only or _computed(p[0])]
    _pending[:] = [p for p in _pending if computed_only and not _computed(p[0])]
    for flags, error, where in checked:
        try:
            bad, value = (int(v) for v in np.asarray(flags))
        except RuntimeError:  # a DeferAndFuse flush that failed lost it, and said so then
            continue
        if bad:
            del _pending[:]  # the process goes on: later checks are about a broken state
            exc = error(value)
            exc.add_note(f"Checked on the device and raised at the first host read after the "
                         f"call {where}; the op's result is not valid.")
            raise exc
