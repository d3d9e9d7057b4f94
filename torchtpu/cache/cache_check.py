"""A compile-cache directory checked offline (the doctor tool's ``--prune``): every entry read
and checked as a reader checks it, the damaged ones named, and on request deleted."""

from __future__ import annotations

from pathlib import Path

from torchtpu.cache.cache_entry import problem_of
from torchtpu.cache.compile_cache import SUFFIX, cache_dir


def verify(path: Path | None = None) -> dict:
    """Every entry of the cache directory (``cache_dir()`` unless given) read and checked as a
    reader checks it: ``{"entries": n, "bytes": total, "damaged": {file name: why}}``. An entry
    of an older format is not damaged (it is replaced quietly on use); nothing is deleted."""
    path = cache_dir() if path is None else path
    found = {"entries": 0, "bytes": 0, "damaged": {}}
    if path is None or not path.is_dir():
        return found
    for entry in sorted(path.glob(f"*{SUFFIX}")):
        try:
            data = entry.read_bytes()
        except OSError:
            continue  # evicted or replaced while we looked
        found["entries"] += 1
        found["bytes"] += len(data)
        problem = problem_of(data)
        if problem:
            found["damaged"][entry.name] = problem
    return found


def prune(path: Path | None = None) -> dict:
    """``verify(path)``, then the entries it names deleted; returns what verify found."""
    path = cache_dir() if path is None else path
    found = verify(path)
    for name in found["damaged"]:
        (path / name).unlink(missing_ok=True)
    return found
