"""``torch_xla.debug.profiler`` (``xp``): ``Trace`` and ``trace_me`` name a region of the host's
work, as ``torch.profiler.record_function`` does (a profile with ``ProfilerActivity.TPU`` shows
them beside the programs they launched). Its server and trace capture are refused, naming
torch.profiler."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from torchtpu.integrations.torch_xla import _missing


class Trace(torch.profiler.record_function):
    """``with xp.Trace(name):`` a named region (extra keyword arguments, PyTorch/XLA's
    metadata, are accepted and not recorded)."""

    def __init__(self, name: str, **kwargs) -> None:
        super().__init__(name)


def trace_me(name: str) -> Callable:
    """A decorator: each call of the function is a ``Trace(name)`` region."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with Trace(name):
                return fn(*args, **kwargs)
        return traced
    return decorate


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
