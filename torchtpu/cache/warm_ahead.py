"""Programs loaded ahead of use: a new process loads, on a background thread, the executables
the last process of the same command line loaded or built by key, so that its first step finds
them in memory.

A warm process still deserializes every program it meets (``warm.compiled_for``): ~1-8 ms each
on XLA:CPU, most of it on XLA's own threads while the caller waits, and a colocated GRPO step's
first step meets ~360 (bench/RESULTS.md, rl7). Those loads happened on the step's critical path.
Here each process keeps the list of the index keys it used, in first-use order (a ``warm``
record, ``manifest``, keyed by the fingerprint and the command line, ``sys.orig_argv``; written
at exit), and the next process with the same command reads it at its first program and starts a
thread that loads them in that order (``Ahead``), while the process is still loading its model,
starting an engine or tracing. A caller that needs a key takes its program when loaded, waits
for it while the thread loads it, and loads it itself when the thread has not reached it (the
thread then skips it): a key is loaded once.

On by default (``TORCHTPU_LOAD_AHEAD=0`` turns it off), so it keeps to what a process loading
each program when asked keeps to. Every read goes through the cache's store, whose checks
(another host's or CPU's entry, a damaged one) refuse an entry for the thread as for a caller.
What the thread holds and no caller took yet is bounded three ways: at most ``WINDOW`` keys past
the furthest listed key the process asked for, so a process that does other work than its list
(pytest's workers share one command line) loads few programs it never uses; at most what the
memory maps have room for above twice ``map_room``'s reserve, counted at the start; and none once
``map_room`` frees the caches of compiled programs (``release``). Only a private cache directory
has records at all (``warm.private_store``); what the thread loads is what the caller would have
loaded by the same key, so results are the same either way.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable

from torchtpu import metrics, settings
from torchtpu.cache import map_room

MAX_KEYS = 1024  # in a list (each loaded is ~0.4 MiB of host memory on XLA:CPU)
WINDOW = 128  # keys loaded past the furthest listed key the process asked for
EXIT_WAIT_SECONDS = 10.0  # one load is milliseconds; the thread stops between loads
_CLAIMED = object()  # a caller loads the key itself


def enabled() -> bool:
    return settings.LOAD_AHEAD.get()


def command() -> tuple:
    """What names "the same program run again": the command line after the interpreter."""
    return tuple(getattr(sys, "orig_argv", sys.argv)[1:])


class _Slot:
    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value = None


class Ahead:
    """``load(key)`` for each of ``keys`` in order on a daemon thread, taken by callers."""

    def __init__(self, keys: list, load: Callable[[str], object]) -> None:
        self._keys = keys[:min(MAX_KEYS, map_room.ROOM.spare())]
        self._place = {key: i for i, key in enumerate(self._keys)}
        self._load = load
        self._lock = threading.Condition()
        self._slots: dict = {}  # key -> _Slot (the thread's) or _CLAIMED
        self._reached = 0  # 1 + the place of the furthest listed key a caller asked for
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="torchtpu-load-ahead", daemon=True)
        atexit.register(self.close)  # (after the store's own hook: runs before it)
        map_room.ROOM.on_free(self.release)
        self.thread.start()

    def take(self, key: str):
        """The program the thread loaded for key (waited for while it loads), or None: then
        the caller loads it, and the thread no longer will."""
        with self._lock:
            place = self._place.get(key)
            if place is not None and place >= self._reached:
                self._reached = place + 1
                self._lock.notify()
            slot = self._slots.get(key)
            if slot is None:
                self._slots[key] = _CLAIMED
                return None
        if slot is _CLAIMED:
            return None
        slot.done.wait()
        with self._lock:  # (taken once: what the thread holds untaken is what release drops)
            value, slot.value = slot.value, None
        if value is not None:
            metrics.count("programs_loaded_ahead")
        return value

    def _may_load(self, place: int) -> bool:
        return self._stop or place < self._reached + WINDOW

    def _run(self) -> None:
        for place, key in enumerate(self._keys):
            with self._lock:
                self._lock.wait_for(lambda at=place: self._may_load(at))
                if self._stop:
                    return
                if key in self._slots:
                    continue
                slot = self._slots[key] = _Slot()
            try:
                value = self._load(key)
            except Exception:  # noqa: BLE001 (the caller loads it and reports what fails)
                value = None
            with self._lock:
                slot.value = None if self._stop else value
            slot.done.set()

    def release(self) -> None:
        """Load no more, and drop what no caller took (``map_room`` frees memory maps)."""
        with self._lock:
            self._stop = True
            self._lock.notify()
            for slot in self._slots.values():
                if slot is not _CLAIMED:
                    slot.value = None

    def close(self) -> None:
        """Stop between loads and wait for the one under way: none may run while the
        interpreter tears XLA down."""
        with self._lock:
            self._stop = True
            self._lock.notify()
        self.thread.join(EXIT_WAIT_SECONDS)
