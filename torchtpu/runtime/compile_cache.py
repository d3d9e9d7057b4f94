"""The persistent compile cache: JAX's own, under ``~/.cache/torchtpu`` by default.

``TORCHTPU_CACHE_DIR`` moves it; ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`` names a root shared
by several hosts; ``TORCHTPU_CACHE_DIR=off`` turns it off. Every program is cached, however fast
it compiled: on XLA:CPU even small programs cost 50-150 ms, and eager runs compile many of them.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax


def cache_dir() -> Path | None:
    shared = os.environ.get("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT")
    chosen = os.environ.get("TORCHTPU_CACHE_DIR") or shared
    if chosen and chosen.strip().lower() in ("off", "0", "none"):
        return None
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchtpu"


def enable() -> None:
    path = cache_dir()
    if path is None:
        return
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
