"""The step boundary: ``torch_xla.sync()`` / ``xm.mark_step()``, step closures, lazy mode.

PyTorch/XLA records ops lazily and runs them as one graph at each ``mark_step``. torchtpu's
DeferAndFuse eager mode is that: ops are recorded, and a flush runs them as one cached program.
So ``import torch_xla`` switches the process to ``torch.tpu.EagerMode.DEFER_AND_FUSE``
(PyTorch/XLA's default lazy mode; ``alias.take_over``), ``torch_xla.experimental.eager_mode(True)``
to Strict, and ``sync()`` is ``torch.tpu.synchronize(wait=wait)`` (a flush of what DeferAndFuse
holds) followed by the step closures queued since the last one (``xm.add_step_closure``), in
order; those queued with ``run_async=True`` run on one worker thread, and an error of theirs is
raised at the next step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

_closures: list[Callable[[], None]] = []
_async: queue.Queue = queue.Queue()
_async_errors: list[BaseException] = []
_worker: list[threading.Thread] = []


def lazy(enabled: bool) -> None:
    """Lazy (DeferAndFuse) when enabled, else Strict: PyTorch/XLA's eager mode off / on."""
    torch.tpu.eager_mode = (torch.tpu.EagerMode.DEFER_AND_FUSE if enabled
                            else torch.tpu.EagerMode.DEFER_NEVER)


def is_lazy() -> bool:
    return torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_AND_FUSE


def add_closure(closure: Callable, args: tuple = (), run_async: bool = False) -> None:
    if not callable(closure):
        raise TypeError(f"torchtpu.argument: xm.add_step_closure needs a callable, got "
                        f"{type(closure).__name__}")
    call = lambda: closure(*args)  # noqa: E731
    if run_async:
        _async.put(call)
        _start_worker()
    else:
        _closures.append(call)


def _drain() -> None:
    while True:
        call = _async.get()
        try:
            call()
        except BaseException as e:  # noqa: BLE001 (raised at the next step on the main thread)
            _async_errors.append(e)
        finally:
            _async.task_done()


def _start_worker() -> None:
    if not _worker:
        _worker.append(threading.Thread(target=_drain, name="torch_xla-step-closures",
                                        daemon=True))
        _worker[0].start()


def _raise_async_error() -> None:
    if _async_errors:
        error = _async_errors.pop(0)
        _async_errors.clear()
        raise error


def sync(wait: bool = False) -> None:
    """Run what is pending as one program, then the queued step closures."""
    _raise_async_error()
    torch.tpu.synchronize(wait=wait)
    pending, _closures[:] = list(_closures), []
    for call in pending:
        call()


def wait_device_ops() -> None:
    """Wait for the device and for the asynchronous step closures queued so far."""
    torch.tpu.synchronize()
    _async.join()
    _raise_async_error()
