"""The eager modes of ``torch.tpu.EagerMode`` and how the process picks one.

``TORCH_TPU_LAUNCH_BLOCKING=1`` starts in Debug, ``TORCH_TPU_DEFER_AND_FUSE=1`` in DeferAndFuse.
Leaving a mode flushes what it holds, so pending values never cross a mode change unrun.
"""

from __future__ import annotations

import contextlib
import enum
import os

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


def switch(mode: EagerMode) -> None:
    if not isinstance(mode, EagerMode):
        raise TypeError(f"torchtpu.argument: eager mode must be a torch.tpu.EagerMode, not "
                        f"{mode!r}")
    if mode is _mode[0]:
        return
    executor.set_current(_EXECUTORS[mode]())
    _mode[0] = mode


@contextlib.contextmanager
def set_eager_mode(mode: EagerMode):
    previous = get_eager_mode()
    switch(mode)
    try:
        yield
    finally:
        switch(previous)


def from_environment() -> None:
    if os.environ.get("TORCH_TPU_DEFER_AND_FUSE") == "1":
        switch(EagerMode.DEFER_AND_FUSE)
    elif os.environ.get("TORCH_TPU_LAUNCH_BLOCKING") == "1":
        switch(EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING)
