"""A summary of a profiler trace: where the time went, by event name.

``summarize(path)`` reads a Chrome trace (``torch.profiler``'s ``export_chrome_trace``, JAX's
``*.trace.json.gz``; a folder means the newest trace file under it) and returns its span and the
events that took the most time in total, each with its count and share of the span.
"""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path

from torchtpu.tools.target import ToolError

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
    total = collections.Counter()
    count = collections.Counter()
    start, end = float("inf"), float("-inf")
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "dur" not in e:
            continue
        ts, dur = float(e.get("ts", 0)), float(e["dur"])
        start, end = min(start, ts), max(end, ts + dur)
        total[e.get("name", "?")] += dur
        count[e.get("name", "?")] += 1
    span = max(end - start, 0.0) if count else 0.0
    return {
        "file": str(file),
        "events": sum(count.values()),
        "span_ms": round(span / 1e3, 3),
        "top": [{"name": name, "count": count[name], "total_ms": round(us / 1e3, 3),
                 "share_of_span": round(us / span, 4) if span else 0.0}
                for name, us in total.most_common(top)],
    }
