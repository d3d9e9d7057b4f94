"""``python -m torchtpu.aot --world N [--tp K]``: a model's step sharded over N ranks, each rank's
programs compiled for its chip of an N-chip TPU target, collectives as TPU collectives.

The ranks are N processes on this machine with tpu_dist's XLA transport
(``TORCHTPU_DIST_TRANSPORT=xla``) and ``TORCHTPU_TPU_TARGET`` set, so every program a rank builds
is also compiled for the target (``targets/tpu_hook.py``): a program over k ranks' devices
(a compiled graph holding collectives, or an eager collective) as one SPMD program over k chips,
a rank's own programs over one. Each rank measures its step as one process does
(``aot_step.measure``); the report is per chip: the slowest rank's cost-model seconds, the largest
HBM peak, rank 0's programs, and every rank's figures.

How the ranks shard the model (the compiled forms, so that each rank builds a handful of
programs rather than one per op):

- ``--tp 1`` (the default): FSDP over the N ranks with ``simple_fsdp`` (the sharding in the
  parameters, which ``torch.compile`` traces: the compiled forward and backward are one SPMD
  program each, their all-gathers and reduce-scatters inside);
- ``--tp K``: tensor parallel over K ranks (``parallelize_module`` with the model's plan: its
  ``tp_plan`` attribute, or a Hugging Face model's ``config.base_model_tp_plan``), and FSDP2
  (``fully_shard``) over the N / K data-parallel ranks on each entry of the model's largest
  ``ModuleList`` (its layers) and on the root, as TorchTitan lays out FSDP x TP on a 2-D mesh.

Each data-parallel rank takes its share of every input's dim 0 (the batch). The losses
reported are the ranks' mean per step: the full batch's loss when the model's loss is a mean.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys

import torch
from torch import nn

from torchtpu import settings
from torchtpu.commands import ToolError
from torchtpu.distributed.spawn import run
from torchtpu.targets import tpu_hook, tpu_target
from torchtpu.tools import aot_step
from torchtpu.tools.target import load

_STYLES = ("colwise", "rowwise")


def tp_plan(model: nn.Module) -> dict:
    """The model's tensor-parallel plan, {module path: ParallelStyle}: its own ``tp_plan``, or a
    Hugging Face model's ``config.base_model_tp_plan`` under its base model's path."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan, prefix = getattr(model, "tp_plan", None), ""
    if plan is None:
        for sub in model.modules():
            hf = getattr(getattr(sub, "config", None), "base_model_tp_plan", None)
            base = getattr(sub, "base_model", None)
            if hf and isinstance(base, nn.Module):
                paths = {id(m): n for n, m in model.named_modules()}
                plan, prefix = hf, paths[id(base)]
                break
    if not plan:
        raise ToolError("--tp: the model has no tensor-parallel plan; give it a tp_plan "
                        "attribute, {module path: 'colwise' | 'rowwise' | a ParallelStyle} "
                        "(Hugging Face models bring theirs: config.base_model_tp_plan)")
    out = {}
    for path, style in plan.items():
        if isinstance(style, str):
            if style not in styles:
                raise ToolError(f"--tp: the plan's style {style!r} (for {path}) is not one of "
                                f"{', '.join(_STYLES)}")
            style = styles[style]()
        out[f"{prefix}.{path}" if prefix else path] = style
    return out


def _layers(model: nn.Module) -> nn.ModuleList | None:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    return max(lists, key=len) if lists else None


