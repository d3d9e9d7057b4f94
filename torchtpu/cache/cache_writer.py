"""The persistent cache's writes, off the compiling thread (``compile_cache`` routes JAX's there).

JAX writes a new executable's cache entry on the thread that compiled it, before the program
runs: serialize, compress, and (``compile_cache.EntryStore``) read the entry back and write it.
On the chip a whole training step's entry cost the compiling thread seconds (14.3 s of a
147-s warm-up at 4 x 2048, session 28). Only the serialization must stay there (it runs inside
XLA on the executable, which the program's first call may donate into or free), so the compiling
thread serializes and hands the bytes (a ``Serialized`` stand-in for the executable) to one
writer thread, which runs JAX's own write on it: the entry is what a write on the compiling
thread makes, read back before it is published, as ever (an executable is never loaded from the
directory unless its writer deserialized it whole first).

Every write is counted (``WRITES``) from the moment it begins on the compiling thread to its end
on the writer: at exit (``close``, an ``atexit`` hook that runs before JAX's clean-up) no write
starts and those counted are waited for, up to ``EXIT_WAIT_SECONDS``; a write not started by then
is dropped (XLA's state is about to be destroyed) and reported. ``flush()`` waits for every write
handed off so far, and a read of a key whose write is pending waits for it (``settle``), so a
program compiled again in this process (after ``jax.clear_caches()``) finds its entry.
The bytes waiting for the writer are bounded (``MAX_PENDING_BYTES``): past it the compiling
thread waits. A forked child starts with no writes (its parent writes its own).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable

from torchtpu import metrics
from torchtpu.cache.cache_entry import CompileCacheWarning

EXIT_WAIT_SECONDS = 30.0  # a big program writes in seconds; a stuck write must not hang exit
MAX_PENDING_BYTES = 512 << 20  # serialized executables waiting for the writer


class Serialized:
    """What JAX's cache write reads of an executable, taken on the compiling thread: its
    serialized bytes, the devices it was built for (the read-back places it there), the client
    that built it, and when its serialization ended (the end of its compile, for the entry's
    compile seconds)."""

    __slots__ = ("_data", "_devices", "backend", "at")

    def __init__(self, data: bytes, devices, backend) -> None:
        self._data = data
        self._devices = devices
        self.backend = backend
        self.at = time.monotonic()

    def serialize(self) -> bytes:
        return self._data

    def local_devices(self):
        if isinstance(self._devices, Exception):
            raise self._devices  # (the read-back reports it: the program is not cached)
        return self._devices


def _devices_of(executable):
    """The executable's devices, or why it has none here (a compile-only TPU target's)."""
    try:
        return executable.local_devices()
    except Exception as e:  # noqa: BLE001 (raised again by the read-back, on the writer)
        return e


class Writes:
    """The cache writes under way (begun on a compiling thread, then queued or being written),
    the writer thread that does them, and whether the process has stopped starting new ones."""

    def __init__(self) -> None:
        self._done = threading.Condition()
        self._active = 0
        self._closed = False
        self._dropping = False  # the exit's wait ran out: queued writes are not started
        self._jobs: collections.deque = collections.deque()  # (key, nbytes, job)
        self._pending_bytes = 0
        self._pending_keys: collections.Counter = collections.Counter()
        self._thread: threading.Thread | None = None

    def begin(self) -> bool:
        """Count a write that starts now; False (start nothing) once closed."""
        with self._done:
            if self._closed:
                return False
            self._active += 1
            return True

    def end(self) -> None:
        with self._done:
            self._active -= 1
            self._done.notify_all()

    def submit(self, key: str, nbytes: int, job: Callable[[], None]) -> None:
        """Hand a begun write to the writer thread, which runs job and ends the write. Waits
        while more than ``MAX_PENDING_BYTES`` are queued (the writer runs behind)."""
        with self._done:
            self._done.wait_for(lambda: not self._jobs or self._dropping
                                or self._pending_bytes + nbytes <= MAX_PENDING_BYTES)
            self._jobs.append((key, nbytes, job))
            self._pending_bytes += nbytes
            self._pending_keys[key] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="torchtpu-cache-writer",
                                                daemon=True)  # (exit waits in close, not join)
                self._thread.start()
            self._done.notify_all()

    def _run(self) -> None:
        while True:
            with self._done:
                self._done.wait_for(lambda: self._jobs)
                key, nbytes, job = self._jobs[0]
                run = not self._dropping
            try:
                if run:
                    job()
            finally:
                with self._done:
                    self._jobs.popleft()
                    self._pending_bytes -= nbytes
                    self._pending_keys[key] -= 1
                    if not self._pending_keys[key]:
                        del self._pending_keys[key]
                    self._active -= 1
                    self._done.notify_all()

    def settle(self, key: str, timeout: float | None = None) -> bool:
        """Wait until no write of key is pending; True if none is."""
        if key not in self._pending_keys:  # (the common case, without the lock)
            return True
        with self._done:
            return self._done.wait_for(lambda: key not in self._pending_keys, timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write begun so far has ended; True if none is left."""
        with self._done:
            return self._done.wait_for(lambda: self._active == 0, timeout)

    def close(self, timeout: float = EXIT_WAIT_SECONDS) -> bool:
        """Start no more writes; wait up to timeout for those under way. True if none is left."""
        with self._done:
            self._closed = True
            done = self._done.wait_for(lambda: self._active == 0, timeout)
            if not done:
                self._dropping = True
                left = len(self._jobs)
        if not done:
            print(f"torchtpu.cache: {left} compile cache writes were still queued after "
                  f"{timeout:.0f} s at exit; those not started are not persisted",
                  file=sys.stderr)
        return done

    def _forget(self) -> None:
        """In a forked child: the parent's writes and writer thread are the parent's."""
        self._done = threading.Condition()
        self._active = 0
        self._closed = self._dropping = False
        self._jobs.clear()
        self._pending_bytes = 0
        self._pending_keys.clear()
        self._thread = None


