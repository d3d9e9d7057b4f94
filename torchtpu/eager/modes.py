"""The eager modes of ``torch.tpu.EagerMode`` and how the process picks one.

``TORCH_TPU_LAUNCH_BLOCKING=1`` starts in Debug, ``TORCH_TPU_DEFER_AND_FUSE=1`` in DeferAndFuse.
Leaving a mode flushes what it holds, so pending values never cross a mode change unrun.

The mode is the process's, not a thread's: one executor serves every thread, and PyTorch's
autograd thread runs every thread's backward. Threads that entered different modes at once ran
one another's pending values through the wrong executor (a ``ValueError`` from deep inside JAX,
issue 37), so a thread may not change the mode while another thread is inside a
``set_eager_mode`` block: that raises ``torchtpu.unsupported``. Threads may share one mode (each
entering the same ``set_eager_mode`` block); the mode reverts when the last of them leaves.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading

from torchtpu.eager import defer, executor


class EagerMode(enum.Enum):
    DEFER_NEVER = "strict"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"
    DEFER_AND_FUSE = "defer_and_fuse"


_EXECUTORS = {
    EagerMode.DEFER_NEVER: executor.Strict,
    EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING: executor.Debug,
    EagerMode.DEFER_AND_FUSE: defer.DeferAndFuse,
}
_mode = [EagerMode.DEFER_NEVER]


def get_eager_mode() -> EagerMode:
    return _mode[0]


# Threads inside set_eager_mode blocks: each one's stack of the modes its blocks found on entry.
_held: dict[int, list[EagerMode]] = {}
_base: list[EagerMode | None] = [None]  # the mode found by the first block of all those open
_lock = threading.Lock()


def _check_others(mode: EagerMode, action: str) -> None:
    me = threading.get_ident()
    others = [t for t in _held if t != me]
    if others and mode is not _mode[0]:
        names = {t.ident: t.name for t in threading.enumerate()}
        raise RuntimeError(
            f"torchtpu.unsupported: {action} {mode} on thread {threading.current_thread().name!r} "
            f"while thread {names.get(others[0], others[0])!r} runs in {_mode[0]} (a "
            "set_eager_mode block): the eager mode is per process, not per thread (one "
            "executor for all threads; PyTorch's autograd thread runs every thread's backward). "
            "Enter one mode for all threads, or run each mode in a process of its own")


def _switch(mode: EagerMode) -> None:
    if not isinstance(mode, EagerMode):
        raise TypeError(f"torchtpu.argument: eager mode must be a torch.tpu.EagerMode, not "
                        f"{mode!r}")
    if mode is _mode[0]:
        return
    executor.set_current(_EXECUTORS[mode]())
    _mode[0] = mode


def switch(mode: EagerMode) -> None:
    """Make mode the process's (``torch.tpu.eager_mode = mode``)."""
    with _lock:
        _check_others(mode, "eager_mode =")
        _switch(mode)


@contextlib.contextmanager
def set_eager_mode(mode: EagerMode):
    me = threading.get_ident()
    with _lock:
        _check_others(mode, "set_eager_mode")
        if not _held:
            _base[0] = _mode[0]
        _held.setdefault(me, []).append(_mode[0])
        _switch(mode)
    try:
        yield
    finally:
        with _lock:
            stack = _held[me]
            previous = stack.pop()
            if not stack:
                del _held[me]
            if stack:  # back to this thread's outer block's mode
                _switch(previous)
            elif not _held:  # the last block open: the mode the first one found
                _switch(_base[0])


def from_environment() -> None:
    if os.environ.get("TORCH_TPU_DEFER_AND_FUSE") == "1":
        switch(EagerMode.DEFER_AND_FUSE)
    elif os.environ.get("TORCH_TPU_LAUNCH_BLOCKING") == "1":
        switch(EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING)
