"""``torch_xla.debug.metrics`` (``met``): PyTorch/XLA's metric names over ``torchtpu.metrics``.

``metrics_report()`` is ``torchtpu.metrics.report()``. PyTorch/XLA's two metrics scripts read most
are ``CompileTime`` (programs compiled; total seconds) and ``ExecuteTime`` (programs run); its
counters are torchtpu's counters by their own names, and ``aten::<op>`` for each op the CPU
fallback served (``executed_fallback_ops()``).
"""

from __future__ import annotations

from torchtpu import metrics as _metrics
from torchtpu.integrations.torch_xla import _missing


def metrics_report() -> str:
    return _metrics.report()


def short_metrics_report(counter_names: list | None = None, metric_names: list | None = None,
                         ) -> str:
    lines = [f"Metric: {name}\n  TotalSamples: {metric_data(name)[0]}"
             for name in (metric_names or metric_names_())]
    lines += [f"Counter: {name}\n  Value: {counter_value(name)}"
              for name in (counter_names or counter_names_()) if counter_value(name)]
    return "\n".join(lines) + "\n"


def _counters() -> dict:
    snap = _metrics.snapshot()
    fallbacks = snap.pop("cpu_fallbacks")
    out = {k: v for k, v in snap.items() if isinstance(v, int)}
    out.update({f"aten::{op}": n for op, n in fallbacks.items()})
    return out


def counter_names_() -> list[str]:
    return sorted(_counters())


def counter_value(name: str) -> int | None:
    return _counters().get(name)


def metric_names_() -> list[str]:
    return ["CompileTime", "ExecuteTime"]


def metric_data(name: str) -> tuple | None:
    """(samples, total, recent samples): total in nanoseconds for CompileTime, as in PyTorch/XLA;
    ExecuteTime counts runs (torchtpu does not time each run: its total is 0)."""
    snap = _metrics.snapshot()
    if name == "CompileTime":
        return snap["executable_compiles"], int(snap["compile_seconds"] * 1e9), []
    if name == "ExecuteTime":
        return snap["executions"], 0, []
    return None


def executed_fallback_ops() -> list[str]:
    return sorted(f"aten::{op}" for op in _metrics.snapshot()["cpu_fallbacks"])


def clear_all() -> None:
    _metrics.reset()


clear_counters = clear_metrics = clear_all
counter_names = counter_names_
metric_names = metric_names_

__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
