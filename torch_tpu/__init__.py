"""``torch_tpu``: the import names of Google's TorchTPU (PyPI ``torch-tpu``), served by torchtpu.

Projects and scripts look for the reference by name: Ray Train imports ``torch_tpu._loader`` and
calls ``load()`` for the "tpu_dist" backend, user code calls ``torch_tpu.api.tpu_device()`` and
``torch_tpu.pallas.jax_op``. This package maps those names onto torchtpu, so such code runs
unchanged on any machine. It owns nothing: ``torch_tpu.<name>`` for the submodules below is
``torch.tpu.<name>``, loaded on first use.

It occupies the import name ``torch_tpu``, so it cannot be installed next to Google's wheel (which
needs TPU hardware and ``libtpu`` anyway): install one or the other.
"""

import importlib
import sys
import types

import torchtpu  # noqa: F401  (importing registers the "tpu" device)

_FORWARDED = ("distributed", "ops", "pallas", "profiler")


class _Forward(types.ModuleType):
    """``torch_tpu.<name>``: attributes come from ``torchtpu.tpu.<name>`` on first access."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # module protocol probes (__file__, __path__) do not forward
            raise AttributeError(attr)
        target = importlib.import_module(f"torchtpu.tpu.{self.__name__.rsplit('.', 1)[1]}")
        return getattr(target, attr)


for _name in _FORWARDED:
    globals()[_name] = sys.modules[f"{__name__}.{_name}"] = _Forward(f"{__name__}.{_name}")
