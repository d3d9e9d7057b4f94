"""What every torchtpu command line shares (the tools', and installers' such as
``python -m torchtpu.integrations.torch_xla.install``): ``ToolError``, a problem with what the
command was given, whose message says what and what to do; ``main(run)``, which turns it, and
any error raised by the user's own code, into one line naming the user's line and exit status
2, never a traceback from inside torchtpu; ``user_frame``, the first frame that is the user's.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable

import jax
import torch

from torchtpu import errors

# Frames in these directories are torchtpu's, PyTorch's, JAX's or the standard library's (JAX's
# compile log reaches us through logging); the first frame outside them is the user's line.
_TORCHTPU = os.path.dirname(os.path.abspath(__file__))
_INTERNAL = tuple(d + os.sep for d in (
    _TORCHTPU, *(os.path.dirname(m.__file__) for m in (torch, jax))))
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _internal(filename: str) -> bool:
    return filename.startswith(_INTERNAL) or filename.startswith("<frozen") or (
        filename.startswith(_STDLIB) and "-packages" + os.sep not in filename)


def user_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The first frame at or above frame that is not torchtpu's, PyTorch's, JAX's or the
    standard library's."""
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame



class ToolError(Exception):
    """The tools cannot use what they were given; the message says what and what to do."""

    def __init__(self, text: str) -> None:
        super().__init__(errors.message("tool", text))


def describe(error: BaseException) -> str:
    """``Type: message (at file:line: code)`` for an error, at its innermost user line."""
    tb, frame = error.__traceback__, None
    while tb is not None:
        if user_frame(tb.tb_frame) is tb.tb_frame:
            frame = tb.tb_frame
            line = tb.tb_lineno
        tb = tb.tb_next
    text = f"{type(error).__name__}: {error}".strip()
    if frame is None:
        return text
    return f"{text} (at {frame.f_code.co_filename}:{line})"


def main(run: Callable[[], int]) -> int:
    """run()'s exit status; ToolError and errors from user code print one line and give 2."""
    try:
        return run()
    except ToolError as e:
        print(e, file=sys.stderr)
    except KeyboardInterrupt:
        print(errors.message("tool", "interrupted"), file=sys.stderr)
    except Exception as e:
        print(errors.message("tool", f"failed: {describe(e)}"), file=sys.stderr)
    return 2
