"""A summary of a profiler trace: where the time went, by event name.

``summarize(path)`` reads a Chrome trace (``torch.profiler``'s ``export_chrome_trace``, JAX's
``*.trace.json.gz``; a folder means the newest trace file under it) and returns its span, the
time per event category, and the events that took the most time in total, each with its count
and share of the span; ``device`` lists the device programs alone (``tpu_program`` events,
which ``torch.profiler`` with ``ProfilerActivity.TPU`` records) and their share of the span.
"""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path

from torchtpu.commands import ToolError

_DEVICE = "tpu_program"  # the category of a device program run in torchtpu's traces
_PATTERNS = ("*.trace.json.gz", "*.trace.json", "*.json.gz", "*.json")


def _find(path: Path) -> Path:
    if path.is_file():
        return path
    if path.is_dir():
        found = [p for pattern in _PATTERNS for p in path.rglob(pattern)]
        if found:
            return max(found, key=lambda p: p.stat().st_mtime)
        raise ToolError(f"{path} holds no trace file ({', '.join(_PATTERNS)})")
    raise ToolError(f"{path} does not exist")


def summarize(path: str | Path, top: int = 15) -> dict:
    """The span of the trace at path and its top events by total duration (milliseconds)."""
    file = _find(Path(path))
    try:
        raw = gzip.decompress(file.read_bytes()) if file.suffix == ".gz" else file.read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ToolError(f"{file} is not a Chrome trace (JSON): {e}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ToolError(f"{file} has no traceEvents list")
    total, count, device, categories = (collections.Counter() for _ in range(4))
    start, end = float("inf"), float("-inf")
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "dur" not in e:
            continue
        ts, dur, name = float(e.get("ts", 0)), float(e["dur"]), e.get("name", "?")
        start, end = min(start, ts), max(end, ts + dur)
        total[name] += dur
        count[name] += 1
        categories[e.get("cat", "?")] += dur
        if e.get("cat") == _DEVICE:
            device[name] += dur
    span = max(end - start, 0.0) if count else 0.0

    def ranked(totals: collections.Counter) -> list:
        return [{"name": name, "count": count[name], "total_ms": round(us / 1e3, 3),
                 "share_of_span": round(us / span, 4) if span else 0.0}
                for name, us in totals.most_common(top)]

    return {
        "file": str(file),
        "events": sum(count.values()),
        "span_ms": round(span / 1e3, 3),
        "by_category_ms": {c: round(us / 1e3, 3) for c, us in categories.most_common()},
        "device_busy_share": round(sum(device.values()) / span, 4) if span else 0.0,
        "top": ranked(total),
        "device": ranked(device),
    }
