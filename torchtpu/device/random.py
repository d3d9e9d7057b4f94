"""Device random state: ``torch.Generator(device="tpu")`` and the default device generators.

A device generator is a counter-based stream: (seed, offset). Each random op takes the next offset
and builds its JAX key from (seed, offset) inside the compiled program, so random ops compile once
and replay exactly for a given seed, in every executor.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from torchtpu.device.hooks import HOOKS
from torchtpu.runtime import platform

_DEFAULT_SEED = 67280421310721  # PyTorch's default_generator seed


# torch._C.Generator, not torch.Generator: that is registration's factory by the time this loads.
class TpuGenerator(torch._C.Generator):
    """A ``torch.Generator`` for the tpu device.

    PyTorch's C++ generator registry has no slot a Python backend can fill, so this subclass keeps
    the state in Python; it is still an instance of ``torch.Generator`` for every API that checks.
    """

    def __new__(cls, device=None):
        return super().__new__(cls, "cpu")

    def __init__(self, device=None) -> None:
        index = torch.device(device).index if device is not None else None
        self._index = platform.current_index() if index is None else platform.check_index(index)
        self._seed = _DEFAULT_SEED
        self._offset = 0
        self._lock = threading.Lock()
        _by_impl[self._cdata] = self

    @property
    def device(self) -> torch.device:
        return torch.device("tpu", self._index)

    def manual_seed(self, seed) -> TpuGenerator:
        seed = int(seed)
        if not -(2**63) <= seed < 2**64:
            raise RuntimeError(f"torchtpu.argument: Overflow when unpacking long long: seed "
                               f"{seed} is out of range")
        with self._lock:
            self._seed = seed % 2**64
            self._offset = 0
        return self

    def initial_seed(self) -> int:
        return self._seed

    def seed(self) -> int:
        s = int.from_bytes(np.random.default_rng().bytes(8), "little") >> 1
        self.manual_seed(s)
        return s

    def get_state(self) -> torch.Tensor:
        return torch.tensor(
            np.array([self._seed, self._offset], dtype=np.uint64).view(np.uint8).copy()
        )

    def set_state(self, state: torch.Tensor) -> TpuGenerator:
        if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8
                and state.numel() == 16):
            raise RuntimeError("torchtpu.argument: tpu generator state must be a uint8 tensor of "
                               "16 bytes "
                               "(from get_state())")
        seed, offset = np.frombuffer(state.cpu().numpy().tobytes(), dtype=np.uint64)
        with self._lock:
            self._seed, self._offset = int(seed), int(offset)
        return self

    # get_offset/set_offset count as CUDA's Philox offsets do for a small op: 4 a random op.
    # Code written for CUDA steps a generator back one draw with set_offset(get_offset() - 4)
    # (vLLM, undoing the sample of a request still prefilling); counted 1 an op, that would land
    # three draws back and repeat earlier noise.
    OFFSET_STEP = 4

    def get_offset(self) -> int:
        return self._offset * self.OFFSET_STEP

    def set_offset(self, offset: int) -> TpuGenerator:
        offset = int(offset)
        if offset < 0:
            raise RuntimeError(f"torchtpu.argument: a generator's offset is at least 0, not "
                               f"{offset}")
        with self._lock:
            self._offset = offset // self.OFFSET_STEP
        return self

    def next_key_data(self) -> np.ndarray:
        """The seed and offset for one random op, as uint32 words; advances the stream."""
        with self._lock:
            offset = self._offset
            self._offset += 1
        s = self._seed
        data = np.array([s & 0xFFFFFFFF, s >> 32, offset & 0xFFFFFFFF, offset >> 32],
                        dtype=np.uint32)
        on_draw = HOOKS.on_draw
        if on_draw is not None:
            on_draw(self, data)
        return data


_defaults: dict[int, TpuGenerator] = {}

# TpuGenerators by the address of the C++ generator under them (torch.Generator._cdata).
_by_impl: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def default_generator(index: int | None = None) -> TpuGenerator:
    index = platform.current_index() if index is None else platform.check_index(index)
    gen = _defaults.get(index)
    if gen is None:
        gen = _defaults[index] = TpuGenerator(torch.device("tpu", index))
    return gen


def key_data_for(generator) -> np.ndarray:
    """Key data for one random op drawn from generator (None: the default device generator)."""
    if generator is None:
        return default_generator().next_key_data()
    if not isinstance(generator, TpuGenerator):
        # A generator that went through the C++ dispatcher comes back as a new plain
        # torch.Generator around the same C++ generator: find the TpuGenerator that owns it.
        generator = _by_impl.get(generator._cdata, generator)
    if not isinstance(generator, TpuGenerator):
        raise RuntimeError(
            f"torchtpu.device: Expected a 'tpu' device type for generator but found "
            f"'{generator.device.type}'"
        )
    return generator.next_key_data()
