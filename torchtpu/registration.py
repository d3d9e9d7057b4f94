"""Registering "tpu" with PyTorch: PrivateUse1 renamed, hooks, device guard, kernels, generators.

It is the one place that wires torchtpu into PyTorch (the device's kernels, the executors'
dispatch entry, the lowering table, ``torchtpu.tpu`` as ``torch.tpu``, the Dynamo backend, the
``tpu_dist`` process group, the third-party adapters), so it sits above every layer: no other
module registers anything with PyTorch as a side effect of being imported.

``register()`` is idempotent and is what both ``import torchtpu`` and the ``torch.backends``
entry point (plain ``import torch``) call.
"""

from __future__ import annotations

import functools
import itertools
import threading

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

_lock = threading.Lock()
_libraries: list = []


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        from torchtpu.device import control

        return control.is_available()

    def has_primary_context(self, device_index: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


class _GeneratorMeta(type(torch._C.Generator)):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch._C.Generator)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, torch._C.Generator)


class Generator(torch._C.Generator, metaclass=_GeneratorMeta):
    """``torch.Generator`` that also builds generators for the tpu device."""

    def __new__(cls, device="cpu"):
        if torch.device(device).type == "tpu":
            from torchtpu.device.random import TpuGenerator

            return TpuGenerator(device)
        return torch._C.Generator(device)


# torch.set_float32_matmul_precision's names, as torch.tpu.Precision.
_TORCH_PRECISIONS = {"highest": "HIGHEST", "high": "HIGH", "medium": "DEFAULT"}


def _install_matmul_precision() -> None:
    """``torch.set_float32_matmul_precision`` also sets ``torch.tpu``'s precision."""
    from torchtpu.device import control

    original = torch.set_float32_matmul_precision

    def set_float32_matmul_precision(precision: str) -> None:
        original(precision)
        control.set_precision(control.Precision[_TORCH_PRECISIONS[precision]])

    torch.set_float32_matmul_precision = set_float32_matmul_precision


def _moves_tpu(module: torch.nn.Module, device) -> bool:
    """Whether converting module's tensors to device moves any of them onto or off the tpu."""
    if device is None:
        return False
    to_tpu = torch.device(device).type == "tpu"
    tensors = itertools.chain(module.parameters(), module.buffers())
    return any((t.device.type == "tpu") != to_tpu for t in tensors)


def _swapping_when(moves):
    """Wraps a Module conversion method to swap parameters in place when moves(...) says so."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            future = torch.__future__
            try:
                swap = not future.get_swap_module_params_on_conversion() and \
                    moves(self, *args, **kwargs)
            except Exception:  # arguments the method itself will refuse, in its own words
                swap = False
            if not swap:
                return method(self, *args, **kwargs)
            # A swap gives each parameter the class of a new Parameter; a lazy module's
            # UninitializedParameter must stay one (CUDA's `.data =` path keeps it), or its
            # first forward never materializes it.
            lazy = [(p, type(p)) for p in self.parameters() if torch.nn.parameter.is_lazy(p)]
            future.set_swap_module_params_on_conversion(True)
            try:
                return method(self, *args, **kwargs)
            finally:
                future.set_swap_module_params_on_conversion(False)
                for param, cls in lazy:
                    param.__class__ = cls

        return run

    return wrap


def _install_parameter_swap() -> None:
    # A move onto or off the device (Module.to("tpu"), .tpu(), .cpu(), .to_empty) would replace
    # each Parameter by a new object (PyTorch's shallow-copy check does not know PrivateUse1),
    # splitting tied weights in two, so those moves swap tensors in place. Every other
    # conversion keeps PyTorch's own ``.data =``: a swap refuses a parameter that an autograd
    # graph still holds, so a global switch made ``conv.to(memory_format=...)`` after a forward
    # fail, on CPU too.
    module = torch.nn.Module
    module.to = _swapping_when(
        lambda m, *a, **k: _moves_tpu(m, torch._C._nn._parse_to(*a, **k)[0]))(module.to)
    module.cpu = _swapping_when(lambda m: _moves_tpu(m, "cpu"))(module.cpu)
    module.tpu = _swapping_when(lambda m, device=None: _moves_tpu(m, "tpu"))(module.tpu)
    module.to_empty = _swapping_when(
        lambda m, *, device, recurse=True: _moves_tpu(m, device))(module.to_empty)


def register() -> None:
    with _lock:
        if _libraries:
            return
        from torchtpu import lowering, tpu  # noqa: F401  (lowering fills the lowering table)
        from torchtpu.device import (
            autocast,
            kernels,
            loader,
            pinned,
            quantized,
            set_data,
            sparse,
            storage,
        )
        from torchtpu.eager import dispatch, sdpa_routing

        _setup_privateuseone_for_python_backend(
            "tpu", backend_module=tpu, hook=_Hooks(), device_guard=_DeviceGuard()
        )
        pinned.install()  # pin_memory() and DDP's find_unused_parameters need it
        aten = torch.library.Library("aten", "IMPL")
        kernels.register(aten)
        dispatch.register_lowered_ops(aten)
        sdpa_routing.register(aten)
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(dispatch.kernel, "PrivateUse1")
        autocast.register(aten, fallback)
        sparse_fallbacks = sparse.register(aten)
        quantized_fallback = quantized.register()
        storage.install_constructor()
        storage.install_pickling()
        storage.install_slicing()
        loader.install_pin_memory()
        set_data.install()  # tensor.data = ... onto or off the tpu, as for CUDA (FSDP2 needs it)
        from torchtpu.device import memory_limit

        memory_limit.install()  # TORCHTPU_MEMORY_LIMIT: launches over it are torchtpu.memory errors
        from torchtpu.tpu import accelerator

        accelerator.install()  # torch.accelerator's entry points, for tpu
        _install_matmul_precision()
        from torchtpu import profiler

        profiler.install()  # torch.profiler's ProfilerActivity.TPU records the device
        from torchtpu import integrations

        integrations.install()
        from torchtpu import compile as tpu_compile
        from torchtpu import distributed

        tpu_compile.install()  # the "tpu" torch.compile backend, registered when Dynamo loads
        distributed.register()
        # JAX's backend starts at the first tpu op, not here (eager/dispatch.handler), so that
        # torchtpu.distributed can start JAX's multi-process runtime first.
        _libraries.extend([aten, fallback, *sparse_fallbacks, quantized_fallback])
        torch.Generator = Generator
        _install_parameter_swap()

        from torchtpu.eager import modes

        modes.from_environment()
