"""``torch.accelerator`` for device "tpu": every entry point answers through ``torch.tpu``.

PyTorch's ``torch.accelerator`` functions (and ``torch.accelerator.memory``'s, which
``torch.accelerator`` re-exports) call C++ bindings that expect a C++ ``DeviceAllocator``, device
guard and capture backend, which a Python backend has not got: ``empty_cache`` and the memory
figures raise an internal assert ("Allocator for tpu is not a DeviceAllocator"; Accelerate 1.16's
``free_memory`` calls it, issue 37), ``empty_host_cache`` segfaults once a tpu tensor exists,
``get_device_capability`` and ``Graph`` refuse the device. So ``install`` replaces the bindings
themselves (``torch._C._accelerator_*``, looked up at each call), which reaches every Python
entry point at once: the module functions, the names re-exported from them, the deprecated
aliases, and a ``from torch.accelerator.memory import empty_cache`` made before torchtpu loaded.
Each replacement serves the tpu and hands any other accelerator to PyTorch's binding.
``synchronize`` is replaced at the Python level (Dynamo keeps its binding in graphs), and
``Graph`` by a class that makes a ``torch.tpu.TPUGraph`` (with ``with graph:`` capture) for tpu.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.accelerator

from torchtpu import tpu


def _on_tpu() -> bool:
    current = torch._C._accelerator_getAccelerator()
    return current is not None and current.type == "tpu"


def _capability(index: int) -> dict[str, Any]:
    from torchtpu.device import dtypes

    tpu._check(index)
    refused = set()
    for dtype in dtypes.TORCH_TO_NP:
        try:
            dtypes.check_platform(dtype)
        except RuntimeError:
            refused.add(dtype)
    return {"supported_dtypes": set(dtypes.TORCH_TO_NP) - refused}


def _stats(index: int) -> dict:
    """torch.tpu.memory_stats nested as the binding's dicts, which PyTorch flattens again."""
    nested: dict = {}
    for key, value in tpu.memory_stats(index).items():
        *path, last = key.split(".")
        level = nested
        for part in path:
            level = level.setdefault(part, {})
        level[last] = value
    return nested


_TPU_BINDINGS: dict[str, Callable] = {
    "_accelerator_setDeviceIndex": tpu.set_device,
    "_accelerator_isAllocatorInitialized": lambda: True,
    "_accelerator_emptyCache": tpu.empty_cache,
    # Pinned host buffers are plain host memory, freed when their tensor dies: no cache.
    "_accelerator_emptyHostCache": lambda: None,
    "_accelerator_getDeviceStats": _stats,
    "_accelerator_resetAccumulatedStats": tpu.reset_accumulated_memory_stats,
    "_accelerator_resetPeakStats": tpu.reset_peak_memory_stats,
    "_accelerator_getMemoryInfo": tpu.mem_get_info,
    "_accelerator_getDeviceCapability": _capability,
}


def _routed(original: Callable, on_tpu: Callable) -> Callable:
    @functools.wraps(original)
    def call(*args, **kwargs):
        return on_tpu(*args, **kwargs) if _on_tpu() else original(*args, **kwargs)

    call._torchtpu_original = original
    return call


class _TpuGraph(tpu.TPUGraph):
    """``torch.accelerator.Graph`` on tpu: a TPUGraph that is also its own capture context."""

    def __init__(self, keep_graph: bool = False, *, pool=None,
                 capture_error_mode: str = "default") -> None:
        super().__init__(keep_graph)
        self.graph_pool = pool
        self.capture_error_mode = capture_error_mode

    def instantiate(self) -> None:
        """Nothing to do: capture_end builds the program."""

    def __enter__(self) -> _TpuGraph:
        self.capture_begin()
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None:
            self._abort()
        else:
            self.capture_end()


def _graph_class(original: type) -> type:
    class Graph(original):
        __doc__ = original.__doc__

        def __new__(cls, keep_graph: bool = False, *, pool=None,
                    capture_error_mode: str = "default"):
            if _on_tpu():
                return _TpuGraph(keep_graph, pool=pool, capture_error_mode=capture_error_mode)
            return super().__new__(cls, keep_graph, pool=pool,
                                   capture_error_mode=capture_error_mode)

    Graph.__module__ = original.__module__
    Graph._torchtpu_original = original
    return Graph


def install() -> None:
    """Route torch.accelerator's entry points to torch.tpu while tpu is the accelerator;
    idempotent."""
    import torch.accelerator.graphs

    for name, on_tpu in _TPU_BINDINGS.items():
        original = getattr(torch._C, name)
        if not hasattr(original, "_torchtpu_original"):
            setattr(torch._C, name, _routed(original, on_tpu))
    if not hasattr(torch.accelerator.synchronize, "_torchtpu_original"):
        torch.accelerator.synchronize = _routed(torch.accelerator.synchronize, tpu.synchronize)
    if not hasattr(torch.accelerator.Graph, "_torchtpu_original"):
        graph = _graph_class(torch.accelerator.Graph)
        torch.accelerator.Graph = torch.accelerator.graphs.Graph = graph
