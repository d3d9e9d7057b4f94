"""Where the runtime calls up: what the rooms above it (``torchtpu.cache``, ``torchtpu.targets``)
plug into it, so that the runtime imports neither.

- Start steps (``at_start``): the platform configures JAX at its import (``platform.py``), and
  the persistent compile cache and the TPU target hook must be in place before the first program
  compiles. Each of them registers its step as its module loads; ``platform`` runs the steps
  registered so far (``start``) and a step registered later runs at once. ``registration``
  registers the step that loads those modules, so they are never missed. Since the start can
  come from inside the import of a module above (``cache/warm_keys.py`` imports the platform),
  the modules the start loads take such a module whole (``from torchtpu.cache import
  warm_keys``), not names from it, which it may not have defined yet.
- Watched compiles (``watch_every_compile``): a hook on JAX's compile that must see every program
  (the TPU target's) turns off loading programs by key (``cache/warm.py``), which skips it.
- Records (``keep_records``): small JSON facts kept across processes in the persistent cache;
  the cache room plugs its store in, and the TPU target keeps its compiler verdicts there.

Importing this module imports no JAX (``registration`` uses it at ``import torch``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_steps: list = []     # start steps not run yet
_started: list = []   # [True] once the platform started
_watched: list = []   # the hooks that see every compile
_records: list = []   # [(read, write)] of the store that keeps records


def at_start(step: Callable[[], None]) -> None:
    """Run step when the platform starts (now, if it has)."""
    if _started:
        step()
    else:
        _steps.append(step)


def start() -> None:
    """Run the start steps, in the order they were registered (``platform``'s import only)."""
    _started.append(True)
    while _steps:
        _steps.pop(0)()


def watch_every_compile(name: str) -> None:
    """The hook name sees every program through JAX's compile from now on: none may skip it."""
    if name not in _watched:
        _watched.append(name)


def every_compile_watched() -> bool:
    """Whether a hook must see every compile (so no program may be loaded by key instead)."""
    return bool(_watched)


def keep_records(read: Callable[[str, str], Any], write: Callable[[str, str, Any], None]) -> None:
    """Keep records with read(kind, key) and write(kind, key, value) (the cache room's store)."""
    _records[:] = [(read, write)]


def read_record(kind: str, key: str) -> Any:
    """The JSON value kept for (kind, key), or None (no store plugged in, no record)."""
    return _records[0][0](kind, key) if _records else None


def write_record(kind: str, key: str, value: Any) -> None:
    """Keep value (JSON-able) for (kind, key), where a store is plugged in."""
    if _records:
        _records[0][1](kind, key, value)
