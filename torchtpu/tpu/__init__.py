"""``torch.tpu``: the one module users see, the face of every layer.

It sits above the layers and only gathers their public functions: device selection, RNG and
precision from ``device/``, memory figures from ``device/memory``, eager modes and
materialization from ``eager/``. Submodules that pull in heavier layers (``torch.tpu.distributed``,
``torch.tpu.pallas``, ...) are imported on first access, so ``import torch`` stays cheap.
Registration installs this module as ``torch.tpu`` (``torchtpu/registration.py``).
"""

from __future__ import annotations

import importlib
import sys
import types

import torch

from torchtpu import settings
from torchtpu.cache import cache_policy as _cache_policy
from torchtpu.cache import compile_cache as _compile_cache
from torchtpu.device import asserts as _asserts
from torchtpu.device import memory as _memory
from torchtpu.device import ownership as _ownership
from torchtpu.device.control import (
    DeviceProperties,
    Precision,
    _is_in_bad_fork,
    current_device,
    default_generators,
    device,
    device_count,
    device_of,
    exchange_device,
    get_amp_supported_dtype,
    get_compute_capability,
    get_device_name,
    get_device_properties,
    get_local_device_attributes,
    get_precision,
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    is_available,
    is_bf16_supported,
    is_gpu,
    is_initialized,
    is_triton_capable,
    manual_seed,
    manual_seed_all,
    maybe_exchange_device,
    precision,
    seed,
    seed_all,
    set_device,
    set_precision,
    set_rng_state,
    set_rng_state_all,
)
from torchtpu.device.control import _index as _check  # validates a device argument
from torchtpu.device.control import wait as _wait
from torchtpu.eager import executor as _executor
from torchtpu.eager import modes as _modes
from torchtpu.eager.modes import EagerMode, set_eager_mode
from torchtpu.layers import scan_layers
from torchtpu.tpu.graphs import *  # noqa: F403 (TPUGraph, graph, make_graphed_callables, streams)
from torchtpu.tpu.graphs import __all__ as _graphs_all
from torchtpu.tpu.storages import *  # noqa: F403 (FloatStorage, ..., as torch.cuda's)
from torchtpu.tpu.storages import __all__ as _storages_all

# Submodules imported on first attribute access (each is ``torchtpu/tpu/<name>.py``).
_LAZY_SUBMODULES: frozenset = frozenset({"distributed", "memory", "ops", "pallas", "profiler",
                                        "tools"})


def synchronize(device=None, wait: bool = True) -> None:
    """Run everything pending and wait for the device.

    ``device`` may also be a list of tpu tensors (the reference's ``synchronize(tensors, wait)``):
    then only their values are waited for; ``wait=False`` starts the work without waiting.
    """
    _executor.flush()
    _wait(device, wait)
    _memory.sample()
    _asserts.raise_pending()


def is_materialized(t: torch.Tensor) -> bool:
    """Whether t's value exists on the device (False while DeferAndFuse holds it pending)."""
    return _ownership.is_materialized(t)


def pending_hlo() -> str:
    """The computation DeferAndFuse holds pending, as StableHLO text ("" when none), unrun."""
    from torchtpu.eager import defer

    return defer.pending_hlo()


def _memory_function(figure):
    def query(device=None) -> int:
        _check(device)
        return figure()

    query.__name__ = figure.__name__
    query.__doc__ = figure.__doc__
    return query


memory_allocated = _memory_function(_memory.memory_allocated)
max_memory_allocated = _memory_function(_memory.max_memory_allocated)
memory_reserved = _memory_function(_memory.memory_reserved)
max_memory_reserved = _memory_function(_memory.max_memory_reserved)
memory_stats = _memory_function(_memory.memory_stats)
memory_summary = _memory_function(_memory.memory_summary)
mem_get_info = _memory_function(_memory.mem_get_info)


def reset_peak_memory_stats(device=None) -> None:
    _check(device)
    _memory.reset_peak_memory_stats()


reset_max_memory_allocated = reset_peak_memory_stats


def reset_accumulated_memory_stats(device=None) -> None:
    _check(device)
    _memory.reset_accumulated_memory_stats()


def empty_cache() -> None:
    """XLA frees each buffer when its last array dies (no caching pool to release). What a
    steady loop froze for Python's garbage collector (``eager/frozen.py``: Strict's training
    loop, DeferAndFuse's) is handed back and collected, so CUDA's idiom ``del model;
    gc.collect(); torch.cuda.empty_cache()`` frees the device memory a dropped model's reference
    cycles hold here too (the frozen cycles would otherwise wait for the loop's next refreeze)."""
    import gc

    from torchtpu.eager import defer, frozen

    before = gc.get_freeze_count()
    frozen.STRICT_LOOP.reset()
    defer.RECORDER.unfreeze()
    if gc.get_freeze_count() < before:
        gc.collect()


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """CUDA's call: launches that would take this process over ``fraction`` of the device's
    memory raise ``torch.OutOfMemoryError`` (``torchtpu.memory:``); see device/memory_limit."""
    from torchtpu.device import memory_limit

    _check(device)
    memory_limit.set_per_process_memory_fraction(fraction)


