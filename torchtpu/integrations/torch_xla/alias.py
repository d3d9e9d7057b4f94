"""``import torch_xla`` resolves to this layer: one module object under two names.

The stub package that ``install.py`` writes (``torch_xla/__init__.py`` in site-packages, or any
folder on ``sys.path``) calls ``take_over()``. That imports every module of the layer and enters
each in ``sys.modules`` under its PyTorch/XLA name (``torch_xla.core.xla_model`` is
``torchtpu.integrations.torch_xla.core.xla_model``), so state such as the global mesh or the
queued step closures exists once, whichever name a script uses. A ``torch_xla.*`` module the
layer does not have is refused by a finder placed first on ``sys.meta_path``, with a
``ModuleNotFoundError`` naming it and the torchtpu way. Taking the name over also switches the
process to DeferAndFuse: PyTorch/XLA records ops until the step (``_step``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import pkgutil
import sys

from torchtpu.integrations.torch_xla import _autocast, _missing, _step

PACKAGE = "torchtpu.integrations.torch_xla"
NAME = "torch_xla"
# Modules of the layer that are not PyTorch/XLA names.
_OWN = {"alias", "install", "_missing", "_autocast"}


class _Refuse(importlib.abc.MetaPathFinder):
    """Refuses ``torch_xla.*`` modules that are not in ``sys.modules`` (not in the layer)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(NAME + ".") and fullname not in sys.modules:
            raise ModuleNotFoundError(_missing.text(fullname), name=fullname)
        return None


def _modules(package) -> list[str]:
    names = []
    for info in pkgutil.walk_packages(package.__path__, PACKAGE + "."):
        if info.name.rsplit(".", 1)[1] not in _OWN:
            names.append(info.name)
    return names


def take_over(name: str = NAME) -> None:
    """Make ``name`` (and its submodules) this layer in ``sys.modules``."""
    layer = importlib.import_module(PACKAGE)
    sys.modules[name] = layer
    for full in _modules(layer):
        sys.modules[name + full[len(PACKAGE):]] = importlib.import_module(full)
    if not any(isinstance(f, _Refuse) for f in sys.meta_path):
        sys.meta_path.insert(0, _Refuse())
    _step.lazy(True)
    _autocast.install()
