"""The device layer's half of ``torch.tpu``: device choice and properties, RNG seeding, precision.

``torchtpu.tpu`` (the module users see as ``torch.tpu``) re-exports these beside the other layers'
functions; nothing here knows about executors.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import torch

from torchtpu.device import launch, memory
from torchtpu.device import random as _random
from torchtpu.device.hooks import HOOKS
from torchtpu.runtime import platform


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
        raise TypeError(f"torchtpu.argument: precision must be a torch.tpu.Precision, not {mode!r}")
    recorder = HOOKS.deferrer
    if recorder is not None and mode is not get_precision():
        recorder.precision_changed()
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
        raise ValueError(f"torchtpu.device: expected a tpu device, got {d}")
    return platform.check_index(d.index if d.index is not None else platform.current_index())


def set_device(device) -> None:
    _index(device)  # one device per process: tpu:0 (or tpu:LOCAL_RANK) names it; no switching


@contextlib.contextmanager
def device(index):
    previous = current_device()
    set_device(index)
    try:
        yield
    finally:
        set_device(previous)


@contextlib.contextmanager
def device_of(obj):
    """torch.cuda's ``device_of``: obj's device is the current one inside the block (nothing
    changes for anything but a tpu tensor)."""
    if isinstance(obj, torch.Tensor) and obj.device.type == "tpu":
        with device(obj.device):
            yield
    else:
        yield


def exchange_device(index: int) -> int:
    """Make index the current device and return the previous one (-1: nothing changes, -1
    returned), as torch.cuda's; one device per process, so the index is only checked."""
    if index < 0:
        return -1
    previous = current_device()
    set_device(index)
    return previous


maybe_exchange_device = exchange_device  # torch.cuda's variant that need not initialize


def torchtpu_synchronize():
    """The trivial program ``wait`` launches (profilers leave it out of the device's work)."""
    return jnp.zeros((), jnp.int32)


@functools.cache
def _barrier():
    return jax.jit(torchtpu_synchronize,
                   out_shardings=jax.sharding.SingleDeviceSharding(platform.local_device()))


def wait(device=None, wait: bool = True) -> None:
    """Wait for all work queued on the device, or only for the values of ``device`` when it is a
    list of tensors.

    A device runs its programs in launch order (XLA:CPU's too, measured: a trivial program
    launched behind twenty queued matmuls finishes after them), so waiting for a trivial program
    launched now waits for every program before it, also those whose results were dropped, as
    CUDA's synchronize does; live arrays are waited for as well, for their host-to-device
    copies, which are not programs. Nothing pending in an executor is run here:
    ``torch.tpu.synchronize`` flushes first.
    """
    from torchtpu.device import tensors

    if isinstance(device, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in device):
        arrays = [tensors.storage_array(t) for t in device]
    else:
        _index(device)
        arrays = [_barrier()(), *jax.live_arrays()]
    if wait:
        # One batched wait: a Python loop of block_until_ready costs ~1 µs per live array.
        launch.wait(jax.block_until_ready, arrays)


def get_device_name(device=None) -> str:
    d = platform.jax_device(_index(device))
    return f"{platform.platform().upper()} ({getattr(d, 'device_kind', 'unknown')})"


def get_compute_capability(device=None) -> str:
    """"" (the reference's answer): a TPU has no CUDA compute capability."""
    _index(device)
    return ""


def get_local_device_attributes() -> dict:
    """What PJRT says of this process's device: id, platform, kind, process index and, on a
    TPU, its coordinates and core."""
    d = platform.jax_device(platform.current_index())
    names = ("id", "platform", "device_kind", "process_index", "coords", "core_on_chip",
             "num_cores", "slice_index")
    return {n: getattr(d, n) for n in names if getattr(d, n, None) is not None}


def is_triton_capable(device=None) -> bool:
    """False: Triton kernels do not run on XLA devices (Pallas kernels do: torch.tpu.pallas)."""
    _index(device)
    return False


def is_gpu() -> bool:
    """Whether "tpu" runs on XLA:GPU here (``TORCHTPU_PLATFORM``, or a GPU and no TPU)."""
    return platform.platform() == "gpu"


def get_device_properties(device=None) -> DeviceProperties:
    _index(device)
    return DeviceProperties(get_device_name(device), platform.platform(), memory.total_memory())


def manual_seed(seed: int) -> None:
    _random.default_generator().manual_seed(seed)


# The "_all" functions cover the devices this process drives: one. device_count() also counts
# the host's other processes' devices (their indices), which this process cannot seed.
def manual_seed_all(seed: int) -> None:
    _random.default_generator().manual_seed(seed)


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
    return [get_rng_state()]


def set_rng_state_all(states) -> None:
    for s in states:
        set_rng_state(s)


def get_amp_supported_dtype() -> list:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def default_generators() -> tuple:
    return (_random.default_generator(),)
