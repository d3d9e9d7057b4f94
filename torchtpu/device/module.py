"""The ``torch.tpu`` device module: the reference's device, RNG, memory and eager-mode API."""

from __future__ import annotations

import contextlib
import enum
import sys
import types
from typing import NamedTuple

import jax
import torch

from torchtpu.device import random as _random
from torchtpu.device import storage as _storage
from torchtpu.runtime import platform


class EagerMode(enum.Enum):
    DEFER_NEVER = "strict"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"
    DEFER_AND_FUSE = "defer_and_fuse"


class Precision(enum.Enum):
    DEFAULT = "default"
    HIGH = "high"
    HIGHEST = "highest"


class DeviceProperties(NamedTuple):
    name: str
    platform: str
    total_memory: int


def get_precision() -> Precision:
    """The matmul/convolution precision of float32 work on the device."""
    return Precision(jax.config.jax_default_matmul_precision or "default")


def set_precision(mode: Precision) -> None:
    """Set the matmul/convolution precision; programs are cached per precision."""
    if not isinstance(mode, Precision):
        raise TypeError(f"precision must be a torch.tpu.Precision, not {mode!r}")
    jax.config.update("jax_default_matmul_precision", mode.value)


@contextlib.contextmanager
def precision(mode: Precision):
    """Run the block at mode (process-wide, so ops on the autograd thread follow it too)."""
    previous = get_precision()
    set_precision(mode)
    try:
        yield
    finally:
        set_precision(previous)


def is_available() -> bool:
    try:
        return platform.device_count() > 0
    except RuntimeError:
        return False


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return platform.device_count()


def current_device() -> int:
    return platform.current_index()


def _index(device) -> int:
    if device is None:
        return platform.current_index()
    if isinstance(device, int):
        return platform.check_index(device)
    d = torch.device(device)
    if d.type != "tpu":
        raise ValueError(f"expected a tpu device, got {d}")
    return platform.check_index(d.index if d.index is not None else platform.current_index())


def set_device(device) -> None:
    _index(device)  # one device per process: only tpu:0 is valid


@contextlib.contextmanager
def device(index):
    previous = current_device()
    set_device(index)
    try:
        yield
    finally:
        set_device(previous)


def synchronize(device=None, wait: bool = True) -> None:
    """Run everything pending and wait for the device.

    ``device`` may also be a list of tpu tensors (the reference's ``synchronize(tensors, wait)``):
    then only their values are waited for; ``wait=False`` starts the work without waiting.
    """
    from torchtpu.device import tensors
    from torchtpu.eager import executor

    if isinstance(device, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in device):
        executor.flush()
        arrays = [tensors.storage_array(t) for t in device]
    else:
        _index(device)
        executor.flush()
        arrays = jax.live_arrays()
    if wait:
        for array in arrays:
            array.block_until_ready()


def get_device_name(device=None) -> str:
    d = platform.jax_device(_index(device))
    return f"{platform.platform().upper()} ({getattr(d, 'device_kind', 'unknown')})"


def get_device_properties(device=None) -> DeviceProperties:
    d = platform.jax_device(_index(device))
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    total = (stats or {}).get("bytes_limit", 0)
    if not total:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceProperties(get_device_name(device), platform.platform(), int(total))


def memory_allocated(device=None) -> int:
    """Bytes held by live tpu tensors' storages in this process."""
    _index(device)
    return _storage.live_bytes()


def manual_seed(seed: int) -> None:
    _random.default_generator().manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _random.default_generator(i).manual_seed(seed)


def seed() -> None:
    _random.default_generator().seed()


def seed_all() -> None:
    s = _random.default_generator().seed()
    manual_seed_all(s)


def initial_seed() -> int:
    return _random.default_generator().initial_seed()


def get_rng_state(device="tpu") -> torch.Tensor:
    return _random.default_generator(_index(device)).get_state()


def set_rng_state(new_state: torch.Tensor, device="tpu") -> None:
    _random.default_generator(_index(device)).set_state(new_state)


def get_rng_state_all() -> list:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(states) -> None:
    for i, s in enumerate(states):
        set_rng_state(s, i)


def get_amp_supported_dtype() -> list:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def default_generators() -> tuple:
    return tuple(_random.default_generator(i) for i in range(device_count()))


def is_materialized(t: torch.Tensor) -> bool:
    """Whether t's value exists on the device (False while DeferAndFuse holds it pending)."""
    from torchtpu.eager import executor

    return executor.is_materialized(t)


def pending_hlo() -> str:
    """The computation DeferAndFuse holds pending, as StableHLO text ("" when none), unrun."""
    from torchtpu.eager import defer

    return defer.pending_hlo()


def set_eager_mode(mode: EagerMode):
    """Context manager: run the block in mode, then restore the previous mode."""
    from torchtpu.eager import modes

    return modes.set_eager_mode(mode)


class _TpuModule(types.ModuleType):
    """Module type of ``torch.tpu`` so that ``eager_mode`` reads and assigns like an attribute."""

    @property
    def eager_mode(self) -> EagerMode:
        from torchtpu.eager import modes

        return modes.get_eager_mode()

    @eager_mode.setter
    def eager_mode(self, mode: EagerMode) -> None:
        from torchtpu.eager import modes

        modes.switch(mode)


sys.modules[__name__].__class__ = _TpuModule
