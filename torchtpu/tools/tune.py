"""The tuner: which eager mode, compile path, matmul precision and XLA options run a model's step
fastest, found by a bounded search.

``tune(target, trials=N, budget=S)`` times the step of ``target`` (``path/to/script.py:make``,
``make()`` returning ``(model, inputs)``) under one setting per trial, each trial in a child
process of its own (``python -m torchtpu.tune target --setting JSON``, bounded by a timeout and
killed past it), so one setting's programs, caches and memory never flatter or slow the next.
A setting has three axes:

- ``mode``: ``strict`` (one program per op), ``defer`` (DeferAndFuse), ``compile`` (the whole
  step under ``torch.compile``: one program per call), ``captured`` (``torch.tpu.graph`` of the
  step, replayed), ``buckets`` (the whole step under ``torch.compile(dynamic=True)``: sizes padded
  up to buckets, one program for many shapes);
- ``precision``: float32 matmuls at ``highest`` (exact, PyTorch's default), ``high`` or
  ``medium`` (``torch.set_float32_matmul_precision``);
- ``xla``: a set of XLA compiler options (``compiler_options.py``: optimization levels O1 / O3,
  on XLA:CPU fast math), as ``TORCH_TPU_INTERNAL_XLA_OPTIONS`` takes them.

The search is coordinate descent from the default (strict, highest, no options): each axis in
turn tries its other values on top of the best setting so far and keeps the fastest, until
``trials`` trials ran or ``budget`` seconds passed (a trial is started only with time left for
it). The step is the training step (the output's loss, ``backward()``, an AdamW step) or with
``step="forward"`` the forward alone; a trial runs it ``warmup`` times (compiles), then ``steps``
more, timed to the last result's arrival: ms per step. Host figures depend on the machine's
load (the report keeps the 1-minute load average before and after); with ``topology`` (a TPU
target, libtpu installed) each trial reports the TPU compiler's cost-model time of the step on
one chip instead (``torchtpu.aot``), which no load changes. The best setting comes with the
command that reproduces its trial and the lines that set it in a program.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._pytree import tree_map

from torchtpu.commands import ToolError, describe
from torchtpu.commands import main as tool_main
from torchtpu.tools import aot, aot_step
from torchtpu.tools.target import load

MODES = ("strict", "defer", "compile", "captured", "buckets")
PRECISIONS = ("highest", "high", "medium")
XLA_SETS = ("", "xla_optimization_level=O1", "xla_optimization_level=O3",
            "xla_cpu_enable_fast_math=true")
DEFAULT = {"mode": "strict", "precision": "highest", "xla": ""}
_AXES = (("mode", MODES), ("xla", XLA_SETS), ("precision", PRECISIONS))
_STARTUP_SECONDS = 20.0  # a child's import and first compile: a trial needs at least this


@dataclass
class Trial:
    setting: dict
    ms_per_step: float | None = None      # host time (None: failed or timed out)
    cost_model_ms: float | None = None    # with a topology: the TPU cost model's step time
    seconds: float = 0.0                  # the child's wall time, start-up and compiles included
    error: str | None = None

    @property
    def score(self) -> float | None:
        return self.cost_model_ms if self.cost_model_ms is not None else self.ms_per_step


@dataclass
class TuneReport:
    target: str
    step: str
    topology: str | None
    trials: list = field(default_factory=list)
    best: Trial | None = None
    command: str = ""
    code: list = field(default_factory=list)
    loadavg: list = field(default_factory=list)   # 1-minute load average before, after

    def to_dict(self) -> dict:
        return {"target": self.target, "step": self.step, "topology": self.topology,
                "trials": [asdict(t) for t in self.trials],
                "best": asdict(self.best) if self.best else None, "command": self.command,
                "code": self.code, "loadavg": self.loadavg}


def check_setting(setting: dict) -> dict:
    """setting (some axes given) completed from DEFAULT; ToolError for unknown axes or values."""
    if not isinstance(setting, dict):
        raise ToolError(f"a setting is a JSON object such as {json.dumps(DEFAULT)}")
    unknown = set(setting) - set(DEFAULT)
    if unknown:
        raise ToolError(f"unknown setting axes {sorted(unknown)}; the axes are "
                        f"{', '.join(DEFAULT)}")
    full = {**DEFAULT, **setting}
    if full["mode"] not in MODES:
        raise ToolError(f"mode {full['mode']!r} is not one of {', '.join(MODES)}")
    if full["precision"] not in PRECISIONS:
        raise ToolError(f"precision {full['precision']!r} is not one of {', '.join(PRECISIONS)}")
    from torchtpu.runtime import compiler_options

    try:
        compiler_options.parse(full["xla"], "xla")
    except ValueError as e:
        raise ToolError(str(e).removeprefix("torchtpu.compile: ")) from None
    return full


# ---------------------------------------------------------------------------- one trial


def _runner(mode: str, step):
    if mode == "buckets":
        return torch.compile(step, backend="tpu", dynamic=True)
    if mode == "compile":
        return torch.compile(step, backend="tpu")
    if mode == "defer":
        return aot_step.step_boundary(step)
    return step


def run_setting(model: torch.nn.Module, inputs: tuple, setting: dict, *, step: str = "train",
                steps: int = 5, warmup: int = 2, topology: str | None = None) -> Trial:
    """One trial in this process: the step under setting, timed (see the module doc)."""
    from torchtpu.runtime import compiler_options

    setting = check_setting(setting)
    trial = Trial(setting)
    options = compiler_options.parse(setting["xla"], "xla")
    torch.set_float32_matmul_precision(setting["precision"])
    mode = setting["mode"]
    with warnings.catch_warnings(), compiler_options.custom_compiler_options(options):
        warnings.simplefilter("ignore")
        if topology is not None:
            aot_mode = "compile" if mode == "buckets" else mode
            r = aot.report(model, inputs, topology=topology, step=step, mode=aot_mode)
            if r.step.seconds is None:  # a partial sum would flatter this setting
                raise ToolError(f"the TPU cost model has no time for {_untimed(r)}, so this "
                                "setting has no cost-model step time")
            if not r.step.programs_run:
                raise ToolError("the step ran no program (nothing to time)")
            trial.cost_model_ms = r.step.seconds * 1e3
            return trial
        train = step == "train"
        device_model = model.to("tpu")
        args = tree_map(lambda x: x.detach().to("tpu") if isinstance(x, torch.Tensor) else x,
                        inputs)
        optimizer = (torch.optim.AdamW(device_model.parameters(), lr=1e-3,
                                       capturable=mode == "captured") if train else None)
        one = aot_step.step_fn(device_model, args, train, optimizer)
        with aot_step.mode_context(mode):
            if mode == "captured":
                run = aot_step.runner("captured", one, warmup)
            else:
                run = _runner(mode, one)
                for _ in range(warmup):
                    run()
            torch.tpu.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                run()
            torch.tpu.synchronize()
            trial.ms_per_step = round((time.perf_counter() - start) / steps * 1e3, 3)
    return trial


def _untimed(r: aot_step.AotReport) -> str:
    """The programs of r the cost model gave no time, and why when the report knows."""
    names = sorted({p.name for p in r.programs if p.compiles and p.seconds is None})
    wide = any(p.wide_ops.get("float64") for p in r.programs if p.seconds is None)
    return (", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            + (" (they do float64 work, which the TPU emulates)" if wide else ""))


def _child(target: str, setting: dict, *, step: str, steps: int, warmup: int,
           topology: str | None, timeout: float) -> Trial:
    """The trial run by ``python -m torchtpu.tune target --setting ...`` in a child process."""
    command = _command(target, setting, step, steps, warmup, topology) + ["--json"]
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return Trial(setting, seconds=round(time.perf_counter() - start, 1),
                     error=f"timed out after {timeout:g} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode == 0:
        try:
            found = json.loads(out.strip().splitlines()[-1])
            return Trial(setting, found.get("ms_per_step"), found.get("cost_model_ms"), seconds)
        except (ValueError, IndexError, AttributeError):
            pass
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return Trial(setting, seconds=seconds,
                 error=(lines[-1] if lines else f"exit status {proc.returncode}")[:500])


def _command(target: str, setting: dict, step: str, steps: int, warmup: int,
             topology: str | None) -> list:
    command = [sys.executable, "-m", "torchtpu.tune", target, "--setting",
               json.dumps(setting, sort_keys=True), "--step", step, "--steps", str(steps),
               "--warmup", str(warmup)]
    return command + (["--topology", topology] if topology else [])


# ---------------------------------------------------------------------------- the search


def tune(target: str, *, trials: int = 8, budget: float = 600.0, step: str = "train",
         steps: int = 5, warmup: int = 2, topology: str | None = None,
         trial_timeout: float = 300.0) -> TuneReport:
    """The bounded search over settings (see the module doc); the target is loaded here first
    so that a target that fails is a ToolError before any trial starts."""
    if trials < 1:
        raise ToolError(f"--trials {trials}: at least 1")
    if budget <= 0 or trial_timeout <= 0:
        raise ToolError("--budget and the trial timeout are seconds above 0")
    if step not in aot.STEPS:
        raise ToolError(f"--step {step!r}: use {' or '.join(aot.STEPS)}")
    if steps < 1 or warmup < 1:
        raise ToolError("--steps and --warmup are at least 1")
    if topology is not None:  # a bad name or no libtpu: said once, before any trial starts
        from torchtpu.targets import tpu_target

        try:
            tpu_target.target(topology)
        except tpu_target.TargetError as e:
            raise ToolError(str(e).removeprefix("torchtpu.tpu: ")) from None
    model, inputs = load(target)
    aot._check_cpu(model, inputs, step == "train")
    report = TuneReport(target, step, topology, loadavg=[round(os.getloadavg()[0], 2)])
    deadline = time.monotonic() + budget
    best_setting, tried = dict(DEFAULT), set()

    def attempt(setting: dict) -> Trial | None:
        left = deadline - time.monotonic()
        if len(report.trials) >= trials or left < _STARTUP_SECONDS:
            return None
        tried.add(json.dumps(setting, sort_keys=True))
        trial = _child(target, setting, step=step, steps=steps, warmup=warmup,
                       topology=topology, timeout=min(trial_timeout, left))
        report.trials.append(trial)
        return trial

    first = attempt(best_setting)
    best = first if first is not None and first.score is not None else None
    for axis, values in _AXES:  # coordinate descent: each axis on top of the best so far
        for value in values:
            setting = {**best_setting, axis: value}
            if json.dumps(setting, sort_keys=True) in tried:
                continue
            trial = attempt(setting)
            if trial is None:
                break
            if trial.score is not None and (best is None or trial.score < best.score):
                best, best_setting = trial, setting
    report.loadavg.append(round(os.getloadavg()[0], 2))
    report.best = best
    if best is not None:
        report.command = shlex.join(_command(target, best.setting, step, steps, warmup,
                                             topology)).replace(sys.executable, "python", 1)
        report.code = code(best.setting)
    return report


def code(setting: dict) -> list:
    """The lines that make a program run under setting."""
    lines = []
    if setting["xla"]:
        lines.append(f"export TORCH_TPU_INTERNAL_XLA_OPTIONS={shlex.quote(setting['xla'])}")
    if setting["precision"] != "highest":
        lines.append(f"torch.set_float32_matmul_precision({setting['precision']!r})")
    mode = setting["mode"]
    if mode == "defer":
        lines.append("torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)")
    elif mode in ("compile", "buckets"):
        dynamic = ", dynamic=True" if mode == "buckets" else ""
        lines.append(f"train_step = torch.compile(train_step, backend=\"tpu\"{dynamic})")
    elif mode == "captured":
        lines.append("g = torch.tpu.TPUGraph(); with torch.tpu.graph(g): train_step()  "
                     "# then g.replay() per step")
    return lines or ["(the defaults: nothing to set)"]


def _ms(ms: float) -> str:
    return f"{ms:.3f}" if ms >= 0.1 else f"{ms:.3g}"  # a small model's cost-model time: us


def format_report(r: TuneReport) -> str:
    unit = "cost-model ms/step" if r.topology else "ms/step"
    lines = [f"tune {r.target} ({r.step} step{', ' + r.topology if r.topology else ''}): "
             f"{len(r.trials)} trials, load average {' -> '.join(map(str, r.loadavg))}",
             f"  {'#':>2}  {unit:>18}  {'wall s':>7}  setting"]
    for i, t in enumerate(r.trials, 1):
        score = _ms(t.score) if t.score is not None else "-"
        shown = " ".join(f"{k}={v or '-'}" for k, v in t.setting.items())
        lines.append(f"  {i:>2}  {score:>18}  {t.seconds:>7.1f}  {shown}"
                     + (f"  ({t.error})" if t.error else ""))
    if r.best is None:
        lines.append("no trial finished")
        return "\n".join(lines)
    lines += [f"best: {_ms(r.best.score)} {unit}  "
              + " ".join(f"{k}={v or '-'}" for k, v in r.best.setting.items()),
              f"reproduce: {r.command}", "in a program:", *(f"  {c}" for c in r.code)]
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtpu.tune",
        description="Find the eager mode, compile path, matmul precision and XLA options that "
                    "run a model's step fastest: a bounded search, one child process per trial.")
    parser.add_argument("target", help="path/to/script.py:make; make() returns (model, inputs) "
                                       "on CPU")
    parser.add_argument("--trials", type=int, default=8, help="at most this many trials")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds for all trials")
    parser.add_argument("--trial-timeout", type=float, default=300.0, help="seconds per trial")
    parser.add_argument("--step", default="train", choices=aot.STEPS)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trial")
    parser.add_argument("--warmup", type=int, default=2, help="untimed (compiling) steps first")
    parser.add_argument("--topology", default=None,
                        help="a TPU topology (v5e:2x2, ...): score by the TPU compiler's cost "
                             "model (needs libtpu) instead of host time")
    parser.add_argument("--setting", default=None,
                        help="run one trial of this setting (JSON) in this process")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    def go() -> int:
        if args.setting is not None:
            try:
                setting = json.loads(args.setting)
            except ValueError as e:
                raise ToolError(f"--setting is not JSON: {e}") from None
            model, inputs = load(args.target)
            try:
                trial = run_setting(model, inputs, setting, step=args.step, steps=args.steps,
                                    warmup=args.warmup, topology=args.topology)
            except ToolError:
                raise
            except Exception as e:
                raise ToolError(f"the step fails under {json.dumps(setting)}: "
                                f"{describe(e)}") from None
            print(json.dumps(asdict(trial)) if args.json else
                  f"{trial.score} {'cost-model ' if args.topology else ''}ms/step")
            return 0
        r = tune(args.target, trials=args.trials, budget=args.budget, step=args.step,
                 steps=args.steps, warmup=args.warmup, topology=args.topology,
                 trial_timeout=args.trial_timeout)
        print(json.dumps(r.to_dict(), indent=1) if args.json else format_report(r))
        if r.best is None:
            errors = "; ".join(sorted({t.error for t in r.trials if t.error})) or "no time left"
            raise ToolError(f"no trial of {args.target} finished: {errors}")
        return 0
    return tool_main(go)