WRITES = Writes()
os.register_at_fork(after_in_child=WRITES._forget)

_writing = threading.local()  # .executable: the Serialized being written by this thread


def hand_off(put: Callable, cache_key: str, module_name: str, executable, backend,
             *args, **kwargs) -> None:
    """JAX's put(cache_key, module_name, executable, backend, ...) for a write already begun
    (``WRITES.begin``): executable serialized here, the rest on the writer thread."""
    start = time.perf_counter()
    handed = False
    try:
        serialized = Serialized(executable.serialize(), _devices_of(executable), backend)
        job = _Job(put, cache_key, module_name, serialized, args, kwargs)
        WRITES.submit(cache_key, len(serialized.serialize()), job)
        handed = True
    finally:
        if not handed:
            WRITES.end()
        # (inside JAX's compile_seconds: what the compiling thread still spends on the entry)
        metrics.add_seconds("cache_write_seconds", time.perf_counter() - start)


class _Job:
    """One write on the writer thread: JAX's put on the stand-in (compress, then the store's
    read-back and write)."""

    __slots__ = ("put", "key", "name", "serialized", "args", "kwargs")

    def __init__(self, put, key, name, serialized, args, kwargs) -> None:
        self.put, self.key, self.name = put, key, name
        self.serialized, self.args, self.kwargs = serialized, args, kwargs

    def __call__(self) -> None:
        start = time.perf_counter()
        _writing.executable = self.serialized
        try:
            self.put(self.key, self.name, self.serialized, self.serialized.backend,
                     *self.args, **self.kwargs)
        except Exception as e:  # noqa: BLE001 (as JAX's own write: the program is not cached)
            warnings.warn(f"torchtpu.cache: writing the compile cache entry of {self.name} "
                          f"failed ({type(e).__name__}: {e}); it is not cached",
                          CompileCacheWarning, stacklevel=1)
        finally:
            _writing.executable = None
            metrics.count("cache_writes")
            metrics.add_seconds("cache_writer_seconds", time.perf_counter() - start)


def writing():
    """The Serialized this thread is writing through JAX's put, or None."""
    return getattr(_writing, "executable", None)
