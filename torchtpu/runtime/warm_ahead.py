"""Programs loaded ahead of use: a new process loads, on a background thread, the executables
the last process of the same command line loaded or built by key, so that its first step finds
them in memory.

A warm process still deserializes every program it meets (``warm.compiled_for``): ~1-8 ms each
on XLA:CPU, most of it on XLA's own threads while the caller waits, and a colocated GRPO step's
first step meets ~360 (bench/RESULTS.md, rl7). Those loads happened on the step's critical path.
Here each process keeps the list of the index keys it used, in first-use order (a ``warm``
record, ``manifest``, keyed by the fingerprint and the command line, ``sys.orig_argv``; written
at exit), and the next process with the same command starts a thread at its first program that
loads them in that order (``Ahead``), while the process is still loading its model, starting an
engine or tracing. A caller that needs a key takes its program when loaded, waits for it while
the thread loads it, and loads it itself when the thread has not reached it (the thread then
skips it): a key is loaded once. Keys of programs the process never asks for stay loaded until
exit; ``MAX_KEYS`` bounds them (each is ~0.4 MiB of host memory on XLA:CPU).

Opt-in, ``TORCHTPU_LOAD_AHEAD=1``: with it on, the loads ahead hold their executables (and on
XLA:CPU their memory maps) where the cache's own room-making cannot free them, and the suite's
cache-safety checks (entries of another CPU, the memory-map limit, restart counts) do not yet
pass with it. Only a private cache directory has records at all
(``warm.private_store``); what the thread loads is what the caller would have loaded by the same
key, so results are the same either way.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable

from torchtpu import metrics

ENV = "TORCHTPU_LOAD_AHEAD"
MAX_KEYS = 1024
EXIT_WAIT_SECONDS = 10.0  # one load is milliseconds; the thread stops between loads
_CLAIMED = object()  # a caller loads the key itself


def enabled() -> bool:
    return os.environ.get(ENV, "0").strip().lower() in ("1", "on", "true", "yes")


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

    def __init__(self, keys: Callable[[], list], load: Callable[[str], object]) -> None:
        self._keys, self._load = keys, load
        self._lock = threading.Lock()
        self._slots: dict = {}  # key -> _Slot (the thread's) or _CLAIMED
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="torchtpu-load-ahead", daemon=True)
        atexit.register(self.close)  # (after the store's own hook: runs before it)
        self.thread.start()

    def take(self, key: str):
        """The program the thread loaded for key (waited for while it loads), or None: then
        the caller loads it, and the thread no longer will."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                self._slots[key] = _CLAIMED
                return None
        if slot is _CLAIMED:
            return None
        slot.done.wait()
        if slot.value is not None:
            metrics.count("programs_loaded_ahead")
        return slot.value

    def _run(self) -> None:
        for key in self._keys()[:MAX_KEYS]:
            if self._stop.is_set():
                return
            with self._lock:
                if key in self._slots:
                    continue
                slot = self._slots[key] = _Slot()
            try:
                slot.value = self._load(key)
            except Exception:  # noqa: BLE001 (the caller loads it and reports what fails)
                slot.value = None
            finally:
                slot.done.set()

    def close(self) -> None:
        """Stop between loads and wait for the one under way: none may run while the
        interpreter tears XLA down."""
        self._stop.set()
        self.thread.join(EXIT_WAIT_SECONDS)
