"""``torch.tpu.FloatStorage`` and the other legacy typed-storage classes, as ``torch.cuda`` has.

PyTorch's ``TypedStorage._get_legacy_storage_class`` (behind ``tensor.storage_type()``) looks
for them on ``torch.<privateuse1 name>``; without them ``storage_type()`` of a tpu tensor is
None. A class's device comes from its ``__module__`` (``torch.storage._get_device_from_module``),
so ``torch.tpu.FloatStorage(4)`` makes a tpu storage, as ``torch.cuda.FloatStorage(4)`` a CUDA one.
"""

from __future__ import annotations

import torch
from torch._utils import classproperty


def _legacy_class(name: str, dtype: torch.dtype) -> type:
    def _dtype(cls) -> torch.dtype:
        return dtype

    def _warned_dtype(cls) -> torch.dtype:
        torch.storage._warn_typed_storage_removal()
        return dtype

    return type(torch.storage._LegacyStorage)(name, (torch.storage._LegacyStorage,), {
        "__module__": "torch.tpu", "__qualname__": name,
        "_dtype": classproperty(_dtype), "dtype": classproperty(_warned_dtype)})


# Quantized dtypes are refused on tpu (device/quantized.py): no classes for them.
_QUANTIZED = {torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4}
_CLASSES = {name: _legacy_class(name, dtype)
            for dtype, name in torch.storage._dtype_to_storage_type_map().items()
            if dtype not in _QUANTIZED}
globals().update(_CLASSES)
__all__ = sorted(_CLASSES)
