"""``torch.tpu``'s CUDA Graphs surface: ``TPUGraph``, ``graph``, ``make_graphed_callables``, and
the stream API that CUDA Graphs code uses around them.

The machinery is in the eager layer (``eager/capture.py``, ``eager/tpu_graph.py``,
``eager/graphed_callables.py``). Streams exist so that code written for CUDA runs unchanged: the
device runs one ordered queue of programs, so every stream is that queue, ``wait_stream`` and
events have nothing to wait for beyond it, and ``synchronize`` waits for the device.
"""

from __future__ import annotations

import contextlib

import torch

from torchtpu.device.hooks import HOOKS
from torchtpu.eager.capture import CaptureError
from torchtpu.eager.graphed_callables import make_graphed_callables
from torchtpu.eager.tpu_graph import TPUGraph, graph


def _synchronize() -> None:
    torch.tpu.synchronize()


# c10::DeviceType::PrivateUse1, the device type of "tpu" tensors
_PRIVATEUSE1 = 20


class Stream(torch.Stream):
    """A device stream: the device's one ordered queue (see the module docstring). A
    ``torch.Stream`` (stream 0 of its device, built without asking the backend for one), so
    ``Tensor.record_stream(stream)`` accepts it (FSDP's mixed-precision parameters call it)."""

    def __new__(cls, device=None, priority: int = 0) -> Stream:
        index = torch.tpu.current_device() if device is None else torch.device(device).index or 0
        return super().__new__(cls, stream_id=0, device_index=index, device_type=_PRIVATEUSE1)

    def __init__(self, device=None, priority: int = 0) -> None:
        self.priority = priority

    def wait_stream(self, stream: Stream) -> None:
        """Nothing to wait for: all streams are one queue."""

    def wait_event(self, event: Event) -> None:
        """Nothing to wait for: all streams are one queue."""

    def record_event(self, event: Event | None = None) -> Event:
        return event if event is not None else Event()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _synchronize()


class Event:
    """A stream event: everything before it is in the same queue."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Stream | None = None) -> None:
        """Nothing to record: all streams are one queue."""

    def wait(self, stream: Stream | None = None) -> None:
        """Nothing to wait for: all streams are one queue."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _synchronize()


_default = {}


def current_stream(device=None) -> Stream:
    index = torch.tpu.current_device() if device is None else torch.device(device).index or 0
    if index not in _default:
        _default[index] = Stream(torch.device("tpu", index))
    return _default[index]


default_stream = current_stream


class StreamContext(contextlib.nullcontext):
    """Run the block on a stream (the device's one queue): ``torch.cuda.StreamContext``'s twin.
    Like CUDA's, one object can be entered again and again (SGLang's scheduler keeps one)."""

    def __init__(self, stream: Stream | None) -> None:
        super().__init__()
        self.stream = stream


def stream(s: Stream | None) -> StreamContext:
    """Run the block on stream s (the device's one queue)."""
    return StreamContext(s)


def set_stream(s: Stream) -> None:
    """Streams are one queue: nothing to switch."""


def is_current_stream_capturing() -> bool:
    """Whether a ``torch.tpu.graph`` capture is in progress."""

    return HOOKS.capture is not None


__all__ = ["CaptureError", "Event", "Stream", "TPUGraph", "current_stream", "default_stream",
           "graph", "is_current_stream_capturing", "make_graphed_callables", "set_stream",
           "stream", "StreamContext"]
