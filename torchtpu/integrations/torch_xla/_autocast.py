"""``torch.autocast("xla", ...)`` under ``import torch_xla``: autocast for the tpu device.

PyTorch/XLA scripts (easy-torch-tpu's trainer among them) enter ``torch.autocast('xla',
dtype=torch.bfloat16)``. In PyTorch that arms the XLA dispatch key's autocast, which tpu tensors
(PrivateUse1) never reach, so the step would silently run in float32. Once the process has taken
the ``torch_xla`` name (``alias.take_over``; a real torch_xla cannot sit beside it), "xla" means
this device, so autocast and its queries take "xla" as "tpu".
"""

from __future__ import annotations

import functools

import torch
from torch.amp import autocast_mode

_XLA, _TPU = "xla", "tpu"


def _as_tpu(device_type):
    return _TPU if device_type == _XLA else device_type


def _first_arg_as_tpu(fn):
    @functools.wraps(fn)
    def wrapped(device_type=None, *args, **kwargs):
        if device_type is None:
            return fn(*args, **kwargs)
        return fn(_as_tpu(device_type), *args, **kwargs)

    return wrapped


def install() -> None:
    """Map "xla" to "tpu" in ``torch.autocast`` (its ``__enter__`` then arms tpu's autocast)
    and in the two autocast queries scripts make (once)."""
    cls = autocast_mode.autocast
    if getattr(cls, "_torchtpu_xla_is_tpu", False):
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, device_type, *args, **kwargs):
        init(self, _as_tpu(device_type), *args, **kwargs)

    cls.__init__ = __init__
    cls._torchtpu_xla_is_tpu = True
    for name in ("is_autocast_enabled", "get_autocast_dtype"):  # what scripts query
        setattr(torch, name, _first_arg_as_tpu(getattr(torch, name)))
