"""Registering "tpu" with PyTorch: PrivateUse1 renamed, hooks, device guard, kernels, generators.

It is the one place that wires torchtpu into PyTorch (the device's kernels, the executors'
dispatch entry, the lowering table, ``torchtpu.tpu`` as ``torch.tpu``, the Dynamo backend, the
``tpu_dist`` process group, the third-party adapters), so it sits above every layer: no other
module registers anything with PyTorch as a side effect of being imported.

``register()`` is idempotent and is what both ``import torchtpu`` and the ``torch.backends``
entry point (plain ``import torch``) call. It imports no JAX (``import torch`` pays ~0.05 s for
it): it names the device, installs what must answer before the device's first op (torch.tpu as
a stand-in module, a PrivateUse1 fallback that loads the device, the storage constructor's and
the profiler's guards, the Dynamo, distributed and integration hooks) and leaves the rest to
``ensure_loaded()``, which the first tpu op, the first attribute of ``torch.tpu`` or the first
tpu storage calls: the kernels, the lowering table, the executors, the real ``torch.tpu``.
"""

from __future__ import annotations

import functools
import gc
import itertools
import sys
import threading
import types

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


# Asked by every device guard PyTorch makes (autograd's engine makes several per backward
# node, ~5,300 calls a 12-layer Llama step under DeferAndFuse): a constant.
_PRIVATE_USE1 = torch._C._autograd.DeviceType.PrivateUse1


class _DeviceGuard(torch._C._acc.DeviceGuard):
    # No Python frame a call: pybind11 calls the attribute it finds, here a C-level callable
    # of no arguments returning the constant (a slot wrapper: not a builtin function, which
    # pybind11 would take for its own, not overridden, method). ~2-3% of the recording's CPU.
    type_ = itertools.repeat(_PRIVATE_USE1).__next__


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


def _apply_matmul_precision() -> None:
    from torchtpu.device import control

    control.set_precision(control.Precision[_TORCH_PRECISIONS[
        torch.get_float32_matmul_precision()]])


def _install_matmul_precision() -> None:
    """``torch.set_float32_matmul_precision`` also sets ``torch.tpu``'s precision (at once when
    the device is loaded, else when it loads: a script's first line must not load JAX)."""
    original = torch.set_float32_matmul_precision

    def set_float32_matmul_precision(precision: str) -> None:
        original(precision)
        if _state["loaded"]:
            _apply_matmul_precision()

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


