"""Step diagnosis: run a training step a few times and explain where its time goes.

``step(fn, *args)`` calls ``fn(*args)`` ``steps`` times, each under a ``Watch`` and followed by
``torch.tpu.synchronize()``. The first ``warmup`` calls compile everything and are not judged;
the others are the steady state, where each of these is a problem, in this order of cost:
- Dynamo recompiles (with the guard that failed: a new shape, a changed Python value);
- programs built every step (a new shape each step: named with the user line that ran it);
- ops served by the CPU fallback (each a round trip through the host);
- host syncs from user lines (``loss.item()``: the host waits for the device each step);
- graph breaks (each splits the step into more programs);
- host-to-device copies (tensors made on CPU every step);
- a step that is mostly host time (Python and dispatch between many small programs).
The command line also says which of the model's attention head dims pad to 128 TPU lanes
(``advise_lanes``, ``tools/lanes.py``).

The ``Diagnosis`` lists every problem found with its fix, the worst first (``top``), and the
per-step figures they come from: programs run, programs built, syncs, fallbacks, bytes each way,
and the share of the step the host spent not waiting for the device. With ``profile=True`` one
more step runs under ``torch.profiler`` (host and device activity) and ``profile`` holds that
trace's summary (``tools/trace.py``): the programs that took the most device time and the
share of the step the device was busy.

``python -m torchtpu.diagnose script.py:factory [--backward] [--profile] [--json]`` diagnoses a
target's forward (and backward); ``--log FILE`` instead reads a failed run's traceback or log and
names the glossary category, the likely cause and the fix (``tools/triage.py``).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._pytree import tree_map

from torchtpu.commands import ToolError
from torchtpu.commands import main as tool_main
from torchtpu.tools import lanes, model_step, render, trace, triage
from torchtpu.tools.target import load
from torchtpu.tools.watch import Watch


@dataclass
class Finding:
    problem: str
    fix: str
    kind: str


@dataclass
class Diagnosis:
    steps: int
    warmup: int
    ms_per_step: float
    first_step_ms: float
    host_share: float                 # of steady-state step time, not waiting for the device
    per_step: dict                    # steady-state averages of the counters
    host_syncs: list                  # by user line: file, line, code, per_step, wait_ms
    programs_built: list              # steady-state new programs: program, shapes, file, line
    recompiles: list                  # Dynamo's reasons, all steps
    graph_breaks: list                # {"reason", "count"}, all steps
    findings: list = field(default_factory=list)
    profile: dict | None = None       # trace.summarize of one profiled step

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["top"] = asdict(self.top) if self.top else None
        return d


def _at(e: dict) -> str:
    return f"{e['file']}:{e['line']}" if e.get("file") else "(no user line: autograd thread)"


def _code(e: dict) -> str:
    return f"`{e['code']}` at {_at(e)}" if e.get("code") else _at(e)


def _syncs_by_line(records: list, n: int) -> list:
    by = collections.OrderedDict()
    for r in records:
        for s in r.host_syncs:
            if s["cause"] != "host_read":
                continue
            key = (s.get("file"), s.get("line"))
            e = by.setdefault(key, {**{k: s.get(k) for k in ("file", "line", "code")},
                                    "count": 0, "wait_ms": 0.0})
            e["count"] += 1
            e["wait_ms"] += s["seconds"] * 1e3
    out = []
    for e in by.values():
        out.append({**e, "per_step": round(e.pop("count") / n, 2),
                    "wait_ms": round(e["wait_ms"] / n, 3)})
    return sorted(out, key=lambda e: -e["per_step"])


def _averages(records: list) -> dict:
    n = len(records)
    total = collections.Counter()
    fallbacks = collections.Counter()
    for r in records:
        for k, v in r.metrics.items():
            if k == "cpu_fallbacks":
                fallbacks.update(v)
            else:
                total[k] += v
        total["programs_built"] += len(r.programs_built)
        total["host_syncs"] += sum(s["cause"] == "host_read" for s in r.host_syncs)
        total["dynamo_recompiles"] += len(r.recompiles)
    out = {k: round(v / n, 3) for k, v in sorted(total.items())}
    out["cpu_fallbacks"] = {op: round(c / n, 2) for op, c in fallbacks.most_common()}
    return out


def _elements(shape: str) -> int:
    """Elements of a JAX shape string such as ``f32[8,37]`` (0 when it has no shape)."""
    dims = shape.partition("[")[2].rstrip("]")
    return math.prod(int(n) for n in dims.split(",") if n.strip().isdigit()) if dims else 0


def _findings(d: Diagnosis, steady: list) -> list:
    found = []
    steady_recompiles = [r for rec in steady for r in rec.recompiles]
    if steady_recompiles:
        found.append(Finding(
            f"torch.compile recompiles {len(steady_recompiles) / len(steady):g} time(s) per "
            f"step after warm-up: {steady_recompiles[0]['reason'].splitlines()[0]}",
            "keep the guarded value fixed; for sizes that vary use torch.compile(dynamic=True) "
            "or pad inputs to a few fixed shapes", "recompile"))
    if d.programs_built:
        # The program with the largest input names the shape best (random draws take none).
        first = max(d.programs_built, key=lambda p: max(map(_elements, p["shapes"]), default=0))
        shapes = ", ".join(s for s in first["shapes"] if not s.endswith("[]")) or "()"
        found.append(Finding(
            f"{d.per_step['programs_built']:g} new program(s) compiled or loaded per step after "
            "warm-up: "
            f"shape ({shapes}) recompiles at {_code(first)}",
            "input shapes change every step: pad them to a few fixed sizes, or use "
            "torch.compile(dynamic=True)", "new_shapes"))
    for op, n in d.per_step["cpu_fallbacks"].items():
        found.append(Finding(
            f"aten op {op} runs on CPU {n:g} time(s) per step (a copy to the host and back "
            "each time)",
            "run `python -m torchtpu.onboard` to see which module calls it, then avoid the op "
            "or add its lowering (docs, Adding an op)", "cpu_fallback"))
    for s in d.host_syncs:
        often = "every step" if s["per_step"] == 1 else f"{s['per_step']:g} times per step"
        found.append(Finding(
            f"{_code(s)} syncs {often} (the host waits for the device: {s['wait_ms']:.2f} ms "
            "per step)",
            "keep the value on the device (accumulate `loss.detach()`) and read it every N "
            "steps, or not at all inside the step", "host_sync"))
    for b in d.graph_breaks:
        found.append(Finding(
            f"torch.compile breaks the graph ({b['count']}x): {b['reason']}",
            "move the Python-side work (prints, .item(), data-dependent control flow) out of the "
            "compiled function, or torch._dynamo.explain(fn)(*args) for details", "graph_break"))
    h2d = d.per_step.get("host_to_device_bytes", 0)
    if h2d:
        found.append(Finding(
            f"{h2d:g} bytes copied host -> device per step",
            "create tensors on the device (device=\"tpu\") or feed batches through "
            "torchtpu.DeviceLoader, which copies ahead of use", "transfer"))
    if d.host_share > 0.5 and d.per_step.get("executions", 0) > 1:
        found.append(Finding(
            f"{d.host_share:.0%} of the step is host time between "
            f"{d.per_step['executions']:g} programs per step",
            "run fewer, larger programs: torch.tpu.EagerMode.DEFER_AND_FUSE or "
            "torch.compile(backend=\"tpu\")", "host_bound"))
    return found


def _profiled(fn: Callable, args: tuple, kwargs: dict) -> dict:
    from torch.profiler import ProfilerActivity, profile

    # PrivateUse1 is ProfilerActivity.TPU under its own name, there in every PyTorch build.
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
            fn(*args, **kwargs)
            torch.tpu.synchronize()
        path = os.path.join(tmp, "step.json")
        prof.export_chrome_trace(path)
        return trace.summarize(path, top=10)


def step(fn: Callable, *args, steps: int = 5, warmup: int = 1, profile: bool = False,
         **kwargs) -> Diagnosis:
    """Diagnose ``fn(*args, **kwargs)``, one training step, over steps calls (see the module)."""
    if not callable(fn):
        raise ToolError(f"diagnose.step needs a callable step function, not {type(fn).__name__}")
    if warmup < 1 or steps <= warmup:
        raise ToolError(f"steps={steps}, warmup={warmup}: need warmup >= 1 and steps > warmup "
                        "(the warm-up steps compile and are not judged)")
    records, times, waits = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        with Watch() as w:
            fn(*args, **kwargs)
            synced = time.perf_counter()
            torch.tpu.synchronize()
            end = time.perf_counter()
        records.append(w.record)
        times.append(end - start)
        waits.append(end - synced + sum(s["seconds"] for s in w.record.host_syncs))
    steady = records[warmup:]
    wall = sum(times[warmup:])
    built = [p for r in steady for p in r.programs_built]
    d = Diagnosis(
        steps=steps, warmup=warmup,
        ms_per_step=round(wall / len(steady) * 1e3, 3),
        first_step_ms=round(times[0] * 1e3, 3),
        host_share=round(max(0.0, 1 - sum(waits[warmup:]) / wall) if wall else 0.0, 3),
        per_step=_averages(steady),
        host_syncs=_syncs_by_line(steady, len(steady)),
        programs_built=built,
        recompiles=[r["reason"] for rec in records for r in rec.recompiles],
        graph_breaks=[{"reason": k, "count": v} for k, v in sum(
            (collections.Counter(r.graph_breaks) for r in records), collections.Counter()).items()],
    )
    d.findings = _findings(d, steady)
    if profile:
        d.profile = _profiled(fn, args, kwargs)
    return d


def advise_lanes(d: Diagnosis, model: torch.nn.Module) -> Diagnosis:
    """Add what a TPU's 128-lane tiles make of model's attention head dims (tools/lanes.py):
    not a cost measured here (XLA:CPU has no lanes), so it comes after the measured ones."""
    d.findings += [Finding(text, "make the head dim a multiple of 128 (fewer, wider heads: "
                           "hidden size / heads = 128 or 256) if the model allows it", "tpu_lanes")
                   for text in lanes.advice(model)]
    return d


def step_of_model(model: torch.nn.Module, inputs: tuple, backward: bool,
                  profile: bool = False) -> Diagnosis:
    """``step`` on the model's forward (and backward) on tpu, in the default eager mode."""
    model = copy.deepcopy(model).to("tpu").eval()
    args = tree_map(model_step.to_tpu, inputs)

    def train_step():
        model.zero_grad(set_to_none=True)
        model_step.run(model, args, backward)

    with model_step.fallbacks_allowed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return step(train_step, profile=profile)


