"""Before renting a TPU: does a model's step compile for one, fit in its HBM, and how fast would
the TPU compiler's cost model say it runs. It compiles and estimates; nothing runs on a TPU.

``report(model, inputs, topology=..., step="forward"|"train", mode=...)`` runs the step on the host
(as torchtpu runs it today) with the TPU target on (``targets/tpu_hook.py``): every program the
step builds is also compiled for one chip of the topology. A few steps run first (the first
compiles, the second makes the optimizer's state); one more runs under the JAX profiler, which
says which programs ran and how often. The step's estimate adds, over those runs, the cost
model's seconds and flops of each program: device seconds on one chip, flops, MFU against the
chip's peak (named in the report). The HBM peak is the host's peak of live tensors during the
step plus the largest temporaries and code of a program it runs, or the largest program's own
peak if more, against the chip's HBM. ``--step train`` takes the output as the loss (a scalar,
else its ``.loss``, else the float sum of its floating leaves), runs ``backward()``, a
``torch.optim.AdamW(lr=1e-3)`` step (``capturable=True`` when captured) and ``zero_grad()``
(``set_to_none=True``, PyTorch's default: zeroed gradients would be state of the step's program,
read and written every step, and on v5e aliasing them cost the TinyGPT step 8 MB of
temporaries).

Modes: ``strict`` (one program per op), ``defer`` (DeferAndFuse), ``compile`` (``torch.compile``
of the whole step), ``captured`` (``torch.tpu.graph`` of the step, replayed).

``world`` above 1 (``--world N [--tp K]``): the step sharded over N ranks, one chip of the
target each (``aot_sharded.py``); ``measure`` is what each rank runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, field

import jax
import torch
from torch.utils._pytree import tree_map

from torchtpu.targets import tpu_hook, tpu_target
from torchtpu.tools import lanes, render
from torchtpu.tools.target import ToolError, check, describe, load, loss_of
from torchtpu.tools.target import main as tool_main

MODES = ("strict", "defer", "compile", "captured")
STEPS = ("forward", "train")
_EAGER = {"strict": "DEFER_NEVER", "defer": "DEFER_AND_FUSE"}


@dataclass
class Step:
    """The estimate for one step on one chip of the target."""

    seconds: float | None          # the cost model's device seconds (None: some program has none)
    flops: float
    mfu: float | None              # flops / (seconds x peak_flops)
    hbm_peak_bytes: int
    hbm_capacity_bytes: int
    fits: bool
    peak_flops: float
    chip: str
    programs_run: int              # program runs in the step
    unknown_runs: int = 0          # runs of programs the target did not see (built before it)
    largest: list = field(default_factory=list)   # [{"name", "runs", "seconds", "hbm_bytes"}]


@dataclass
class Measured:
    """One process's run of the step: the programs it built (``tpu_target.Report``), how often
    each ran in the measured step (by module name), its estimate, the losses of its steps."""

    programs: list
    runs: collections.Counter
    step: Step
    losses: list


@dataclass
class AotReport:
    topology: str
    mode: str
    step_kind: str
    world: int
    programs: list                 # tpu_target.Report, one per program the step built (rank 0)
    step: Step                     # per chip (world > 1: the slowest chip, the largest HBM)
    findings: list = field(default_factory=list)  # what only a TPU shows (padding, 64-bit, ...)
    losses: list = field(default_factory=list)    # each step's loss (train; rank 0's)
    tp: int = 1
    layout: str = ""               # how the ranks shard the model (world > 1)
    ranks: list = field(default_factory=list)     # world > 1: per rank {"rank", "step", ...}

    @property
    def ok(self) -> bool:
        return self.step.fits and all(p.compiles for p in self.programs) \
            and all(r["refused"] == 0 for r in self.ranks)

    def to_dict(self) -> dict:
        return {"topology": self.topology, "mode": self.mode, "step_kind": self.step_kind,
                "world": self.world, "tp": self.tp, "layout": self.layout, "ok": self.ok,
                "programs": [p.to_json() for p in self.programs], "step": asdict(self.step),
                "losses": self.losses, "ranks": self.ranks, "findings": self.findings}


def _step_fn(model, args, train: bool, optimizer):
    def step():
        out = model(*args)
        if train:
            loss = loss_of(out)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return out, loss.detach()
        return out
    return step


def _check_cpu(model, inputs, train: bool) -> None:
    try:
        out = model(*inputs)
        if train:
            loss_of(out).backward()
    except ToolError:
        raise
    except Exception as e:
        raise ToolError(f"the model fails on CPU: {describe(e)}") from None
    model.zero_grad(set_to_none=True)


def to_tpu(x):
    return x.detach().to("tpu") if isinstance(x, torch.Tensor) else x


def _mode_context(mode: str):
    if mode in _EAGER:
        return torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, _EAGER[mode]))
    return contextlib.nullcontext()


def _step_boundary(step):
    """step, then a flush of what DeferAndFuse holds (as torch_xla's ``mark_step``): each step
    is the same one program, and an output nobody reads still runs (unread, it never would)."""
    def bounded():
        out = step()
        torch.tpu.synchronize(wait=False)
        return out
    return bounded


def _runner(mode: str, step, warmup: int, seen=lambda out: None):
    """The callable one step is, in mode, after its warm-up steps (``seen`` gets the output of
    each)."""
    if mode == "compile":
        step = torch.compile(step, backend="tpu")
    elif mode == "defer":
        step = _step_boundary(step)
    for _ in range(warmup):
        seen(step())
    torch.tpu.synchronize()
    if mode != "captured":
        return step
    graph = torch.tpu.TPUGraph()
    with torch.tpu.graph(graph):
        # Kept: a capture whose results are all dropped (a no_grad forward's output) has
        # nothing to compute, and its replay runs no program.
        out = step()
    graph.replay()
    seen(out)
    torch.tpu.synchronize()

    def replay():
        graph.replay()
        return out
    return replay


def _profiled(run) -> tuple[collections.Counter, object]:
    """How often each host program ran during run() (by module name), and its result."""
    from torchtpu.profiler import xplane

    directory = tempfile.mkdtemp(prefix="torchtpu_aot_")
    try:
        jax.profiler.start_trace(directory)
        try:
            out = run()
            torch.tpu.synchronize()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{directory}/plugins/profile/*/*.xplane.pb")
        if not files:
            raise ToolError("the JAX profiler wrote no trace of the measured step")
        runs = xplane.programs(jax.profiler.ProfileData.from_file(files[0]))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return collections.Counter(r.module for r in runs), out


def report(model: torch.nn.Module, inputs, *, topology: str | None = None,
           step: str = "forward", mode: str = "compile", world: int = 1, tp: int = 1,
           warmup: int = 2, script: str | None = None) -> AotReport:
    """Compile model's step for topology and estimate it (see the module doc); ``world`` ranks
    (``tp`` of them tensor parallel) shard it as ``aot_sharded.py`` says. ``script``
    ("path.py:make", which gave model and inputs) lets the ranks build them again."""
    if step not in STEPS:
        raise ToolError(f"unknown step {step!r}; use {' or '.join(STEPS)}")
    if mode not in MODES:
        raise ToolError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    model, inputs = check((model, inputs), "aot")
    try:
        target = tpu_target.target(topology)
    except tpu_target.TargetError as e:
        raise ToolError(str(e).removeprefix("torchtpu.tpu: ")) from None
    if not 1 <= world <= target.chips:
        raise ToolError(f"--world {world}: {target.name} has {target.chips} chips; use a "
                        "topology with at least as many chips as ranks")
    train = step == "train"
    cpu_model = model.cpu()
    cpu_inputs = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, inputs)
    _check_cpu(cpu_model, cpu_inputs, train)
    if world > 1 or tp > 1:
        from torchtpu.tools import aot_sharded

        return aot_sharded.report(cpu_model, cpu_inputs, target=target, step=step, mode=mode,
                                  world=world, tp=tp, warmup=warmup, script=script)
    tpu_hook.install(target.name, on_error="keep")
    device_model = cpu_model.to("tpu")
    m = measure(target, device_model, tree_map(to_tpu, cpu_inputs), train, mode, warmup)
    return AotReport(target.name, mode, step, world, m.programs, m.step,
                     findings(device_model, m.programs, m.runs), losses=m.losses)


def measure(target: tpu_target.Target, model: torch.nn.Module, args: tuple, train: bool,
            mode: str, warmup: int) -> Measured:
    """Run model's step on the host in mode (its programs compiled for target by the hook,
    which must be on): the programs it built, the step's estimate on one chip, and the loss
    of every step run (train; else empty)."""
    optimizer = (torch.optim.AdamW(param_groups(model), lr=1e-3,
                                   capturable=mode == "captured") if train else None)
    losses: list = []
    seen = (lambda out: losses.append(float(out[1]))) if train else (lambda out: None)
    before = {id(r) for r in tpu_hook.reports()}
    with _mode_context(mode), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run = _runner(mode, _step_fn(model, args, train, optimizer), warmup, seen)
            torch.tpu.reset_peak_memory_stats()
            runs, out = _profiled(run)
            live_peak = torch.tpu.max_memory_allocated()
            seen(out)
        except ToolError:
            raise
        except Exception as e:
            raise ToolError(f"the step fails on the host in mode {mode}: {describe(e)}") from None
    programs = [r for r in tpu_hook.wait() if id(r) not in before]
    return Measured(programs, runs, _estimate(target, programs, runs, live_peak), losses)


def param_groups(model: torch.nn.Module) -> list:
    """model's parameters as one optimizer group per device mesh they are DTensors on (plain
    tensors: one group). AdamW's foreach kernels refuse DTensors of different meshes in one
    list (FSDP x TP: the TP weights on (dp, tp), norms and embeddings on dp); per group they
    are one foreach update each, where foreach=False traced one update per parameter."""
    groups: dict = {}
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        key = None if mesh is None else (mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()))
        groups.setdefault(key, []).append(p)
    return [{"params": ps} for ps in groups.values()]


def _estimate(target, programs: list, runs: collections.Counter, live_peak: int) -> Step:
    by_module = {p.module: p for p in programs}
    seconds, flops, unknown, extra, own_peak = 0.0, 0.0, 0, 0, 0
    rows = []
    for module, count in runs.items():
        p = by_module.get(module)
        if p is None:
            unknown += count
            continue
        if p.seconds is None or seconds is None:
            seconds = None
        else:
            seconds += count * p.seconds
        flops += count * p.flops
        extra = max(extra, p.hbm.get("temporaries", 0) + p.hbm.get("code", 0))
        own_peak = max(own_peak, p.hbm_bytes)
        rows.append({"name": p.name, "module": module, "runs": count,
                     "seconds": None if p.seconds is None else count * p.seconds,
                     "hbm_bytes": p.hbm_bytes})
    rows.sort(key=lambda r: -(r["seconds"] or 0.0))
    peak = max(live_peak + extra, own_peak)
    chip = target.chip
    mfu = flops / (seconds * chip.device_peak_flops) if seconds else None
    return Step(seconds, flops, mfu, peak, chip.device_hbm_bytes,
                peak <= chip.device_hbm_bytes, chip.device_peak_flops, chip.device_kind,
                sum(runs.values()), unknown, rows[:5])


def findings(model, programs: list, runs: collections.Counter) -> list:
    """What the TPU makes of this step that XLA:CPU does not show."""
    found = []
    ran = [p for p in programs if p.module in runs]
    padded = sorted((p for p in ran if p.padding_bytes), key=lambda p: -p.padding_bytes)
    if padded:
        total = sum(p.padding_bytes for p in padded)
        names = ", ".join(f"{p.name} ({p.padding_bytes} B)" for p in padded[:3])
        found.append(f"TPU tiles (8x128 for 32-bit, 16x128 for bf16) pad arguments and "
                     f"outputs by {total} bytes over the step's programs; most: {names}")
    found += lanes.advice(model)
    for kind in ("float64", "int64"):
        wide = [p for p in ran if p.wide_ops.get(kind)]
        if wide:
            ops = sum(p.wide_ops[kind] for p in wide)
            found.append(f"{len(wide)} programs do {kind} work ({ops} ops), which TPU "
                         "emulates with 32-bit ops (slow); most: "
                         f"{', '.join(p.name for p in wide[:3])}")
    precision = str(jax.config.jax_default_matmul_precision)
    found.append(f"float32 matmuls compile at precision {precision!r}: torchtpu keeps PyTorch's "
                 "exact float32 (HIGHEST, about 6 bf16 passes on the TPU's MXU); "
                 "torch.set_float32_matmul_precision('medium') or bf16 (autocast) is one pass, "
                 "the TPU default")
    refused = [p for p in programs if not p.compiles]
    for p in refused[:5]:
        found.append(f"the TPU compiler refused {p.kind} {p.name}"
                     f"{f' (built at {p.line})' if p.line else ''}: {p.error}")
    return found


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def format_report(r: AotReport) -> str:
    s = r.step
    lines = [f"{r.step_kind} step, mode {r.mode}, compiled for {r.topology} ({s.chip}); "
             "estimates from the TPU compiler's cost model, nothing ran on a TPU"]
    rows = [[p.name, p.kind, "yes" if p.compiles else "NO", _fmt_bytes(p.hbm_bytes),
             f"{p.flops:.3g}", f"{p.bytes_accessed:.3g}",
             "-" if p.seconds is None else f"{p.seconds * 1e6:.2f}"] for p in r.programs]
    lines += render.table(["program", "kind", "compiles", "hbm", "flops", "bytes", "us"], rows,
                          width=140)
    seconds = "unknown" if s.seconds is None else f"{s.seconds * 1e3:.3f} ms"
    mfu = "-" if s.mfu is None else f"{s.mfu * 100:.1f}%"
    lines.append(f"step on one chip: {seconds}, {s.flops:.4g} flops, MFU {mfu} of "
                 f"{s.peak_flops / 1e12:.0f} TFLOP/s, {s.programs_run} program runs"
                 + (f" ({s.unknown_runs} not seen by the target)" if s.unknown_runs else ""))
    over = _fmt_bytes(s.hbm_peak_bytes - s.hbm_capacity_bytes)
    verdict = "fits" if s.fits else f"does NOT fit, over by {over}"
    lines.append(f"HBM peak {_fmt_bytes(s.hbm_peak_bytes)} of {_fmt_bytes(s.hbm_capacity_bytes)}: "
                 f"{verdict}")
    for row in s.largest:
        t = "-" if row["seconds"] is None else f"{row['seconds'] * 1e6:.2f} us"
        lines.append(f"  largest: {row['name']} x{row['runs']}: {t}, "
                     f"{_fmt_bytes(row['hbm_bytes'])}")
    if r.ranks:
        lines.append(f"{r.world} ranks, {r.layout}; per chip (the slowest rank's time, the "
                     "largest HBM peak) above; per rank:")
        for row in r.ranks:
            t = "unknown" if row["seconds"] is None else f"{row['seconds'] * 1e3:.3f} ms"
            over = ", ".join(f"{n} over {k} chips" for k, n in sorted(row["devices"].items()))
            lines.append(f"  rank {row['rank']}: {row['programs']} programs ({over}), "
                         f"{row['refused']} refused, {t}, HBM {_fmt_bytes(row['hbm_peak_bytes'])}")
    if r.losses:
        lines.append("losses: " + ", ".join(f"{x:.6f}" for x in r.losses))
    lines += [f"note: {f}" for f in r.findings]
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtpu.aot",
        description="Compile a model's step for a TPU topology with libtpu (compile-only: no "
                    "TPU needed, nothing runs on one) and report per program and per step: "
                    "whether it compiles, HBM, flops, bytes and the cost model's time.")
    parser.add_argument("target", help="path/to/script.py:make; make() returns (model, inputs) "
                                       "on CPU")
    parser.add_argument("--topology", default=None,
                        help=f"a TPU topology ({', '.join(tpu_target.KNOWN[:5])}, ...; default "
                             f"TORCHTPU_TPU_TARGET, else {tpu_target.DEFAULT})")
    parser.add_argument("--step", default="forward", choices=STEPS)
    parser.add_argument("--mode", default="compile", choices=MODES)
    parser.add_argument("--world", type=int, default=1,
                        help="ranks, one chip each (processes with the XLA transport; the model "
                             "sharded as torchtpu/tools/aot_sharded.py says)")
    parser.add_argument("--tp", type=int, default=1,
                        help="of the --world ranks, how many are tensor parallel (the rest "
                             "FSDP2 over them)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    def go() -> int:
        if args.topology is not None:
            try:
                tpu_target.check_name(args.topology)
            except tpu_target.TargetError as e:
                raise ToolError(str(e).removeprefix("torchtpu.tpu: ")) from None
        model, inputs = load(args.target)
        r = report(model, inputs, topology=args.topology, step=args.step, mode=args.mode,
                   world=args.world, tp=args.tp, script=args.target)
        print(json.dumps(r.to_dict(), indent=1) if args.json else format_report(r))
        if not r.step.fits:
            by_hbm = sorted(r.step.largest, key=lambda x: -x["hbm_bytes"])[:3]
            largest = ", ".join(f"{row['name']} ({_fmt_bytes(row['hbm_bytes'])})"
                                for row in by_hbm)
            raise ToolError(f"the step does not fit in {r.topology}'s HBM: it needs "
                            f"{_fmt_bytes(r.step.hbm_peak_bytes)} of "
                            f"{_fmt_bytes(r.step.hbm_capacity_bytes)} (over by "
                            f"{_fmt_bytes(r.step.hbm_peak_bytes - r.step.hbm_capacity_bytes)}); "
                            f"largest programs: {largest}")
        return 0 if r.ok else 1
    return tool_main(go)
