"""A compiled graph's constants (tensors made while tracing: an empty tensor a cache starts from,
a literal ``torch.tensor([...])``), as its program takes them.

They are read once and kept while each keeps the same value: a device constant while its storage
holds the same array (any write gives it another), a CPU constant while its version counter
stands. Read at every call, a constant that reads as a view (a 0-element tensor over an empty
storage) was a program call each call, and a CPU one a transfer.
"""

from __future__ import annotations

import torch

from torchtpu.device import kernels, ownership, tensors
from torchtpu.runtime import platform, transfer


def value(t: torch.Tensor):
    """Constant t's value as a program input: a CPU one (``torch.tensor([...])`` moved to the
    device inside the compiled code) crosses to the device."""
    if t.is_cpu:
        return transfer.put(kernels.torch_to_numpy(t), platform.local_device())
    array = tensors.read(t)
    return array.__jax_array__() if isinstance(array, ownership.Deferred) else array


class Constants:
    """The constants of one graph, ``read()`` at each call."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: list) -> None:
        self.gm, self.names = gm, [n.target for n in nodes]
        self._kept: tuple | None = None  # (what each value was read from, the values)

    def _tensors(self) -> list:
        return [getattr(self.gm, name) for name in self.names]

    @staticmethod
    def _held(ts: list) -> tuple:
        return tuple(t._version if t.is_cpu else t.untyped_storage()._tpu_array for t in ts)

    def read(self, capturing: bool = False) -> tuple:
        ts = self._tensors()
        if capturing:  # a capture reads its own values of them (a value it has not computed)
            return tuple(value(t) if t.is_cpu else tensors.read(t) for t in ts)
        held, kept = self._held(ts), self._kept
        if kept is None or any(a is not b for a, b in zip(held, kept[0], strict=True)):
            values = tuple(map(value, ts))
            kept = self._kept = (self._held(ts), values)  # a read may have computed or made them
        return kept[1]
