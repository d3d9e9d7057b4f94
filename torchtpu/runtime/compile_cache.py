"""The persistent compile cache: every XLA program, kept across runs, in ``~/.cache/torchtpu``.

``TORCHTPU_CACHE_DIR`` moves it; ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`` names a root shared
by several hosts; ``TORCHTPU_CACHE_DIR=off`` turns it off. Every program is cached, however fast
it compiled: on XLA:CPU even small programs cost 50-150 ms, and eager runs compile many of them.
Eager per-op programs and compiled graphs both go through ``jax.jit``, so both are cached.

JAX decides what to cache and computes the key (a hash of the StableHLO, compile options,
devices and JAX/XLA versions); ``EntryStore`` replaces JAX's file store, which writes entries in
place and keeps a broken one forever (its reader warns and recompiles, its writer then skips the
key because the file exists). Here each entry is one file ``<key>.ttpu``:

    b"TTPU1" | sha256(payload) (32 bytes) | payload

where payload is JAX's own entry: a zlib- or zstd-compressed 4-byte compile time followed by
XLA's serialized executable (the runtime's binary format; nothing here or in JAX unpickles
anything read from the cache directory). An entry that is short, has another header or fails its
digest is reported with a ``CompileCacheWarning``, deleted, and treated as a miss, so the program
is recompiled and written again. Writes go to a private temporary file in the same directory and
are renamed into place (atomic on POSIX), so concurrent writers and readers only ever see whole
entries; two processes writing one key leave one whole entry.

The digest detects damage, not tampering: like JAX's cache, the directory is trusted (whoever can
write to it can make this process run code of their choosing). Do not share it with untrusted
users.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path

import jax
from jax._src import compilation_cache as jax_cache
from jax._src.compilation_cache_interface import CacheInterface

MAGIC = b"TTPU1"
SUFFIX = ".ttpu"
_DIGEST = 32


class CompileCacheWarning(UserWarning):
    """A persistent cache entry was unreadable; the program is recompiled."""


class EntryStore(CacheInterface):
    """JAX's cache interface over a directory of checksummed, atomically written entries."""

    def __init__(self, path: Path) -> None:
        self._path = path
        path.mkdir(parents=True, exist_ok=True)

    def entry(self, key: str) -> Path:
        return self._path / f"{key}{SUFFIX}"

    def get(self, key: str) -> bytes | None:
        path = self.entry(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        payload = data[len(MAGIC) + _DIGEST:]
        if not data.startswith(MAGIC):
            problem = "it has no torchtpu header"
        elif len(data) <= len(MAGIC) + _DIGEST:
            problem = f"it is truncated ({len(data)} bytes)"
        elif hashlib.sha256(payload).digest() != data[len(MAGIC):len(MAGIC) + _DIGEST]:
            problem = "its checksum does not match (truncated or damaged)"
        else:
            return payload
        warnings.warn(f"torchtpu: compile cache entry {path} is unusable: {problem}; "
                      "recompiling and replacing it", CompileCacheWarning, stacklevel=2)
        path.unlink(missing_ok=True)
        return None

    def put(self, key: str, value: bytes) -> None:
        path = self.entry(key)
        if path.exists():
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}-", suffix=".tmp", dir=self._path)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(value).digest() + value)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def clear(self) -> None:
        for p in self._path.glob(f"*{SUFFIX}"):
            p.unlink(missing_ok=True)


def cache_dir() -> Path | None:
    """The cache directory the environment asks for; None when the cache is off."""
    shared = os.environ.get("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT")
    chosen = os.environ.get("TORCHTPU_CACHE_DIR") or shared
    if chosen and chosen.strip().lower() in ("off", "0", "none"):
        return None
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchtpu"


def enable() -> None:
    """Point JAX's persistent cache at cache_dir(), stored by ``EntryStore``."""
    path = cache_dir()
    if path is None:
        return
    store = EntryStore(path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX builds its file store lazily on first use; installing ours first keeps it from doing so.
    with jax_cache._cache_initialized_mutex:
        jax_cache._cache = store
        jax_cache._cache_initialized = True
