"""Which PJRT platform and device this process runs on.

TPU if present, else GPU, else CPU; ``TORCHTPU_PLATFORM=tpu|gpu|cpu`` overrides. One process
drives one device: tensors say "tpu:0", and "tpu:LOCAL_RANK" names the same device (see
``check_index``); ``TORCHTPU_LOCAL_DEVICE`` (or torchrun's ``LOCAL_RANK``) picks which of the
host's devices it is.
"""

from __future__ import annotations

import functools
import os

import jax

from torchtpu import settings
from torchtpu.runtime import (
    chips,
    dump,
    hooks,
    jax_settings,  # noqa: F401  (its import makes the settings)
    notices,
)

# torchtpu's JAX settings (``jax_settings``, made at its import) come first; then the rooms
# above plug in (the compile cache, the TPU target hook: ``hooks.start``), and the dump and the
# compile notices wrap JAX's compile around what they installed.
hooks.start()
dump.install()
notices.install()

_PLATFORMS = ("tpu", "gpu", "cpu")


@functools.cache
def platform() -> str:
    """The JAX platform name this process uses ("tpu", "gpu" or "cpu")."""
    chips.check()  # a chip binding refused at import stops the first device use
    wanted = settings.PLATFORM.get()
    if wanted:
        try:
            jax.devices(wanted)
        except RuntimeError as e:
            raise RuntimeError(
                f"torchtpu.device: TORCHTPU_PLATFORM={wanted} was asked for, but JAX found no "
                f"{wanted} devices: {e}"
            ) from e
        return wanted
    for name in _PLATFORMS:
        try:
            if jax.devices(name):
                return name
        except RuntimeError:
            continue
    raise RuntimeError("torchtpu.device: JAX found no usable device (not even CPU)")


@functools.cache
def devices() -> tuple:
    """The local JAX devices of the chosen platform, in index order."""
    return tuple(jax.local_devices(backend=platform()))


def _env_int(names: tuple, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"torchtpu.config: {name}={value!r} is not an integer") from None
    return default


# This process's place among the processes of its host: its host-local index (torchrun's
# LOCAL_RANK) and how many processes share the host (LOCAL_WORLD_SIZE). Without torchrun both
# start as (0, 1); ``torchtpu.distributed`` sets them at init_process_group (mp.spawn).
_slot = [_env_int(("LOCAL_RANK",), 0), _env_int(("LOCAL_WORLD_SIZE",), 1)]


def set_process_slot(local_index: int, local_world_size: int) -> None:
    """Record this process's host-local index and the number of processes on its host."""
    if not 0 <= local_index < local_world_size:
        raise ValueError(f"torchtpu.device: local index {local_index} is not in [0, "
                         f"{local_world_size})")
    _slot[:] = [local_index, local_world_size]


def process_slot() -> tuple[int, int]:
    """(host-local index, processes on this host)."""
    return _slot[0], _slot[1]


def check_process_count(processes: int) -> None:
    """Refuse more processes on this host than it has devices (each drives one of its own).

    Counted only where one process sees the whole host (several local devices); a process that
    sees a single device (XLA:CPU, a chip per process) cannot tell, and needs no device to share.
    """
    visible = len(devices())
    if visible > 1 and processes > visible:
        raise RuntimeError(
            f"torchtpu.device: {processes} processes were started on this host, but it has "
            f"{visible} {platform()} devices and each process drives one of its own: start at "
            f"most {visible} per host (torchrun --nproc-per-node {visible}; Ray Train: "
            f"ScalingConfig(num_workers=...) of at most {visible} workers per node)"
        )


@functools.cache
def local_device():
    """The one JAX device this process drives as "tpu:0".

    PyTorch's Python-backend hooks know a single device per process (its device guard reports
    index 0 and a count of 1, and new tensors are made on index 0), so torchtpu is one process
    per device, as torchrun runs it. Which of the host's devices: ``TORCHTPU_LOCAL_DEVICE``, else
    ``LOCAL_RANK``, else the first; a process that sees a single device (XLA:CPU, a TPU or GPU
    limited to one chip per process) drives that one. The first call starts JAX's backend and pins
    its default device; nothing at import does, so ``torchtpu.distributed`` can start JAX's
    multi-process runtime first.
    """
    local = devices()
    if len(local) == 1:
        device = local[0]
    else:
        check_process_count(_slot[1])
        index = settings.LOCAL_DEVICE.get()
        if index is None:
            index = _env_int(("LOCAL_RANK",), 0)
        if not 0 <= index < len(local):
            raise RuntimeError(
                f"torchtpu.device: TORCHTPU_LOCAL_DEVICE/LOCAL_RANK={index} but this host has "
                f"{len(local)} "
                f"{platform()} device(s)"
            )
        device = local[index]
    jax.config.update("jax_default_device", device)
    notices.device_started(device, platform())
    return device


def device_count() -> int:
    """Devices addressable by index: one per process of this host (``LOCAL_WORLD_SIZE``)."""
    return _slot[1]


def check_index(index: int) -> int:
    """The index tensors carry (always 0) for a device index the user gave.

    tpu:0 is this process's device (the reference's convention) and so is tpu:LOCAL_RANK (the
    CUDA convention, ``f"cuda:{LOCAL_RANK}"``); every other index belongs to another process.
    """
    mine, count = _slot
    if isinstance(index, int) and not isinstance(index, bool) and index in (0, mine):
        return 0
    if isinstance(index, int) and 0 < index < count:
        raise RuntimeError(
            f"torchtpu.device: tpu:{index} belongs to another process of this host: this process "
            "(host-local "
            f"index {mine}) drives one device, addressable as tpu:0 or tpu:{mine}; use "
            f'torch.device("tpu") or f"tpu:{{LOCAL_RANK}}"'
        )
    raise RuntimeError(
        f"torchtpu.device: invalid tpu device index {index!r}: this process drives one device, "
        "tpu:0 "
        f"(also tpu:{mine}, its host-local index); {count} process(es) share this host, one per "
        f"device (torchrun's LOCAL_RANK picks each one's device)"
    )


def current_index() -> int:
    return 0


def jax_device(index: int | None = None):
    """The JAX device behind tpu:index."""
    if index is not None:
        check_index(index)
    return local_device()