def custom_compiler_options(options: dict):
    """The reference's context manager: XLA compiler options for what compiles inside it
    (``xla_optimization_level``: O0-O3, ...); see runtime/compiler_options."""
    from torchtpu.runtime import compiler_options

    return compiler_options.custom_compiler_options(options)


class _Stats(dict):
    """A dict whose keys also read as attributes (the reference's scripts read
    ``stats.num_cache_reqs``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _get_cache_stats() -> dict:
    """The persistent compile cache's statistics in this process (the reference's names):
    ``num_cache_reqs``, ``num_cache_hits`` and, per entry read, ``read_count``, ``last_read`` and
    ``compilation_duration`` (seconds); empty figures when the cache is off. Keys read as
    attributes too."""
    store = _compile_cache.store()
    if store is None:
        return _Stats(num_cache_reqs=0, num_cache_hits=0, entries={}, cache_dir=None,
                      max_bytes=0)
    return _Stats(store.stats())


def _set_allow_cache(allow: bool = True) -> None:
    """Read and write the persistent compile cache (False: every program compiles here)."""
    _cache_policy.set_allow(allow)


def _set_cache_only(cache_only: bool = True) -> None:
    """Run only programs the compile cache has: a miss is a ``torchtpu.cache:`` error instead
    of a compile."""
    if cache_only and _compile_cache.store() is None:
        raise RuntimeError("torchtpu.cache: _set_cache_only(True) needs the compile cache, "
                           "which is off (TORCHTPU_CACHE_DIR=off)")
    _cache_policy.set_only(cache_only)


def _set_dump_on_cache_miss(enable: bool = True, directory: str | None = None) -> None:
    """Write each program the compile cache misses (StableHLO and optimized HLO, headed by the
    user line that built it) to directory (default ``TORCHTPU_DUMP``, else
    ``<tmp>/torchtpu-cache-misses``)."""
    if not enable:
        return _cache_policy.set_dump_misses(None)
    import os
    import tempfile

    directory = directory or settings.DUMP.get() or \
        os.path.join(tempfile.gettempdir(), "torchtpu-cache-misses")
    _cache_policy.set_dump_misses(directory)


def _get_dump_on_cache_miss() -> bool:
    return _cache_policy.dump_misses() is not None


def _clear_cache() -> None:
    """Drop the compiled programs this process holds (the next call of each reads it back from
    the persistent cache, or compiles it)."""
    import jax

    _executor.flush()
    jax.clear_caches()


def _hbm_usage_summary() -> str:
    """Device memory in use by this process (``memory_summary``'s figures; on a TPU its HBM)."""
    return f"device memory of {get_device_name()}:\n{_memory.memory_summary()}"


class _TpuModule(types.ModuleType):
    """Module type of ``torch.tpu``: ``eager_mode`` reads and assigns like an attribute, and the
    heavier submodules load on first use."""

    @property
    def eager_mode(self) -> EagerMode:
        return _modes.get_eager_mode()

    @eager_mode.setter
    def eager_mode(self, mode: EagerMode) -> None:
        _modes.switch(mode)

    def __getattr__(self, name: str):
        if name in _LAZY_SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'torch.tpu' has no attribute {name!r}")


sys.modules[__name__].__class__ = _TpuModule

__all__ = [
    "DeviceProperties", "EagerMode", "Precision", "current_device", "default_generators",
    "device", "device_count", "empty_cache", "get_amp_supported_dtype", "get_device_name",
    "get_device_properties", "get_precision", "get_rng_state", "get_rng_state_all",
    "initial_seed", "is_available", "is_bf16_supported", "is_initialized", "is_materialized",
    "manual_seed", "manual_seed_all", "max_memory_allocated", "max_memory_reserved",
    "mem_get_info", "memory_allocated", "memory_reserved", "memory_stats", "memory_summary",
    "pending_hlo", "precision", "reset_accumulated_memory_stats", "reset_max_memory_allocated",
    "reset_peak_memory_stats",
    "scan_layers", "seed", "custom_compiler_options", "set_per_process_memory_fraction",
    "seed_all", "set_device", "set_eager_mode", "set_precision", "set_rng_state",
    "set_rng_state_all", "synchronize", "_get_cache_stats", "_is_in_bad_fork", "device_of",
    "exchange_device", "maybe_exchange_device", "get_compute_capability",
    "get_local_device_attributes", "is_triton_capable", "is_gpu", "_hbm_usage_summary",
    "_set_allow_cache", "_set_cache_only", "_set_dump_on_cache_miss", "_get_dump_on_cache_miss",
    "_clear_cache", *_graphs_all,
    *_storages_all,
]