def _load_first(cls, name: str, wants_tpu) -> None:
    """Make ``cls.name`` load the device first when a call of it is about the tpu (a storage
    built on it, a profile of it) and the device is not loaded yet: loading installs the real
    method, which then answers the call."""
    original = getattr(cls, name)

    def method(*args, **kwargs):
        if not _state["loaded"] and wants_tpu(*args, **kwargs):
            ensure_loaded()
            return getattr(cls, name)(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(cls, name, method)


def _accelerator_is_tpu(*args, **kwargs) -> bool:
    current = torch._C._accelerator_getAccelerator()
    return current is not None and current.type == "tpu"


def _guard_accelerator() -> None:
    """torch.accelerator's bindings (``torch._C._accelerator_*``, which its module functions
    call) and its ``synchronize`` load the device first while tpu is the accelerator; then
    ``tpu/accelerator.py``'s replacements answer them."""
    for name in dir(torch._C):
        if name.startswith("_accelerator_") and name != "_accelerator_getAccelerator":
            _load_first(torch._C, name, _accelerator_is_tpu)
    _load_first(torch.accelerator, "synchronize", _accelerator_is_tpu)


def _names_tpu(klass, *args, device=None, **kwargs) -> bool:
    return device is not None and torch.device(device).type == "tpu"


def _profiles_tpu(prof) -> bool:
    return getattr(prof, "use_device", None) == "tpu"


class _Face(types.ModuleType):
    """``torch.tpu`` until the device loads: the first attribute asked of it loads the device and
    the real module (``torchtpu.tpu``), which answers it and from then on is ``torch.tpu``."""

    def __getattr__(self, name: str):
        # Module probes (inspect.getmodule reads every module's __file__) must not load JAX.
        if name.startswith("__") and name != "__all__":
            raise AttributeError(name)
        return getattr(_real_face(), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(_real_face(), name, value)

    def __dir__(self):
        return dir(_real_face())

    # torch.manual_seed and torch.seed seed every registered device: a script's first line must
    # not load JAX, so the seed waits for the device (as CUDA seeds lazily).
    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        if _state["loaded"]:
            _real_face().manual_seed_all(seed)
        else:
            _state["seed"] = int(seed)


def _real_face() -> types.ModuleType:
    ensure_loaded()
    return sys.modules["torchtpu.tpu"]


def _first_op(keys, op, *args, **kwargs):
    """The PrivateUse1 fallback until the device loads: the first tpu op loads it, then runs
    on the kernels just registered."""
    ensure_loaded()
    return op.redispatch(keys, *args, **kwargs)


# "light": register() ran; "loaded": ensure_loaded() finished; "loading": it is running.
# "seed": torch.manual_seed's before the device loaded.
_state = {"light": False, "loaded": False, "loading": False, "seed": None}
_load_lock = threading.RLock()


def register() -> None:
    """Name the device and install what must answer before its first op, without JAX: this is
    what ``import torch`` pays. The kernels, the lowering table and the executors load at the
    first tpu op (``ensure_loaded``)."""
    with _lock:
        if _state["light"]:
            return
        from torchtpu import compile as tpu_compile
        from torchtpu import distributed, integrations
        from torchtpu.device import loader, pinned
        from torchtpu.runtime import environment

        environment.remember()  # what JAX's import sets is put back (no child inherits it)
        from torchtpu.runtime import hooks

        hooks.at_start(_start_rooms)  # the cache and the TPU target hook, as the platform starts
        from torchtpu.runtime import chips

        # Under torchrun with several processes on a TPU host each takes its chips before
        # anything (a user's own JAX) can start the TPU client; elsewhere this reads a variable.
        chips.bind_from_environment()

        _setup_privateuseone_for_python_backend(
            "tpu", backend_module=_Face("torch.tpu", "torchtpu.tpu, loaded at its first use"),
            hook=_Hooks(), device_guard=_DeviceGuard())
        # Autocast's default for tpu, before a ``torch.autocast("tpu")`` made ahead of the
        # first op (the device loads then) reads PyTorch's float16.
        torch.set_autocast_dtype("tpu", torch.bfloat16)
        first = torch.library.Library("_", "IMPL")
        first.fallback(_first_op, "PrivateUse1", with_keyset=True)
        _libraries.append(first)
        pinned.install()  # pin_memory() and DDP's find_unused_parameters need it
        loader.install_pin_memory()
        _load_first(torch.UntypedStorage, "__new__", _names_tpu)
        import torch.autograd.profiler as autograd_profiler

        _load_first(autograd_profiler.profile, "_start_trace", _profiles_tpu)
        _guard_accelerator()
        _install_matmul_precision()
        integrations.install()
        tpu_compile.install()  # the "tpu" torch.compile backend, registered when Dynamo loads
        distributed.register()
        torch.Generator = Generator
        _install_parameter_swap()
        _state["light"] = True


def _start_rooms() -> None:
    """Load the rooms above the runtime as the platform starts (``runtime/hooks.start``): the
    compile cache with its warm-start records and the TPU target hook, each plugging itself in
    as it loads. Imported here, not at the top: they import JAX, which ``import torch`` must
    not pay for."""
    from torchtpu.cache import compile_cache, warm  # noqa: F401
    from torchtpu.targets import tpu_hook  # noqa: F401


def ensure_loaded() -> None:
    """Load the device (once, at its first use): kernels, lowering table, executors, the real
    ``torch.tpu``. JAX is imported here."""
    if _state["loaded"]:
        return
    with _load_lock:
        if _state["loaded"] or _state["loading"]:
            return
        _state["loading"] = True
        try:
            _load()
            _state["loaded"] = True
        finally:
            _state["loading"] = False


def _register_meta_kernels(lib: torch.library.Library) -> None:
    """The Meta kernels the lowering modules declare (``lowering.registry.meta_kernel``)."""
    from torchtpu.lowering.registry import META_KERNELS

    for op, fn in META_KERNELS.items():
        lib.impl(op, fn, "Meta")


def _collect_after_dynamo() -> None:
    """Collect the reference cycles Dynamo's import leaves. ``torch.fx.wrap``, called at the top
    of ``torch._dynamo.utils``, keeps its own frame, so every frame the import ran under stays,
    up to the caller of the tpu op whose meta kernel (or custom op) had PyTorch import Dynamo,
    that call's tensors among their locals, until the collector's next pass: whose timing (other
    threads' allocations) decided which outputs of a DeferAndFuse recording were alive at its
    flush, a part of its program's key, so a new process, importing nothing there, met another
    program than the first (test_defer_warm). Once a process, after a ~1.7-s import."""
    gc.collect()


def _load() -> None:
    from torchtpu import lowering, tpu  # noqa: F401  (lowering fills the lowering table)
    from torchtpu.device import (
        autocast,
        composed,
        kernels,
        memory_limit,
        quantized,
        set_data,
        sparse,
        storage,
        storage_slices,
    )
    from torchtpu.eager import dispatch, modes, sdpa_routing

    # First, as it can refuse its setting: a load that fails before anything is registered
    # leaves the first op's fallback in place, so every later tpu op raises the same error (a
    # failure past the swap below left no kernel: 'Could not run aten::empty.memory_format').
    memory_limit.install()  # TORCHTPU_MEMORY_LIMIT: launches over it are torchtpu.memory errors
    aten = torch.library.Library("aten", "IMPL")
    kernels.register(aten)
    composed.register(aten)
    _register_meta_kernels(aten)
    dispatch.register_lowered_ops(aten)
    sdpa_routing.register(aten)
    # The real fallback replaces the first op's, before anything here can make a tpu tensor.
    _libraries.pop(0)._destroy()
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(dispatch.kernel, "PrivateUse1")
    autocast.register(aten, fallback)
    sparse_fallbacks = sparse.register(aten)
    quantized_fallback = quantized.register()
    storage.install_constructor()
    storage.install_pickling()
    storage_slices.install()
    set_data.install()  # tensor.data = ... onto or off the tpu, as for CUDA (FSDP2 needs it)
    from torchtpu.tpu import accelerator

    accelerator.install()  # torch.accelerator's entry points, for tpu
    from torchtpu import compile as tpu_compile
    from torchtpu import distributed, profiler

    profiler.install()  # torch.profiler's ProfilerActivity.TPU records the device
    tpu_compile.load()
    distributed.load()
    # JAX's backend starts at the first op's launch, not here (eager/dispatch.handler), so that
    # torchtpu.distributed can start JAX's multi-process runtime first.
    _libraries.extend([aten, fallback, *sparse_fallbacks, quantized_fallback])
    if "torch._dynamo" not in sys.modules:
        from torchtpu.import_hooks import after_import

        after_import("torch._dynamo", _collect_after_dynamo)
    torch.tpu = sys.modules["torch.tpu"] = tpu
    modes.from_environment()
    if _state["seed"] is not None:
        tpu.manual_seed_all(_state["seed"])
    if torch.get_float32_matmul_precision() != "highest":
        _apply_matmul_precision()
