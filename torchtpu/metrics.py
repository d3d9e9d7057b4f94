"""Process-wide counters: compiles, cache hits, executions, CPU fallbacks and transfers.

``snapshot()`` returns them as a dict, ``report()`` as readable text, ``reset()`` zeroes them.
Compile figures come from JAX's own monitoring events, so every executor and the compiled path
are counted the same way.
"""

from __future__ import annotations

import collections
import threading

from jax import monitoring

_lock = threading.Lock()
_counters: collections.Counter = collections.Counter()
_seconds: collections.Counter = collections.Counter()
_fallbacks: collections.Counter = collections.Counter()

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_MISS = "/jax/compilation_cache/cache_misses"


def _on_duration(event: str, seconds: float, **_: object) -> None:
    if event == _BACKEND_COMPILE:
        with _lock:
            _counters["programs_loaded"] += 1
            _seconds["compile_seconds"] += seconds


def _on_event(event: str, **_: object) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _counters["persistent_cache_hits"] += 1
    elif event == _CACHE_MISS:
        with _lock:
            _counters["persistent_cache_misses"] += 1


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)


def count(name: str, n: int = 1) -> None:
    """Add n to the counter name (executions, host_to_device_bytes, ...)."""
    _counters[name] += n


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
        return out


def reset() -> None:
    with _lock:
        _counters.clear()
        _seconds.clear()
        _fallbacks.clear()


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
