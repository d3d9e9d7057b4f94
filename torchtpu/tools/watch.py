"""What a stretch of user code made torchtpu do, attributed to the user's lines.

``Watch`` is a context manager that, while open, records
- host syncs: every host read (``.item()``, ``.cpu()``, ``print``) with the user line that asked
  for it, its bytes and the seconds the host waited (the hook in ``device/kernels.py``);
- programs built: each XLA program JAX traced and lowered (a new op signature, a new shape), or
  loaded by key from the warm-start cache, with its input shapes and the user line (from JAX's
  compile log and the warm start's, read at DEBUG level);
- Dynamo's recompiles with their guard-failure reasons and graph breaks with theirs (Dynamo's
  structured trace and counters, read only when Dynamo is loaded);
- the change in ``torchtpu.metrics`` (executions, compiles, CPU fallbacks, transfers).

Nothing here costs anything while no ``Watch`` is open.
"""

from __future__ import annotations

import collections
import json
import linecache
import logging
import os
import sys
import threading
import types
from dataclasses import dataclass, field

from torchtpu import metrics
from torchtpu.cache import warm
from torchtpu.commands import user_frame
from torchtpu.device.hooks import HOOKS

_FALLBACK_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eager",
                              "fallback.py")
_JAX_COMPILE_LOGGER = "jax._src.interpreters.pxla"


def where(frame: types.FrameType | None) -> dict:
    """file, line and source text of frame ({} when there is none: the autograd thread)."""
    if frame is None:
        return {}
    path, line = frame.f_code.co_filename, frame.f_lineno
    return {"file": path, "line": line, "code": linecache.getline(path, line).strip()}


def _stack_passes(frame: types.FrameType | None, filename: str) -> bool:
    while frame is not None:
        if frame.f_code.co_filename == filename:
            return True
        frame = frame.f_back
    return False


@dataclass
class Record:
    """What one watched stretch did; lists hold one dict per event."""

    host_syncs: list = field(default_factory=list)
    programs_built: list = field(default_factory=list)
    recompiles: list = field(default_factory=list)
    graph_breaks: dict = field(default_factory=dict)
    dynamo_graphs: int = 0
    metrics: dict = field(default_factory=dict)


class _CompileLog(logging.Handler):
    """Receives JAX's "Compiling <name> with global shapes and types [...]" records, and the
    warm start's "Loading <name> ..." for a program a cache held (a new program all the same)."""

    def __init__(self, sink: list) -> None:
        super().__init__(logging.DEBUG)
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if not record.msg.startswith(("Compiling ", "Loading ")):
            return
        name, avals = record.args[0], record.args[1]
        shapes = [a.str_short() if hasattr(a, "str_short") else str(a) for a in avals]
        self._sink.append({"program": str(name), "shapes": shapes,
                           **where(user_frame(sys._getframe(1)))})


class _DynamoTrace(logging.Handler):
    """Receives Dynamo's structured trace; keeps the recompile reasons."""

    def __init__(self, sink: list) -> None:
        super().__init__(logging.DEBUG)
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        artifact = getattr(record, "metadata", {}).get("artifact", {})
        if artifact.get("name") != "recompile_reasons":
            return
        payload = getattr(record, "payload", None)
        try:
            reasons = json.loads(payload)
        except (TypeError, ValueError):
            reasons = payload
        # One recompile; a reason per cached graph whose guards failed.
        reasons = [str(r).strip() for r in (reasons if isinstance(reasons, list) else [reasons])]
        self._sink.append({"reason": reasons[0] if reasons else "", "reasons": reasons})


def _dynamo_counters() -> tuple[collections.Counter, int]:
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return collections.Counter(), 0
    return (collections.Counter(utils.counters["graph_break"]),
            utils.counters["stats"]["unique_graphs"])


def metrics_delta(before: dict, after: dict) -> dict:
    """after - before for every number in torchtpu.metrics, fallbacks by op."""
    out = {}
    for k, v in after.items():
        if k == "cpu_fallbacks":
            old = before.get(k, {})
            out[k] = {op: n - old.get(op, 0) for op, n in v.items() if n != old.get(op, 0)}
        elif isinstance(v, (int, float)):
            change = v - before.get(k, 0)
            out[k] = round(change, 6) if isinstance(change, float) else change
    return out


class Watch:
    """Context manager recording what the code inside it made torchtpu do (see the module)."""

    _active = threading.Lock()  # one Watch at a time: the hooks are process-wide

    def __init__(self) -> None:
        self.record = Record()

    def _on_host_read(self, nbytes: int, seconds: float) -> None:
        frame = sys._getframe(1)
        self.record.host_syncs.append({
            "bytes": nbytes, "seconds": seconds,
            # A CPU fallback copies its operands to the host: a sync, but the fallback's.
            "cause": "cpu_fallback" if _stack_passes(frame, _FALLBACK_FILE) else "host_read",
            **where(user_frame(frame)),
        })

    def __enter__(self) -> Watch:
        if not Watch._active.acquire(blocking=False):
            raise RuntimeError("torchtpu.tool: another torchtpu Watch is already open "
                               "(tools watch one stretch of code at a time)")
        self._compile_handler = _CompileLog(self.record.programs_built)
        self._program_loggers = []
        for logger in (logging.getLogger(_JAX_COMPILE_LOGGER), warm.PROGRAM_LOG):
            self._program_loggers.append((logger, logger.level, logger.propagate))
            logger.addHandler(self._compile_handler)
            logger.setLevel(logging.DEBUG)
            # The DEBUG records are ours: the application's handlers never asked for them.
            logger.propagate = False
        self._trace_handler = _DynamoTrace(self.record.recompiles)
        logging.getLogger("torch.__trace").addHandler(self._trace_handler)
        self._breaks, self._graphs = _dynamo_counters()
        self._metrics = metrics.snapshot()
        HOOKS.host_read_watcher = self._on_host_read
        return self

    def __exit__(self, *exc) -> None:
        HOOKS.host_read_watcher = None
        logging.getLogger("torch.__trace").removeHandler(self._trace_handler)
        for logger, level, propagate in self._program_loggers:
            logger.removeHandler(self._compile_handler)
            logger.setLevel(level)
            logger.propagate = propagate
        breaks, graphs = _dynamo_counters()
        self.record.graph_breaks = dict(breaks - self._breaks)
        self.record.dynamo_graphs = graphs - self._graphs
        self.record.metrics = metrics_delta(self._metrics, metrics.snapshot())
        Watch._active.release()
