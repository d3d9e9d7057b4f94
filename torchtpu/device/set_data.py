"""``tensor.data = other`` across the tpu and another device, as it works for CUDA.

PyTorch's ``set_data`` lets a tensor take another's data only when its shallow-copy check knows
both backends, and that check's list of dense backends (CPU, CUDA, XPU, ...) has no PrivateUse1.
So ``param.data = param.data.to("tpu")`` raised "incompatible tensor type"; FSDP2's
``fully_shard`` does exactly that to a model built on CPU, as do older scripts that move
parameters by hand. ``install()`` keeps PyTorch's setter and, only where it refuses a move onto
or off the tpu, gives the tensor the new data in place with ``torch.utils.swap_tensors``: the
same Python object (its identity, class, attributes and ``requires_grad``) now holds an alias of
the new data, so the two share storage as ``set_data`` leaves them.
"""

from __future__ import annotations

import torch

_base = torch._C.TensorBase.data  # the C setter and getter


def _crosses_tpu(tensor: torch.Tensor, value: object) -> bool:
    return isinstance(value, torch.Tensor) and (
        (tensor.device.type == "tpu") != (value.device.type == "tpu"))


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    try:
        _base.__set__(self, value)
        return
    except RuntimeError as refused:
        if not _crosses_tpu(self, value):
            raise
        if self.grad is not None:
            raise RuntimeError(
                f"torchtpu.device: cannot set .data of a tensor on {self.device} to one on "
                f"{value.device} while it has a .grad (on {self.grad.device}); set .grad to "
                "None first") from refused
    # The tensor's own class and attributes go with it; the data is an alias of value's.
    alias = torch.Tensor._make_subclass(type(self), value.detach(), self.requires_grad)
    alias.__dict__.update(self.__dict__)
    torch.utils.swap_tensors(self, alias)


def install() -> None:
    torch.Tensor.data = property(_base.__get__, _set_data, doc=_base.__doc__)
