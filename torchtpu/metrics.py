"""Process-wide counters: compiles, cache hits, executions, CPU fallbacks and transfers.

``snapshot()`` returns them as a dict, ``report()`` as readable text, ``reset()`` zeroes them.
Compile figures come from JAX's own monitoring events, so every executor and the compiled path
are counted the same way: ``trace_seconds`` (Python to jaxpr), ``lower_seconds`` (jaxpr to
StableHLO) and ``compile_seconds`` (XLA, or a persistent-cache load).

A ``Phase`` adds the wall seconds of a stretch of torchtpu's own host work (a capture, AOTAutograd)
as ``<name>_seconds``, less what is counted as its own inside it (JAX's three figures on the same
thread, phases started within it), so that the figures of a warm-up add up without overlap.
"""

from __future__ import annotations

import collections
import functools
import threading
import time

from jax import monitoring

_lock = threading.Lock()
_counters: collections.Counter = collections.Counter()
_seconds: collections.Counter = collections.Counter()
_fallbacks: collections.Counter = collections.Counter()

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# (JAX reports a trace only at the top level: a jit traced inside another is its caller's time.)
_JAX_SECONDS = {_BACKEND_COMPILE: "compile_seconds",
                "/jax/core/compile/jaxpr_trace_duration": "trace_seconds",
                "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_seconds"}
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_MISS = "/jax/compilation_cache/cache_misses"


# torchtpu's own background threads are named so (loading ahead, the cache writer, TPU targets'
# compiles): a program one of them makes is no sign that the user's loop changed.
BACKGROUND_THREADS = "torchtpu-"


def _count_program(kind: str) -> None:
    # One step under the lock with its background share, so that programs_made() never sees
    # one without the other.
    background = threading.current_thread().name.startswith(BACKGROUND_THREADS)
    _counters[kind] += 1
    if background:
        _counters["programs_made_in_background"] += 1


def program_loaded_by_key() -> None:
    """A program was loaded by torchtpu's own key (``cache/warm.py``), on whichever thread."""
    with _lock:
        _count_program("programs_loaded_by_key")


def _on_duration(event: str, seconds: float, **_: object) -> None:
    name = _JAX_SECONDS.get(event)
    if name is None:
        return
    with _lock:
        if event == _BACKEND_COMPILE:
            _count_program("programs_loaded")
        _seconds[name] += seconds
    stack = _phases()
    if stack:
        stack[-1]._inner += seconds


def _on_event(event: str, **_: object) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _counters["persistent_cache_hits"] += 1
    elif event == _CACHE_MISS:
        with _lock:
            _counters["persistent_cache_misses"] += 1


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)


_local = threading.local()


def _phases() -> list:
    stack = getattr(_local, "phases", None)
    if stack is None:
        stack = _local.phases = []
    return stack


class Phase:
    """``with Phase("capture"):`` (or ``start()`` ... ``stop()`` where the stretch is no block)
    adds its wall seconds, less those counted inside it, to ``capture_seconds``."""

    __slots__ = ("name", "_start", "_inner")

    def __init__(self, name: str) -> None:
        self.name = name
        self._start = 0.0
        self._inner = 0.0

    def start(self) -> Phase:
        self._start = time.perf_counter()
        self._inner = 0.0
        _phases().append(self)
        return self

    def stop(self) -> float:
        """End the phase; its wall seconds, inner work included (0 if it had stopped)."""
        stack = _phases()
        if self not in stack:  # (stopped already: an abort after a failed finish)
            return 0.0
        while stack.pop() is not self:  # (one left open by an exception inside this one)
            pass
        total = time.perf_counter() - self._start
        with _lock:
            _seconds[f"{self.name}_seconds"] += total - self._inner
        if stack:
            stack[-1]._inner += total
        return total

    def __enter__(self) -> Phase:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


_made_before_reset = [0]  # ``programs_made`` counts on across resets (a loop resetting each step)
_sources: list = []
_source_base: dict = {}  # their figures at the last reset(): snapshots count from there


def add_source(fn) -> None:
    """fn() -> {figure: value}, merged into every snapshot: figures another layer keeps (Dynamo's
    compile seconds, which ``compile/`` reads off Dynamo)."""
    if fn not in _sources:
        _sources.append(fn)


def add_seconds(name: str, seconds: float) -> None:
    """Add to the figure name a part of another one (no Phase: counted in both)."""
    with _lock:
        _seconds[name] += seconds


def count(name: str, n: int = 1) -> None:
    """Add n to the counter name (executions, host_to_device_bytes, ...)."""
    _counters[name] += n


# ``count("executions")`` without a Python frame: C's counting loop adds 1 under the GIL (every
# Strict op call counts one, ~1,230 a 12-layer Llama step). ``reset`` clears the same Counter.
count_execution = functools.partial(collections._count_elements, _counters, ("executions",))


def programs_made() -> int:
    """Programs compiled or loaded so far in this process (by JAX's compile, by key, or
    from JAX's persistent cache), ``reset`` or not, but those torchtpu's background threads made
    (``BACKGROUND_THREADS``): one that did not change over a step made none."""
    with _lock:  # (the counters of one program move together under it)
        return _programs_made()


def _programs_made() -> int:  # (under _lock)
    return _made_before_reset[0] + _counters["programs_loaded"] + \
        _counters["programs_loaded_by_key"] - _counters["programs_made_in_background"]


def count_fallback(op_name: str) -> None:
    with _lock:
        _fallbacks[op_name] += 1


def snapshot() -> dict:
    """All counters as a plain dict; ``cpu_fallbacks`` maps op name to count."""
    with _lock:
        c = dict(_counters)
        loaded = c.pop("programs_loaded", 0)
        hits = c.get("persistent_cache_hits", 0)
        out = {
            "executable_compiles": loaded - hits,
            "compile_seconds": round(_seconds["compile_seconds"], 6),
            "persistent_cache_hits": hits,
            "persistent_cache_misses": c.get("persistent_cache_misses", 0),
            "executions": c.get("executions", 0),
            "cpu_fallbacks": dict(_fallbacks),
            "host_to_device_bytes": c.get("host_to_device_bytes", 0),
            "device_to_host_bytes": c.get("device_to_host_bytes", 0),
        }
        for k, v in c.items():
            out.setdefault(k, v)
        for k, v in _seconds.items():
            out.setdefault(k, round(v, 6))
    for fn in _sources:  # (outside the lock: a source may take its own)
        for k, v in fn().items():
            out.setdefault(k, round(v - _source_base.get(k, 0), 6))
    return out


def reset() -> None:
    with _lock:
        _made_before_reset[0] = _programs_made()
        _counters.clear()
        _seconds.clear()
        _fallbacks.clear()
    _source_base.clear()
    for fn in _sources:
        _source_base.update(fn())


def report() -> str:
    """Readable text of snapshot(), one figure a line, fallbacks listed by op."""
    s = snapshot()
    fallbacks = s.pop("cpu_fallbacks")
    width = max(len(k) for k in s)
    lines = ["torchtpu metrics"]
    lines += [f"  {k:<{width}}  {v}" for k, v in s.items()]
    total = sum(fallbacks.values())
    lines.append(f"  {'cpu_fallbacks':<{width}}  {total}")
    for op, n in sorted(fallbacks.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {op}: {n}")
    return "\n".join(lines)
