"""Which PJRT platform and device this process runs on.

TPU if present, else GPU, else CPU; ``TORCHTPU_PLATFORM=tpu|gpu|cpu`` overrides. One process
drives one device, "tpu:0": ``TORCHTPU_LOCAL_DEVICE`` (or torchrun's ``LOCAL_RANK``) picks which
of the host's devices it is.
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


@functools.cache
def local_device():
    """The one JAX device this process drives as "tpu:0".

    PyTorch's Python-backend hooks know a single device per process (its device guard reports
    index 0 and a count of 1), so torchtpu is one process per device, as torchrun runs it:
    ``TORCHTPU_LOCAL_DEVICE`` picks the local accelerator, else ``LOCAL_RANK``, else the first.
    """
    local = devices()
    chosen = os.environ.get("TORCHTPU_LOCAL_DEVICE", os.environ.get("LOCAL_RANK", "0"))
    try:
        index = int(chosen)
    except ValueError:
        raise ValueError(f"TORCHTPU_LOCAL_DEVICE/LOCAL_RANK={chosen!r} is not an integer") from None
    if not 0 <= index < len(local):
        raise RuntimeError(
            f"TORCHTPU_LOCAL_DEVICE/LOCAL_RANK={index} but this host has {len(local)} "
            f"{platform()} device(s)"
        )
    device = local[index]
    jax.config.update("jax_default_device", device)
    return device


def device_count() -> int:
    """Devices this process drives: one (see ``local_device``)."""
    return 1


def check_index(index: int) -> int:
    if not isinstance(index, int) or index != 0:
        raise RuntimeError(
            f"invalid tpu device index {index!r}: this process drives one device, tpu:0 "
            f"(one process per device; pick the local accelerator with TORCHTPU_LOCAL_DEVICE "
            f"or torchrun's LOCAL_RANK; this host has {len(devices())} {platform()} device(s))"
        )
    return index


def current_index() -> int:
    return 0


def jax_device(index: int | None = None):
    """The JAX device behind tpu:index."""
    if index is not None:
        check_index(index)
    return local_device()
