"""The compile cache when its directory fails: a full disk, a read-only or unreadable directory,
one that cannot be created, or one deleted while the process runs.

The persistent cache only saves compile time, so no OS error from its directory may stop a
program: a read that fails is a miss (the program is compiled), a write that fails leaves the
program uncached. Each kind of failure (reading, writing) is reported once per directory with a
``torchtpu.cache:`` warning, not once per program (an eager run compiles hundreds), and JAX's
own per-program "Error writing persistent compilation cache entry" warnings never fire, because
the store raises nothing. After a write fails the store starts no write for ``RETRY_SECONDS``:
on a full disk every new program would otherwise pay a serialization, a read-back and a partial
write for nothing. A directory deleted while the process runs is created again (once reported),
and the cache goes on filling it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from torchtpu import errors
from torchtpu.cache.cache_entry import CompileCacheWarning

RETRY_SECONDS = 60.0  # after a failed write: long enough to skip a burst of compiles


class Faults:
    """One cache directory's failures: what was reported, and whether writes are paused."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._reported: set[str] = set()
        self._paused_until = 0.0  # time.monotonic() before which no write starts

    def writable(self) -> bool:
        """Whether a write may start now (none for RETRY_SECONDS after one failed)."""
        return time.monotonic() >= self._paused_until

    def failed(self, doing: str, error: OSError) -> None:
        """A read or write of the directory failed with error: pause writes, report once."""
        if doing == "write":
            self._paused_until = time.monotonic() + RETRY_SECONDS
        why = error.strerror or str(error)
        self._report(doing, f"cannot {doing} the compile cache directory {self._path} ({why}); "
                     "programs still run, compiled where the cache cannot give them. Free "
                     "space, fix the directory's permissions, or point TORCHTPU_CACHE_DIR "
                     "elsewhere (off: no cache). Reported once")

    def recreated(self) -> None:
        self._report("recreate", f"the compile cache directory {self._path} was deleted while "
                     "this process used it; it was created again and fills anew. Reported once")

    def _report(self, kind: str, text: str) -> None:
        with self._lock:
            if kind in self._reported:
                return
            self._reported.add(kind)
        errors.warn("cache", text, CompileCacheWarning, stacklevel=4)
