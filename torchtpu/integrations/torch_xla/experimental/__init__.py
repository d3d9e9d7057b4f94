"""``torch_xla.experimental``: ``eager_mode`` (Strict) and ``is_eager_mode``."""

from __future__ import annotations

from torchtpu.integrations.torch_xla import _missing, _step


def eager_mode(enable: bool) -> None:
    """PyTorch/XLA's eager mode: each op runs at once (torchtpu's Strict); off, ops are recorded
    until the step (DeferAndFuse, the default under this layer)."""
    _step.lazy(not enable)


def is_eager_mode() -> bool:
    return not _step.is_lazy()


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
