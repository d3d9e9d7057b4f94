"""Which PJRT platform and device this process runs on.

TPU if present, else GPU, else CPU; ``TORCHTPU_PLATFORM=tpu|gpu|cpu`` overrides. One process drives
the devices it sees; ``set_device`` picks which of them the "tpu" device index 0..n-1 means.
"""

from __future__ import annotations

import functools
import os

import jax

_PLATFORMS = ("tpu", "gpu", "cpu")


def _configure_jax() -> None:
    # PyTorch semantics need real int64/float64; JAX's default truncates them to 32 bits.
    jax.config.update("jax_enable_x64", True)
    # PyTorch's float32 matmuls are exact float32 by default ("highest");
    # torch.tpu.precision and torch.set_float32_matmul_precision change it.
    jax.config.update("jax_default_matmul_precision", "highest")
    from torchtpu.runtime import compile_cache

    compile_cache.enable()


_configure_jax()


@functools.cache
def platform() -> str:
    """The JAX platform name this process uses ("tpu", "gpu" or "cpu")."""
    wanted = os.environ.get("TORCHTPU_PLATFORM", "").strip().lower()
    if wanted:
        if wanted not in _PLATFORMS:
            raise ValueError(
                f"TORCHTPU_PLATFORM={wanted!r} is not one of {', '.join(_PLATFORMS)}"
            )
        try:
            jax.devices(wanted)
        except RuntimeError as e:
            raise RuntimeError(
                f"TORCHTPU_PLATFORM={wanted} was asked for, but JAX found no {wanted} devices: {e}"
            ) from e
        return wanted
    for name in _PLATFORMS:
        try:
            if jax.devices(name):
                return name
        except RuntimeError:
            continue
    raise RuntimeError("JAX found no usable device (not even CPU)")


@functools.cache
def devices() -> tuple:
    """The local JAX devices of the chosen platform, in index order."""
    return tuple(jax.local_devices(backend=platform()))


_current = 0


def device_count() -> int:
    return len(devices())


def check_index(index: int) -> int:
    n = device_count()
    if not isinstance(index, int) or not 0 <= index < n:
        raise RuntimeError(
            f"invalid tpu device index {index!r}: this process sees {n} device(s) "
            f"(valid indices 0..{n - 1})"
        )
    return index


def current_index() -> int:
    return _current


def set_current_index(index: int) -> None:
    global _current
    _current = check_index(index)


def jax_device(index: int | None = None):
    """The JAX device behind tpu:index (the current one when index is None)."""
    return devices()[_current if index is None else check_index(index)]
