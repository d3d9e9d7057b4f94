"""Onboarding a model: does it run on tpu, where does it diverge from CPU, what runs on CPU.

``run(model, inputs)`` runs the model on CPU (the reference) and on tpu in every eager mode and
under ``torch.compile``, with every submodule hooked, and returns a report:
- per mode, the first submodule (in the order they finish) whose outputs diverge from CPU beyond
  the tolerance, and with ``backward=True`` the first (in the order backward reaches them) whose
  input gradients do, else the first parameter gradient that does;
- every op the CPU fallback served, with its count and the module paths it came from;
- graph breaks and recompiles under torch.compile, with their reasons;
- time per step in each mode (forward, plus backward when asked), after a warm-up step.

The model and inputs are copied for each run, in eval mode (dropout would make every comparison
differ); the caller's are left as they were.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._pytree import tree_leaves, tree_map

from torchtpu import metrics, settings
from torchtpu.tools import diagnose, render
from torchtpu.tools.target import ToolError, check, describe, load
from torchtpu.tools.target import main as tool_main
from torchtpu.tools.watch import Watch

MODES = ("strict", "debug", "defer_and_fuse", "compile")
_EAGER = {"strict": "DEFER_NEVER", "debug": "DEFER_NEVER_AND_LAUNCH_BLOCKING",
          "defer_and_fuse": "DEFER_AND_FUSE"}


@dataclass
class Divergence:
    module: str          # module path ("" is the model itself)
    module_type: str
    kind: str            # "output", "input_grad" or "param_grad"
    max_abs_error: float
    detail: str


@dataclass
class ModeResult:
    mode: str
    error: str | None = None
    divergence: Divergence | None = None
    grad_divergence: Divergence | None = None
    fallbacks: list = field(default_factory=list)   # {"op", "count", "modules": {path: n}}
    graph_breaks: list = field(default_factory=list)  # {"reason", "count"}
    recompiles: list = field(default_factory=list)   # reasons
    graphs: int = 0
    ms_per_step: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.divergence is None and self.grad_divergence is None


@dataclass
class Report:
    model: str
    inputs: list
    backward: bool
    atol: float
    rtol: float
    cpu_ms_per_step: float
    modes: list

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.modes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        for m, dm in zip(self.modes, d["modes"]):
            dm["ok"] = m.ok
        return d


def _loss(out) -> torch.Tensor:
    """A scalar every floating output contributes to (their sum), for backward."""
    parts = [t.float().sum() for t in tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not parts:
        raise ToolError("backward: no output of the model requires grad")
    return sum(parts)


class _Hooks:
    """Forward (and full backward) hooks on every submodule, recording, per call:
    outputs in the order modules finish, input gradients in the order backward reaches them,
    and the CPU fallbacks counted while each module (innermost) was running."""

    def __init__(self, model: torch.nn.Module, backward: bool) -> None:
        self.outputs: list = []      # (path, type, outputs)
        self.grads: list = []        # (path, type, grad_input)
        self.fallbacks: dict = collections.defaultdict(collections.Counter)  # op -> path -> n
        self._stack: list = []
        self._seen = dict(metrics.snapshot()["cpu_fallbacks"])
        self._handles = []
        for path, m in model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._pre(path)))
            self._handles.append(m.register_forward_hook(self._post(path)))
            if backward:
                self._handles.append(m.register_full_backward_hook(self._grad(path)))

    def charge(self, where: str | None = None) -> None:
        """Fallbacks counted since the last charge go to where (default: the running module)."""
        now = metrics.snapshot()["cpu_fallbacks"]
        if where is None:
            where = self._stack[-1] if self._stack else "(outside any module)"
        for op, n in now.items():
            new = n - self._seen.get(op, 0)
            if new:
                self.fallbacks[op][where] += new
        self._seen = dict(now)

    def _pre(self, path):
        def hook(module, args):
            self.charge()
            self._stack.append(path)
        return hook

    def _post(self, path):
        def hook(module, args, out):
            self.charge()
            self._stack.pop()
            self.outputs.append((path, type(module).__name__, _detached(out)))
        return hook

    def _grad(self, path):
        def hook(module, grad_input, grad_output):
            self.grads.append((path, type(module).__name__, _detached(grad_input)))
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _detached(x) -> list:
    return [t.detach() if isinstance(t, torch.Tensor) else None for t in tree_leaves(x)]


def _max_error(actual: list, expected: list, atol: float, rtol: float) -> tuple[float, str] | None:
    """(max abs error, what differs) when actual diverges from expected, else None."""
    if len(actual) != len(expected):
        return float("inf"), f"{len(actual)} tensors where CPU gives {len(expected)}"
    worst, detail = 0.0, ""
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a is None or e is None:
            continue
        a = a.cpu()
        if a.shape != e.shape or a.dtype != e.dtype:
            return float("inf"), f"tensor {i}: {a.dtype}{list(a.shape)} where CPU gives " \
                                 f"{e.dtype}{list(e.shape)}"
        if not e.is_floating_point() and not e.is_complex():
            if not torch.equal(a, e):
                return float("inf"), f"tensor {i}: {int((a != e).sum())} elements differ"
            continue
        a, e = a.double(), e.double()
        if not torch.allclose(a, e, atol=atol, rtol=rtol, equal_nan=True):
            err = float((a - e).abs().nan_to_num(float("inf")).max())
            if err >= worst:
                worst = err
                detail = f"tensor {i} {list(e.shape)}: max abs error {err:.3g} " \
                         f"(atol {atol:g}, rtol {rtol:g})"
    return (worst, detail) if detail else None


def _first_divergence(actual: list, expected: list, kind: str, atol: float, rtol: float):
    for (path, typ, a), (_, _, e) in zip(actual, expected):
        found = _max_error(a, e, atol, rtol)
        if found is not None:
            return Divergence(path, typ, kind, *found)
    if len(actual) != len(expected):
        return Divergence("", "", kind, float("inf"),
                          f"{len(actual)} module calls on tpu, {len(expected)} on CPU")
    return None


def _param_divergence(model, reference, atol, rtol):
    named = dict(reference.named_parameters())
    for name, p in reversed(list(model.named_parameters())):
        e = named[name].grad
        found = _max_error([p.grad], [e], atol, rtol) if (p.grad is None) == (e is None) else \
            (float("inf"), "gradient missing on one side")
        if found is not None:
            path = name.rpartition(".")[0]
            typ = type(model.get_submodule(path)).__name__
            return Divergence(path, typ, "param_grad", found[0], f"{name}: {found[1]}")
    return None


def _step(model, inputs, backward: bool):
    out = model(*inputs)
    if backward:
        _loss(out).backward()
    return out


def _timed(model, inputs, backward: bool, steps: int, sync) -> float:
    """Milliseconds per step over steps runs, after the caller's first (compiling) run."""
    start = time.perf_counter()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        _step(model, inputs, backward)
        sync()
    return (time.perf_counter() - start) / steps * 1e3


