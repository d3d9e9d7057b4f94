"""Device memory figures in CUDA's shape: ``torch.tpu.memory_stats``, ``max_memory_allocated``...

Training frameworks call these (TorchTitan's memory monitor, vLLM's ``mem_get_info``). Figures come
from the runtime: PJRT's allocator statistics where the platform keeps them (TPU, GPU), else the
bytes of the live JAX arrays on this process's device (XLA:CPU has no allocator statistics). XLA
allocates per array and frees when the last reference dies, so "reserved" equals "allocated"
where the runtime does not report a pool, and ``empty_cache`` has nothing to release.

PJRT's peak cannot be reset, so the peak is also sampled here (at each query and at
``torch.tpu.synchronize``; where the runtime keeps no statistics, at most every
``SAMPLE_INTERVAL_S`` there); after ``reset_peak_memory_stats`` the runtime's peak counts again only
once it rises above the value it had at the reset.
"""

from __future__ import annotations

import os
import threading
import time

import jax

from torchtpu.runtime import platform

_lock = threading.Lock()
_peak = {"allocated": 0, "reserved": 0}
_runtime_peak_at_reset = {"allocated": 0, "reserved": 0}
# The runtime's counters cannot be reset either: their values at reset_accumulated_memory_stats.
_counts_at_reset = {"num_allocs": 0, "num_ooms": 0}


def _runtime_stats() -> dict:
    return platform.local_device().memory_stats() or {}


def _live_bytes() -> int:
    device = platform.local_device()
    return sum(
        a.nbytes for a in jax.live_arrays() if not a.is_deleted() and device in a.devices()
    )


def _current(stats: dict | None = None) -> dict:
    stats = _runtime_stats() if stats is None else stats
    allocated = stats.get("bytes_in_use", _live_bytes() if not stats else 0)
    reserved = stats.get("bytes_reserved", 0) + allocated if "bytes_reserved" in stats \
        else allocated
    runtime_peak = {
        "allocated": stats.get("peak_bytes_in_use", 0),
        "reserved": stats.get("peak_bytes_reserved", stats.get("peak_bytes_in_use", 0)),
    }
    current = {"allocated": allocated, "reserved": reserved}
    with _lock:
        for key, value in current.items():
            sampled = max(_peak[key], value)
            if runtime_peak[key] > _runtime_peak_at_reset[key]:
                sampled = max(sampled, runtime_peak[key])
            _peak[key] = sampled
        peak = dict(_peak)
    counts = {key: stats.get(key, 0) - _counts_at_reset[key] for key in _counts_at_reset}
    return {"current": current, "peak": peak, "limit": stats.get("bytes_limit", 0), **counts}


# Where the runtime keeps no statistics (XLA:CPU) a sample walks every live array (~3 µs each:
# milliseconds a synchronize for a model with optimizer state), so synchronize samples at most
# this often there; a query always samples.
SAMPLE_INTERVAL_S = 0.05
_last_walk = [float("-inf")]


def sample() -> None:
    """Fold the current figures into the sampled peak (called at synchronize)."""
    stats = _runtime_stats()
    if not stats:
        now = time.monotonic()
        if now - _last_walk[0] < SAMPLE_INTERVAL_S:
            return
        _last_walk[0] = now
    _current(stats)


def memory_allocated() -> int:
    """Bytes held by live arrays on this process's device."""
    return _current()["current"]["allocated"]


def max_memory_allocated() -> int:
    return _current()["peak"]["allocated"]


def memory_reserved() -> int:
    return _current()["current"]["reserved"]


def max_memory_reserved() -> int:
    return _current()["peak"]["reserved"]


def reset_peak_memory_stats() -> None:
    stats = _runtime_stats()
    current = _current()["current"]
    with _lock:
        _peak.update(current)
        _runtime_peak_at_reset["allocated"] = stats.get("peak_bytes_in_use", 0)
        _runtime_peak_at_reset["reserved"] = stats.get(
            "peak_bytes_reserved", stats.get("peak_bytes_in_use", 0))


def reset_accumulated_memory_stats() -> None:
    """The counters of :func:`memory_stats` (allocations, out-of-memory refusals) from zero."""
    stats = _runtime_stats()
    with _lock:
        for key in _counts_at_reset:
            _counts_at_reset[key] = stats.get(key, 0)


def total_memory() -> int:
    """The device's memory: the runtime's limit, else (XLA:CPU) the host's physical memory."""
    limit = _runtime_stats().get("bytes_limit", 0)
    return int(limit or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes, as ``torch.cuda.mem_get_info``."""
    total = total_memory()
    if _runtime_stats().get("bytes_limit"):
        return max(total - memory_reserved(), 0), total
    return _host_available(), total


def _host_available() -> int:
    """Host memory a new allocation can get: MemAvailable counts the page cache the kernel
    reclaims on demand, which the free-page count leaves out (on a busy host most of it)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def memory_stats() -> dict:
    """The keys of ``torch.cuda.memory_stats`` that frameworks read, from the figures above."""
    figures = _current()
    stats = {}
    for name, key in (("allocated_bytes", "allocated"), ("active_bytes", "allocated"),
                      ("reserved_bytes", "reserved")):
        stats[f"{name}.all.current"] = figures["current"][key]
        stats[f"{name}.all.peak"] = figures["peak"][key]
    stats["num_alloc_retries"] = 0
    stats["num_ooms"] = figures["num_ooms"]
    stats["num_device_alloc"] = figures["num_allocs"]
    return stats


def memory_summary() -> str:
    """The figures of :func:`memory_stats`, then, while memory history is recorded
    (``torch.tpu.memory._record_memory_history()``), the largest live allocations and the user
    line that made each."""
    from torchtpu.device import memory_history

    stats = memory_stats()
    width = max(len(k) for k in stats)
    lines = [f"{k:<{width}}  {v:>16,}" for k, v in stats.items()]
    largest = memory_history.largest()
    if largest:
        lines.append("largest live allocations (torch.tpu.memory._record_memory_history):")
        for block in largest:
            where = block["frames"][0] if block["frames"] else None
            site = f"{where['filename']}:{where['line']} in {where['name']}" if where else "?"
            lines.append(f"  {block['size']:>16,} B  {site}")
    return "\n".join(lines)