def format_report(d: Diagnosis) -> str:
    """The diagnosis for people: the top problem first, then the figures."""
    lines = [f"step diagnosis: {d.ms_per_step:.2f} ms per step after {d.warmup} warm-up "
             f"step(s) (first step {d.first_step_ms:.0f} ms), {d.host_share:.0%} host time"]
    if d.top is None:
        lines.append("no problem found")
    for i, f in enumerate(d.findings):
        lines.append(f"{'top problem' if i == 0 else 'also'}: {f.problem}")
        lines.append(f"  fix: {f.fix}")
    per = {k: v for k, v in d.per_step.items() if v and k != "cpu_fallbacks"}
    lines.append("per step:")
    lines += render.table(["figure", "value"], sorted(per.items()))
    if d.profile is not None:
        lines.append(f"profiled step: {d.profile['span_ms']:.2f} ms, device busy "
                     f"{d.profile['device_busy_share']:.0%}; programs by device time:")
        lines += render.table(["program", "runs", "ms"], [
            [p["name"], p["count"], p["total_ms"]] for p in d.profile["device"]])
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    """``python -m torchtpu.diagnose``: a target's step, or ``--log FILE`` (see the module)."""
    parser = argparse.ArgumentParser(prog="python -m torchtpu.diagnose",
                                     description="why a step is slow, or what a log's error means")
    parser.add_argument("target", nargs="?", help="path/to/script.py:factory")
    parser.add_argument("--log", help="a traceback or log file to triage instead")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true", help="print JSON for programs")
    args = parser.parse_args(argv)

    def run() -> int:
        if (args.log is None) == (args.target is None):
            raise ToolError("give a target (path/to/script.py:factory) or --log FILE, not both")
        if args.log is not None:
            found = triage.triage(triage.read_log(args.log))
            print(json.dumps(found.to_dict(), indent=1) if args.json
                  else triage.format_triage(found))
            return 0
        model, inputs = load(args.target)
        d = step_of_model(model, inputs, args.backward, args.profile)
        advise_lanes(d, model)
        print(json.dumps(d.to_dict(), indent=1, default=str) if args.json else format_report(d))
        return 0

    return tool_main(run)
