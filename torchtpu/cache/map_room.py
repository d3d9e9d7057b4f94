"""Room for XLA executables in the process's memory maps, made before XLA runs out of it.

XLA:CPU links each executable's machine code into memory of its own: 4 to 12 memory maps per
executable (more for big programs), held until the executable dies. Linux caps the maps of a
process (``vm.max_map_count``, 65530 by default), and JAX keeps up to 8192 executables per jit
cache alive. A process that runs ~6000 distinct programs (PyTorch's ``test_index_reduce`` on
device tpu: every dtype, reduce mode and shape) reaches the cap; LLVM then fails to map memory
("LLVM compilation error: Cannot allocate memory") and XLA uses what it did not get: SIGSEGV, in
the next compile or in the next executable read from the persistent cache (issue 26). Nothing
about the programs themselves: every one of them round-trips through serialize / deserialize.

So ``make_room()`` runs before XLA creates an executable (a compile, a cache read, a warm start,
a new cache entry's read-back). It counts the maps (``/proc/self/maps``) only now and then: after
a count it lets through as many executables as half the headroom above the reserve holds at the
most maps an executable has been seen to take. When the headroom falls under the reserve (an
eighth of the cap), it clears JAX's caches of compiled programs, once, with a ``torchtpu.cache:``
warning (they come back from the persistent cache or are recompiled when used again); if that
leaves less than half the reserve (something else holds the maps), it raises a
``torchtpu.cache:`` error instead of letting XLA crash. Executables held outside JAX's caches
(those loaded ahead of use, ``warm_ahead``) are dropped with them (``Room.on_free``), and are loaded
ahead only into the room above twice the reserve (``Room.spare``). Without ``/proc`` (not Linux)
it does nothing.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable

import jax
from jax._src import compiler

from torchtpu import errors, metrics

_MAPS = "/proc/self/maps"
_LIMIT = "/proc/sys/vm/max_map_count"
_RESERVE = 1 / 8  # of the cap: what a burst of executables between two counts may take
_MIN_PER_EXECUTABLE = 16  # maps: above the most a small program was measured to take (12)


def _count() -> int:
    with open(_MAPS, "rb") as f:
        return f.read().count(b"\n")


class Room:
    """The map headroom of this process, counted now and then, and what frees it."""

    def __init__(self, limit: int | None, reserve: float = _RESERVE) -> None:
        self._limit = limit
        self.reserve = int((limit or 0) * reserve)  # maps
        self._lock = threading.Lock()
        self._left = 0  # executables let through before the next count
        self._per = _MIN_PER_EXECUTABLE
        self._counted: tuple[int, int] | None = None  # (maps, executables) at the last count
        self._made = 0  # executables let through so far
        self.freed = 0  # times JAX's caches were cleared
        self._holders: list = []  # what else holds executables: dropped when JAX's caches are

    def spare(self) -> int:
        """How many more executables fit above twice the reserve, counted now: what may be
        loaded ahead of use (``warm_ahead``) without bringing the next clearing nearer."""
        if self._limit is None:
            return sys.maxsize
        with self._lock:
            return max(0, (self._limit - _count() - 2 * self.reserve) // self._per)

    def on_free(self, release: Callable[[], None]) -> None:
        """release() drops executables held outside JAX's caches when those are cleared."""
        with self._lock:
            self._holders.append(release)

    def make(self) -> None:
        """Before XLA creates an executable: free maps if few are left, or raise."""
        if self._limit is None:
            return
        with self._lock:
            self._made += 1
            if self._left > 0:
                self._left -= 1
                return
            used = _count()
            if self._counted is not None and self._made > self._counted[1]:
                grown = (used - self._counted[0]) / (self._made - self._counted[1])
                self._per = max(self._per, int(grown) + 1)
            if self._limit - used < self.reserve:
                used = self._free(used)
            self._counted = (used, self._made)
            self._left = max(0, (self._limit - used - self.reserve) // (2 * self._per))

    def _free(self, used: int) -> int:
        for release in self._holders:
            release()
        jax.clear_caches()
        gc.collect()
        after = _count()
        self.freed += 1
        metrics.count("executable_caches_cleared")
        if self.freed == 1:
            errors.warn("cache", f"this process holds {used} memory maps of the "
                        f"{self._limit} Linux allows it (vm.max_map_count; XLA:CPU keeps each "
                        "executable in maps of its own and crashes when none is left): JAX's "
                        f"caches of compiled programs were cleared ({after} maps now); programs "
                        "used again are read from the persistent cache or recompiled",
                        stacklevel=4)
        if self._limit - after < self.reserve // 2:
            raise RuntimeError(errors.message(
                "cache", f"this process holds {after} memory maps of the {self._limit} Linux "
                "allows it (vm.max_map_count) even without JAX's cached programs; XLA would "
                "crash creating another executable. Keep fewer compiled programs alive, or "
                "raise the limit (sysctl vm.max_map_count)"))
        return after


def _limit() -> int | None:
    try:
        _count()
        with open(_LIMIT) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


ROOM = Room(_limit())


def make_room() -> None:
    """Call before XLA creates an executable (see the module doc)."""
    ROOM.make()


def install() -> None:
    """Make room before every compile JAX runs (once); cache reads call ``make_room`` too."""
    compile_and_load = compiler.backend_compile_and_load
    if getattr(compile_and_load, "makes_room", False):
        return

    def room_then_compile(*args, **kwargs):
        make_room()
        return compile_and_load(*args, **kwargs)

    room_then_compile.makes_room = True
    # JAX's compiler looks the function up on its module at every compile.
    compiler.backend_compile_and_load = room_then_compile
