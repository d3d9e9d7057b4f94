"""``torch_xla.utils.utils`` (``xu``): the helpers example scripts use (fake data, env flags)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from torchtpu.integrations.torch_xla import _missing


class SampleGenerator:
    """Yields ``data`` ``sample_count`` times (PyTorch/XLA's fake-data loader)."""

    def __init__(self, data: Any, sample_count: int) -> None:
        self._data, self._count = data, sample_count

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator:
        for _ in range(self._count):
            yield self._data


def getenv_as(name: str, type: type, defval: Any = None) -> Any:
    value = os.environ.get(name)
    if value is None:
        return defval
    if type is bool:
        return value.lower() in ("1", "true", "yes", "on")
    return type(value)


def check_env_flag(name: str, default: str = "") -> bool:
    return os.getenv(name, default).upper() in ("ON", "1", "YES", "TRUE", "Y")


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
