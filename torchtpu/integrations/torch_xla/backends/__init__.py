"""``torch_xla.backends``: matmul precision, as ``torch.tpu.set_precision``."""

from __future__ import annotations

import torch

from torchtpu.integrations.torch_xla import _missing

_NAMES = ("default", "high", "highest")


def set_mat_mul_precision(precision: str) -> None:
    if precision not in _NAMES:
        raise ValueError(f"torchtpu.argument: set_mat_mul_precision({precision!r}): use one of "
                         f"{', '.join(_NAMES)}")
    torch.tpu.set_precision(torch.tpu.Precision(precision))


def get_mat_mul_precision() -> str:
    return torch.tpu.get_precision().value


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
