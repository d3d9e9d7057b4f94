"""``python -m torch_tpu._internal.distributed.launchers.singlehost_wrapper``: how many processes
one host's ``torchrun`` starts, as shell assignments (``eval $(python -m ...)``), and the
reference's ``prepare_tpu_environment`` / ``tpu_env_wrapper`` for launching from Python.

torchtpu runs one process per device, from torchrun's variables alone (docs, Distributed), so
the one figure that matters is ``WORLD_SIZE``: the TPU chips of this host (counted from its PCI
devices, without opening them, so the workers can), else 1 (XLA:CPU), or the ``world_size``
asked for. ``TORCH_TPU_TOPOLOGY`` names the chips where there are some ("v5e:2x2"); the
reference's slice-builder addresses have no use here and are not made up.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

# Chips of one host, as a topology's dimensions.
_SHAPES = {1: "1x1", 2: "1x2", 4: "2x2", 8: "2x4"}


def _local_chips() -> tuple[int, str | None]:
    """(TPU chips on this host, their generation), read from the PCI ids without libtpu."""
    from jax._src import hardware_utils

    chips, version = hardware_utils.num_available_tpu_chips_and_device_id()
    return chips, version.name if chips and version is not None else None


def environment(world_size: int | None = None) -> dict:
    """The variables for this host's workers."""
    chips, generation = _local_chips()
    count = world_size if world_size is not None else max(chips, 1)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"torchtpu.argument: world_size must be a positive int, not "
                         f"{world_size!r}")
    if chips and count > chips:
        raise ValueError(f"torchtpu.device: world_size {count} asks for more devices than the "
                         f"{chips} TPU chips of this host; one process drives one chip")
    found = {"WORLD_SIZE": str(count)}
    if generation and count in _SHAPES:
        found["TORCH_TPU_TOPOLOGY"] = f"{generation}:{_SHAPES[count]}"
    return found


def prepare_tpu_environment(world_size: int | None = None) -> None:
    """Set this host's variables in ``os.environ``, for the workers a launcher starts from here
    (the caller asked for them: they are meant to reach those children)."""
    os.environ.update(environment(world_size))


class WorkerWrapper:
    """A picklable callable running ``func(*args, **kwargs)`` in each worker."""

    def __init__(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.__name__ = getattr(func, "__name__", str(func))
        self.__qualname__ = getattr(func, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        return self.func(*self.args, *args, **self.kwargs)


def tpu_env_wrapper(func: Callable[..., Any], *args: Any, world_size: int | None = None,
                    **kwargs: Any) -> WorkerWrapper:
    prepare_tpu_environment(world_size)
    return WorkerWrapper(func, *args, **kwargs)


def main(argv: list[str]) -> int:
    world_size = int(argv[0]) if argv else None
    for name, value in environment(world_size).items():
        print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
