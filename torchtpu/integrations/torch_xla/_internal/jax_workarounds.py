"""``torch_xla._internal.jax_workarounds``: ``jax_env_context()``.

PyTorch/XLA enters it around code that traces JAX functions, to hide its own XLA flags and
device settings from JAX. torchtpu runs on JAX itself, so there is nothing to hide: the context
changes nothing.
"""

from __future__ import annotations

import contextlib

from torchtpu.integrations.torch_xla import _missing


@contextlib.contextmanager
def jax_env_context():
    yield


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