def shard(model: nn.Module, world: int, tp: int) -> tuple[int, str]:
    """model (on the tpu) sharded over the world's ranks, in place (see the module doc); this
    rank's data-parallel index and a description of the layout."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1:
        from torchtpu.distributed.simple_fsdp import simple_fsdp

        mesh = init_device_mesh("tpu", (world,))
        simple_fsdp(model, mesh)
        return mesh.get_local_rank(), f"FSDP (simple_fsdp) over {world} ranks"
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    dp = world // tp
    mesh = init_device_mesh("tpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], tp_plan(model))
    layout = f"tensor parallel over {tp} ranks (the model's plan)"
    if dp > 1:
        layers = _layers(model)
        for i, layer in enumerate(layers if layers is not None else ()):
            layers[i] = fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        layout = f"FSDP2 (fully_shard per layer) over {dp} x {layout}"
    return mesh["dp"].get_local_rank(), layout


def _share(x, dp: int, index: int):
    if not isinstance(x, torch.Tensor) or dp == 1:
        return x
    if x.dim() == 0 or x.shape[0] % dp:
        raise ToolError(f"--world: an input of shape {tuple(x.shape)} does not divide over "
                        f"{dp} data-parallel ranks along dim 0 (the batch); make the batch a "
                        f"multiple of {dp}")
    return x.chunk(dp)[index]


def _rank(rank: int, world: int, source: tuple, topology: str, step: str, mode: str, tp: int,
          warmup: int) -> dict:
    try:
        model, inputs = load(source[1]) if source[0] == "script" else source[1:]
        target = tpu_target.target(topology)
        tpu_hook.install(topology, on_error="keep")
        model = model.to("tpu")
        index, layout = shard(model, world, tp)
        args = tuple(aot_step.to_tpu(_share(x, world // tp, index)) for x in inputs)
        m = aot_step.measure(target, model, args, step == "train", mode, warmup)
    except ToolError as e:  # the parent says it in one line
        return {"error": str(e).removeprefix("torchtpu.tool: ")}
    return {"programs": m.programs, "step": m.step, "losses": m.losses, "layout": layout,
            "findings": aot_step.findings(model, m.programs, m.runs) if rank == 0 else []}


@contextlib.contextmanager
def _stdout_to_stderr():
    """The ranks' prints (Gloo's, a model's) to stderr: stdout is the report's (``--json``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def report(model: nn.Module, inputs: tuple, *, target: tpu_target.Target, step: str, mode: str,
           world: int, tp: int, warmup: int, script: str | None):
    """The sharded step's ``AotReport`` (the caller checked the names, the chips and the model
    on CPU)."""

    if tp < 1 or world % tp:
        raise ToolError(f"--tp {tp} does not divide --world {world}: the ranks form a "
                        f"(world / tp, tp) mesh")
    if mode != "compile":
        raise ToolError(f"--world {world}: mode {mode!r} is not supported across ranks; use "
                        "--mode compile (each rank's compiled step: a few SPMD programs)")
    if tp > 1:
        tp_plan(model)  # a missing plan fails here, not in every rank
    source = ("script", script) if script else ("objects", model, inputs)
    env = settings.child_env({settings.DIST_TRANSPORT: "xla", settings.TPU_TARGET: target.name,
                              settings.TPU_TARGET_ON_ERROR: "keep"})
    try:
        with _stdout_to_stderr():
            results = run(_rank, world, args=(source, target.name, step, mode, tp, warmup),
                          env=env, timeout=settings.AOT_TIMEOUT.get(),
                          pg_timeout=600)
    except Exception as e:  # noqa: BLE001 (a rank's failure, with its traceback's last line)
        lines = [x for x in str(e).strip().splitlines() if x.strip()]
        raise ToolError(f"the sharded step failed on a rank: {lines[-1] if lines else e}") \
            from None
    for r in results:
        if "error" in r:
            raise ToolError(r["error"])
    steps = [r["step"] for r in results]
    slowest = max(range(world), key=lambda i: (steps[i].seconds is not None,
                                               steps[i].seconds or 0.0))
    step_ = dataclasses.replace(
        steps[slowest], hbm_peak_bytes=max(s.hbm_peak_bytes for s in steps),
        fits=all(s.fits for s in steps),
        seconds=None if any(s.seconds is None for s in steps) else steps[slowest].seconds)
    ranks = [{"rank": i, "programs": len(r["programs"]),
              "refused": sum(not p.compiles for p in r["programs"]),
              "devices": dict(collections.Counter(p.devices for p in r["programs"])),
              "seconds": r["step"].seconds, "hbm_peak_bytes": r["step"].hbm_peak_bytes,
              "losses": r["losses"]} for i, r in enumerate(results)]
    losses = [sum(col) / world for col in zip(*(r["losses"] for r in results))]
    return aot_step.AotReport(target.name, mode, step, world, results[0]["programs"], step_,
                     results[0]["findings"], losses=losses, tp=tp,
                     layout=results[0]["layout"], ranks=ranks)