def _fallbacks_allowed():
    """Ops without a lowering run on CPU, quietly: the report lists them."""
    return settings.CPU_FALLBACK.overridden("silent")


def _to_tpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("tpu").requires_grad_(x.requires_grad)
    return x


def _run_mode(mode, reference, ref_hooks, inputs, backward, atol, rtol, steps) -> ModeResult:
    result = ModeResult(mode)
    model = copy.deepcopy(reference).to("tpu")
    model.zero_grad(set_to_none=True)
    args = tree_map(_to_tpu, inputs)
    eager = mode in _EAGER
    hooks = _Hooks(model, backward) if eager else None
    target = model if eager else torch.compile(model, backend="tpu")

    def context():
        if eager:
            return torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, _EAGER[mode]))
        return contextlib.nullcontext()
    try:
        with context(), Watch() as watch:
            out = target(*args)
            if hooks is not None:
                hooks.charge()
            if backward:
                _loss(out).backward()
                if hooks is not None:
                    hooks.charge("(backward)")
            torch.tpu.synchronize()
        if hooks is not None:
            hooks.remove()
            result.divergence = _first_divergence(hooks.outputs, ref_hooks.outputs, "output",
                                                  atol, rtol)
            if backward and result.divergence is None:
                result.grad_divergence = _first_divergence(hooks.grads, ref_hooks.grads,
                                                           "input_grad", atol, rtol)
            fallbacks = hooks.fallbacks
        else:
            ref_out = ref_hooks.outputs[-1]
            found = _max_error(_detached(out), ref_out[2], atol, rtol)
            if found is not None:
                result.divergence = Divergence("", ref_out[1], "output", *found)
            fallbacks = {op: {"(compiled graph)": n}
                         for op, n in watch.record.metrics.get("cpu_fallbacks", {}).items()}
        # Gradients after a forward divergence differ because of it: not compared.
        if backward and result.divergence is None and result.grad_divergence is None:
            result.grad_divergence = _param_divergence(model, reference, atol, rtol)
        result.fallbacks = sorted(
            ({"op": op, "count": sum(by.values()), "modules": dict(by)}
             for op, by in fallbacks.items()), key=lambda f: -f["count"])
        result.graph_breaks = [{"reason": r, "count": n}
                               for r, n in watch.record.graph_breaks.items()]
        result.recompiles = [r["reason"] for r in watch.record.recompiles]
        result.graphs = watch.record.dynamo_graphs
        with context():
            result.ms_per_step = round(_timed(target, args, backward, steps,
                                              torch.tpu.synchronize), 3)
    except ToolError:
        raise
    except Exception as e:
        result.error = describe(e)
    finally:
        if hooks is not None:
            hooks.remove()
    return result


