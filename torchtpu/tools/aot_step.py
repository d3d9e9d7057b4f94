"""One process's step compiled for a TPU target and estimated (``aot.py`` checks a model with
it, each rank of ``aot_sharded.py`` runs it): the step run on the host in a mode, the programs
it built, how often each ran (the JAX profiler), and their cost-model seconds, flops and HBM
added up per chip; also what the TPU makes of them that XLA:CPU does not show (findings).
"""

from __future__ import annotations

import collections
import contextlib
import glob
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, field

import jax
import torch

from torchtpu.commands import ToolError, describe
from torchtpu.targets import tpu_hook, tpu_target
from torchtpu.tools import lanes
from torchtpu.tools.target import loss_of

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


def step_fn(model, args, train: bool, optimizer):
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


def to_tpu(x):
    return x.detach().to("tpu") if isinstance(x, torch.Tensor) else x


def mode_context(mode: str):
    if mode in _EAGER:
        return torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, _EAGER[mode]))
    return contextlib.nullcontext()


def step_boundary(step):
    """step, then a flush of what DeferAndFuse holds (as torch_xla's ``mark_step``): each step
    is the same one program, and an output nobody reads still runs (unread, it never would)."""
    def bounded():
        out = step()
        torch.tpu.synchronize(wait=False)
        return out
    return bounded


def runner(mode: str, step, warmup: int, seen=lambda out: None):
    """The callable one step is, in mode, after its warm-up steps (``seen`` gets the output of
    each)."""
    if mode == "compile":
        step = torch.compile(step, backend="tpu")
    elif mode == "defer":
        step = step_boundary(step)
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


def profiled(run) -> tuple[collections.Counter, object]:
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
    with mode_context(mode), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run = runner(mode, step_fn(model, args, train, optimizer), warmup, seen)
            torch.tpu.reset_peak_memory_stats()
            runs, out = profiled(run)
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
