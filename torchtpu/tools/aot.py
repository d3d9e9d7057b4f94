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
target each (``aot_sharded.py``); each rank, as one process does, runs ``aot_step.measure``.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils._pytree import tree_map

from torchtpu.commands import ToolError, describe
from torchtpu.commands import main as tool_main
from torchtpu.targets import tpu_hook, tpu_target
from torchtpu.tools import aot_sharded, render
from torchtpu.tools.aot_step import AotReport, findings, measure, to_tpu
from torchtpu.tools.target import check, load, loss_of

MODES = ("strict", "defer", "compile", "captured")
STEPS = ("forward", "train")


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
        return aot_sharded.report(cpu_model, cpu_inputs, target=target, step=step, mode=mode,
                                  world=world, tp=tp, warmup=warmup, script=script)
    tpu_hook.install(target.name, on_error="keep")
    device_model = cpu_model.to("tpu")
    m = measure(target, device_model, tree_map(to_tpu, cpu_inputs), train, mode, warmup)
    return AotReport(target.name, mode, step, world, m.programs, m.step,
                     findings(device_model, m.programs, m.runs), losses=m.losses)


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
