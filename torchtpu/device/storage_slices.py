"""``storage[a:b]`` of a device storage: a slice that reads its base storage's bytes.

PyTorch makes the slice a second StorageImpl with no array of its own; ``install`` turns it into
a ``_Slice`` that reads the base's bytes through a tensor on the base (so it needs ``tensors``,
which itself builds on ``storage``: the slice is its own module to keep that one-way).
"""

from __future__ import annotations

import torch

from torchtpu.device import tensors


class _Slice(torch.UntypedStorage):
    """``storage[a:b]`` of a device storage: its bytes are always its base's bytes a..b, read
    from the base each time, so the slice sees every write to the base, as a CPU slice does.

    PyTorch builds the slice as a second StorageImpl at the base's address + a; its bytes cannot
    alias the base's array, so a write through the slice is refused in words rather than lost.
    """

    @property
    def _tpu_array(self):
        base, start = self._tpu_slice_of
        whole = torch.empty(0, dtype=torch.uint8, device=base.device).set_(base)
        copy = whole[start:start + self.nbytes()].clone()
        return tensors.stored_array(copy.untyped_storage())

    @_tpu_array.setter
    def _tpu_array(self, value):
        raise NotImplementedError(
            "torchtpu.unsupported: writing through a slice of a tpu storage (storage[a:b]): the "
            "slice reads its storage's device bytes but cannot write them; write through a "
            "tensor on the whole storage, torch.empty(0, dtype=torch.uint8, "
            "device='tpu').set_(storage)[a:b]")


def install() -> None:
    """Make ``storage[a:b]`` on a device storage a ``_Slice`` reading the storage's bytes.

    Without it the slice, a second StorageImpl, carried no array: reading it failed on a missing
    attribute, and a write to it could not reach the storage's bytes.
    """
    cls = torch.UntypedStorage
    base_getitem = cls.__getitem__

    def __getitem__(self, *args, **kwargs):
        result = base_getitem(self, *args, **kwargs)
        if self.device.type == "tpu" and args and isinstance(args[0], slice):
            # A slice of a slice reads the first base, at the sum of the two offsets.
            base, offset = getattr(self, "_tpu_slice_of", (self, 0))
            result.__class__ = _Slice
            result._tpu_slice_of = (base, offset + result.data_ptr() - self.data_ptr())
        return result

    cls.__getitem__ = __getitem__
