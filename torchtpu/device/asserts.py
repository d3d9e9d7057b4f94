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

import jax
import jax.numpy as jnp
import numpy as np

from torchtpu.device import launch, ownership
from torchtpu.device.hooks import HOOKS
from torchtpu.runtime import platform

# A program that never reads to the host would let flags pile up: past this many, those already
# computed are merged into one on the device (``_merged``), which reads nothing back: reading
# them would stall the host until the device caught up with the newest (a Strict loop of
# checked ops ran in lockstep every 64 of them). Flags still pending in a DeferAndFuse recording
# stay as they are: merging them would add to the recording.
MAX_PENDING = 64

# (flags, parts): flags an int array ``[bad, value]`` (or a pending value of one), or a merged
# ``[bad, value, which, count]``; parts the (error(value), where) of each check it stands for,
# ``which`` the failed one's index among them.
_pending: list = []


def _host_reads_stall() -> bool:
    # On the CPU platform a computed value is host memory already; on a TPU or GPU reading it
    # waits for the device, so checks of data run there instead.
    return platform.platform() != "cpu"


def host_reads_stall() -> bool:
    """Whether reading a computed value to the host waits for the device (not on XLA:CPU), or
    is to be treated so (``HOOKS.host_reads_stall``): then checks of data run on the device."""
    told = HOOKS.host_reads_stall
    return _host_reads_stall() if told is None else told


def add(flags, error: Callable[[int], Exception], where: str) -> None:
    """Raise ``error(value)`` at the next host read if flags (an int array ``[bad, value]``,
    computed or pending) says bad; where says which call it came from."""
    _pending.append((flags, [(error, where)]))
    if len(_pending) > MAX_PENDING:
        _merge()


def pending() -> bool:
    """Whether a device check waits to be read (a host read now would raise its error)."""
    return bool(_pending)


def raise_pending() -> None:
    """Read every pending flag; raise the first failed check's error (all are cleared). On a
    thread other than the main one (a torch_xla step closure's worker) only the flags already
    computed: reading the others would run the main thread's DeferAndFuse recording early, in
    the middle of its step; they are read at a later host read."""
    if _pending:
        _raise(computed_only=threading.current_thread() is not threading.main_thread())


def _computed(flags) -> bool:
    return not (isinstance(flags, ownership.Deferred) and flags.resolve() is flags)


def _merged(*flags):
    """One ``[bad, value, which, count]`` for many flags: the first failed check's value and
    index among all the checks they stand for, and how many those are."""
    rows = jnp.stack([f if f.shape[0] == 4 else jnp.concatenate([f, jnp.array([0, 1], f.dtype)])
                      for f in flags])
    bad = rows[:, 0] != 0
    first = jnp.argmax(bad)
    before = jnp.cumsum(rows[:, 3]) - rows[:, 3]
    return jnp.stack([bad.any().astype(rows.dtype), rows[first, 1],
                      before[first] + rows[first, 2], rows[:, 3].sum()])


_merge_program = jax.jit(_merged)


def _merge() -> None:
    done = [p for p in _pending if _computed(p[0])]
    if len(done) < 2:
        return
    flags = launch.run(None, _merge_program, tuple(p[0] for p in done))
    parts = [part for p in done for part in p[1]]
    _pending[:] = [(flags, parts), *(p for p in _pending if not _computed(p[0]))]


def _raise(computed_only: bool) -> None:
    checked = [p for p in _pending if not computed_only or _computed(p[0])]
    _pending[:] = [p for p in _pending if computed_only and not _computed(p[0])]
    for flags, parts in checked:
        try:
            values = [int(v) for v in np.asarray(flags)]
        except RuntimeError:  # a DeferAndFuse flush that failed lost it, and said so then
            continue
        if values[0]:
            del _pending[:]  # the process goes on: later checks are about a broken state
            error, where = parts[values[2] if len(values) == 4 else 0]
            exc = error(values[1])
            exc.add_note(f"Checked on the device and raised at the first host read after the "
                         f"call {where}; the op's result is not valid.")
            raise exc
