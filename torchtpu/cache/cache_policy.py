"""What this process lets ``compile_cache.EntryStore`` do (the reference's
``torch.tpu._set_allow_cache``, ``_set_cache_only``, ``_set_dump_on_cache_miss``).

- ``allow=False``: the store is neither read nor written (every program compiles here).
- ``only=True``: a program the store lacks is refused (``CacheOnlyMiss``, a ``torchtpu.cache:``
  error naming its key) instead of compiled: to check that a warm store covers a run, or that a
  job compiles nothing on an expensive machine.
- ``dump_misses=DIR``: each program the store lacks is written to DIR as StableHLO, headed by
  the user line that built it (``runtime/dump.py``'s files), to see what a run had to compile.

The store asks ``reads()`` / ``writes()``, and JAX's executable reads call ``missed()``.
"""

from __future__ import annotations

from pathlib import Path

from jax._src import compilation_cache

from torchtpu.runtime import dump

_policy = {"allow": True, "only": False}


class CacheOnlyMiss(compilation_cache.CacheVerificationError):
    """A program missing from the cache while only cached programs may run (JAX re-raises
    this class of cache error instead of compiling)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message, key, b"", b"")


def set_allow(allow: bool) -> None:
    _policy["allow"] = bool(allow)


def set_only(only: bool) -> None:
    _policy["only"] = bool(only)


def set_dump_misses(directory: str | Path | None) -> None:
    """Write each missing program to directory (None: stop)."""
    if directory is not None:
        directory = Path(directory).expanduser()
        directory.mkdir(parents=True, exist_ok=True)
    dump.dump_misses_to(directory)


def dump_misses() -> Path | None:
    return dump.misses_directory()


def reads() -> bool:
    return _policy["allow"]


def writes() -> bool:
    return _policy["allow"] and not _policy["only"]


def missed(key: str) -> None:
    """An executable's entry was not found: refuse it under ``only``, note it for the dump."""
    if _policy["only"]:
        raise CacheOnlyMiss(
            f"torchtpu.cache: torch.tpu._set_cache_only(True) is on and the program of cache key "
            f"{key} is not in the compile cache, so it is not compiled; run once without it to "
            "fill the cache, or call torch.tpu._set_cache_only(False)", key)
    dump.note_miss(key)
