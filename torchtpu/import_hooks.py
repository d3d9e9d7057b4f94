"""Run a function right after a module is first imported (a post-import hook).

Dynamo costs ~1.7 s to import, and ``import torch`` loads torchtpu through the
``torch.backends`` entry point: registering the "tpu" backend eagerly would make every
``import torch`` pay for Dynamo, also in programs that never compile. Instead the registration
waits for the first import of ``torch._dynamo`` (``torch.compile``, ``torch.export``, ...), which
always happens before Dynamo looks at a backend name or a device.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable


class _Loader(importlib.abc.Loader):
    """The module's own loader, with the hook called once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, hook: Callable[[], None]) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._hook()

    def __getattr__(self, name: str):
        # get_source, get_filename, is_package...: whatever else asks the loader.
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, hook: Callable[[], None]) -> None:
        self._name = name
        self._hook = hook
        self._finding = threading.local()

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self._name or getattr(self._finding, "active", False):
            return None
        # The real spec comes from the finders after this one; the flag keeps this finder
        # out of that search.
        self._finding.active = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.active = False
        if spec is None or spec.loader is None:
            return None
        sys.meta_path.remove(self)
        spec.loader = _Loader(spec.loader, self._hook)
        return spec


def after_import(name: str, hook: Callable[[], None]) -> None:
    """Call hook once name has been imported: now if it already is, else right after."""
    if name in sys.modules:
        hook()
    else:
        sys.meta_path.insert(0, _Finder(name, hook))