def run(model: torch.nn.Module, inputs, *, backward: bool = False,
        modes: tuple = MODES, atol: float = 1e-4, rtol: float = 1e-4, steps: int = 3) -> Report:
    """Onboard model on example inputs (see the module); the model may be on cpu or tpu."""
    model, inputs = check((model, inputs), "onboard")
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ToolError(f"unknown mode(s) {', '.join(sorted(unknown))}; use {', '.join(MODES)}")
    reference = copy.deepcopy(model).cpu().eval()
    reference.zero_grad(set_to_none=True)
    cpu_inputs = tree_map(lambda x: x.detach().cpu().requires_grad_(x.requires_grad)
                          if isinstance(x, torch.Tensor) else x, inputs)
    hooks = _Hooks(reference, backward)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the full backward hooks' notes about leaf inputs
            _step(reference, cpu_inputs, backward)
    except ToolError:
        raise
    except Exception as e:
        raise ToolError(f"the model fails on CPU itself, so there is no reference to compare "
                        f"with: {describe(e)}") from None
    finally:
        hooks.remove()
    cpu_ms = _timed(reference, cpu_inputs, backward, steps, lambda: None)
    results = []
    with _fallbacks_allowed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in modes:
            results.append(_run_mode(mode, reference, hooks, cpu_inputs, backward, atol, rtol,
                                     steps))
    shapes = [f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
              for t in inputs]
    return Report(type(model).__name__, shapes, backward, atol, rtol, round(cpu_ms, 3), results)


def _where(d: Divergence | None) -> str:
    if d is None:
        return "matches CPU"
    return f"{d.module or '(the model)'} ({d.module_type}) {d.kind}: {d.detail}"


def format_report(r: Report) -> str:
    """The report for people: one row per mode, then fallbacks, graph breaks, recompiles."""
    lines = [f"onboarding {r.model}({', '.join(r.inputs)}) "
             f"{'forward+backward' if r.backward else 'forward'}; "
             f"cpu {r.cpu_ms_per_step:.2f} ms/step"]
    rows = []
    for m in r.modes:
        verdict = m.error.splitlines()[0] if m.error else _where(m.divergence)
        if r.backward and m.error is None and m.divergence is None:
            verdict += f"; gradients: {_where(m.grad_divergence)}"
        rows.append([m.mode, "ok" if m.ok else "FAIL",
                     "-" if m.ms_per_step is None else f"{m.ms_per_step:.2f}", verdict])
    lines += render.table(["mode", "", "ms/step", "result"], rows, width=140)
    for m in r.modes:
        for f in m.fallbacks:
            at = ", ".join(f"{p or '(the model)'} x{n}" for p, n in f["modules"].items())
            lines.append(f"{m.mode}: cpu fallback {f['op']} x{f['count']} from {at}")
        for b in m.graph_breaks:
            lines.append(f"{m.mode}: graph break x{b['count']}: {b['reason']}")
        for reason in m.recompiles:
            lines.append(f"{m.mode}: recompile: {reason}")
    lines.append("all modes match CPU" if r.ok else "some modes differ from CPU or fail")
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtpu.onboard",
        description="Run a model on CPU and on tpu in every mode and report where it diverges, "
                    "what runs on CPU, graph breaks, recompiles and time per step.")
    parser.add_argument("target", help="path/to/script.py:factory; factory() returns "
                                       "(model, inputs)")
    parser.add_argument("--backward", action="store_true", help="compare gradients too")
    parser.add_argument("--json", action="store_true", help="print JSON for programs")
    parser.add_argument("--diagnose", action="store_true",
                        help="also diagnose a step (forward, and backward with --backward)")
    parser.add_argument("--profile", action="store_true",
                        help="with --diagnose: profile one step too (device time by program)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of "
                        + ", ".join(MODES))
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args(argv)

    def go() -> int:
        model, inputs = load(args.target)
        modes = tuple(m for m in args.modes.split(",") if m)
        report = run(model, inputs, backward=args.backward, modes=modes, atol=args.atol,
                     rtol=args.rtol)
        out = {"onboard": report.to_dict()}
        diagnosis = (diagnose_model(model, inputs, args.backward, args.profile)
                     if args.diagnose else None)
        if diagnosis is not None:
            out["diagnosis"] = diagnosis.to_dict()
        if args.json:
            print(json.dumps(out, indent=1, default=str))
        else:
            print(format_report(report))
            if diagnosis is not None:
                print(diagnose.format_report(diagnosis))
        return 0 if report.ok else 1
    return tool_main(go)


def diagnose_model(model: torch.nn.Module, inputs: tuple, backward: bool,
                   profile: bool = False) -> diagnose.Diagnosis:
    """diagnose.step on the model's forward (and backward) on tpu, in the default eager mode."""
    model = copy.deepcopy(model).to("tpu").eval()
    args = tree_map(_to_tpu, inputs)

    def train_step():
        model.zero_grad(set_to_none=True)
        _step(model, args, backward)

    with _fallbacks_allowed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return diagnose.step(train_step, profile=profile)
