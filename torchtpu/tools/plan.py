"""The sharding planner: which layouts of a model's training step fit N chips, ranked.

``plan(model, inputs, chips=N, hbm_bytes=... | topology=...)`` measures the step's memory on the
host, in the CPU process, with no device and no process group: parameter, gradient and AdamW
state bytes (two moments per parameter), and the activations the forward saves for backward (the
unique storages ``saved_tensors_hooks`` sees). From them it prices each layout per chip:

- DDP: everything whole on every chip; one all-reduce of the gradients per step.
- FSDP2 over all N chips: parameters, gradients and optimizer state split N ways, plus the
  working set of the largest block gathered (that block and the next one prefetched, and the
  block's gradients before their reduce-scatter); two all-gathers of the parameters (forward,
  backward) and one reduce-scatter of the gradients.
- FSDP2 x TP (dp x tp = N; tp = N is TP alone): the linear layers of each block split tp ways
  (column-wise where they widen or read the residual stream, row-wise where they narrow back), the
  rest as FSDP2 over dp; activations of the residual width stay whole on each TP rank (no
  sequence parallelism), the others are split tp ways; per block, two all-reduces of the residual
  activation forward and two backward.
- HSDP (replicate r x shard s = N): FSDP2 within each group of s chips, and one all-reduce of the
  gradient shards across the r groups (what crosses slices, over DCN).

Collective bytes are what one chip sends per step with ring algorithms (an all-reduce of B bytes
over n chips sends 2B(n-1)/n, an all-gather or reduce-scatter B(n-1)/n). Layouts that fit are
ranked by those bytes, then by memory; the best one comes with its ``DeviceMesh`` /
``fully_shard`` / ``parallelize_module`` code. These are estimates from sizes, not a run: XLA's
temporaries and fragmentation come on top (``python -m torchtpu.aot`` compiles the step for a
TPU and reports its real HBM).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._pytree import tree_leaves

from torchtpu.commands import ToolError, describe
from torchtpu.commands import main as tool_main
from torchtpu.tools import render
from torchtpu.tools.target import check, load, loss_of

# names of the widening (column-wise) and narrowing (row-wise) projections of common blocks
_COLWISE = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|gate_proj|up_proj|c_attn|c_fc|query|"
                      r"key|value|w1|w3|fc1|wq|wk|wv|in_proj)$")
_ROWWISE = re.compile(r"(^|\.)(o_proj|down_proj|c_proj|out_proj|dense|w2|fc2|wo|proj)$")
MAX_TP = 8  # tensor parallelism stays within one host's chips


@dataclass
class Sizes:
    """What the step holds, in bytes, measured on the host."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int            # saved for backward, all of them
    residual_activations: int   # of those, the ones of the residual width (whole under TP)
    block_input: int            # one block's input: the activation TP all-reduces
    largest_block: int          # parameter bytes of the largest block
    tp_parameters: int          # parameter bytes of the blocks' linear layers TP splits
    blocks: int                 # repeated blocks (the ModuleList), or top-level children
    blocks_path: str
    hidden: int


@dataclass
class Layout:
    name: str
    mesh: dict                  # mesh dim name -> size
    bytes_per_chip: int
    memory: dict                # what makes up bytes_per_chip
    collective_bytes: int       # sent per chip per step
    collectives: dict           # by mesh dim
    fits: bool
    code: str = ""


@dataclass
class Plan:
    chips: int
    hbm_bytes: int
    chip: str
    sizes: Sizes
    layouts: list = field(default_factory=list)  # every layout priced, best first

    @property
    def best(self) -> Layout | None:
        return next((lay for lay in self.layouts if lay.fits), None)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["best"] = self.best.name if self.best else None
        return out


def _blocks(model: torch.nn.Module) -> tuple[str, list]:
    """The longest ModuleList of same-typed modules (a transformer's layers), else the children."""
    best = ("", list(model.children()))
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 1 \
                and len({type(m) for m in mod}) == 1 and len(mod) >= len(best[1]):
            best = (name, list(mod))
    return best


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _linears(block: torch.nn.Module, hidden: int) -> dict:
    """name -> "colwise" / "rowwise" / None for each Linear of a block."""
    plan = {}
    for name, mod in block.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if _COLWISE.search(name) or (mod.in_features == hidden and mod.out_features > hidden):
            plan[name] = "colwise"
        elif _ROWWISE.search(name) or (mod.out_features == hidden and mod.in_features > hidden):
            plan[name] = "rowwise"
        else:
            plan[name] = None
    return plan


def _split_linears(block: torch.nn.Module, hidden: int) -> list:
    """(module, "colwise" / "rowwise") for each Linear of a block that TP splits."""
    modules = dict(block.named_modules())
    return [(modules[name], style) for name, style in _linears(block, hidden).items() if style]


def measure(model: torch.nn.Module, inputs: tuple) -> Sizes:
    """Run one forward and backward on the host and size what the step holds."""
    path, blocks = _blocks(model)
    widths = Counter(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    hidden = widths.most_common(1)[0][0] if widths else 0
    saved: dict[int, tuple[int, int]] = {}  # storage address -> (bytes, last dim)
    block_input = [0]

    def pack(t: torch.Tensor):
        if t.device.type != "meta" and t.untyped_storage().nbytes():
            saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(),
                                                     t.shape[-1] if t.dim() else 0)
        return t

    def first_input(module, args):
        tensors = [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
        if tensors and not block_input[0]:
            block_input[0] = tensors[0].numel() * tensors[0].element_size()

    handle = blocks[0].register_forward_pre_hook(first_input) if blocks else None
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
        loss = loss_of(out)
        if not loss.requires_grad:
            raise ToolError("the model's output does not require grad: no parameter takes part "
                            "in it, so there is no training step to plan")
        loss.backward()
    except ToolError:
        raise
    except Exception as e:
        raise ToolError(f"the training step fails on CPU: {describe(e)}") from None
    finally:
        if handle is not None:
            handle.remove()
    params = _param_bytes(model)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    acts = {k: v for k, v in saved.items() if k not in param_ptrs}
    return Sizes(
        parameters=params, gradients=grads, optimizer=2 * grads,
        activations=sum(b for b, _ in acts.values()),
        residual_activations=sum(b for b, last in acts.values() if last == hidden),
        block_input=block_input[0], largest_block=max((_param_bytes(b) for b in blocks),
                                                       default=params),
        tp_parameters=sum(_param_bytes(mod) for b in blocks
                          for mod, _ in _split_linears(b, hidden)),
        blocks=len(blocks), blocks_path=path, hidden=hidden)


def _ring(kind: str, nbytes: float, n: int) -> int:
    if n <= 1:
        return 0
    return int((2 if kind == "all_reduce" else 1) * nbytes * (n - 1) / n)


def _tp_degrees(model: torch.nn.Module, sizes: Sizes, chips: int) -> list[int]:
    _, blocks = _blocks(model)
    if not blocks or not sizes.hidden:
        return []
    linears = _split_linears(blocks[0], sizes.hidden)
    if not linears:
        return []
    degrees = []
    for tp in range(2, min(chips, MAX_TP) + 1):
        if chips % tp:
            continue
        dims = [m.out_features if s == "colwise" else m.in_features for m, s in linears]
        if all(d % tp == 0 for d in dims):
            degrees.append(tp)
    return degrees


def _layout(name: str, mesh: dict, memory: dict, collectives: dict, hbm: int) -> Layout:
    total = sum(memory.values())
    return Layout(name=name, mesh=mesh, bytes_per_chip=int(total),
                  memory={k: int(v) for k, v in memory.items()},
                  collective_bytes=sum(collectives.values()), collectives=collectives,
                  fits=total <= hbm)


def layouts(model: torch.nn.Module, s: Sizes, chips: int, hbm: int) -> list[Layout]:
    """Every layout of the step over ``chips`` chips, priced; best first."""
    state = s.parameters + s.gradients + s.optimizer
    working = 2 * s.largest_block + s.largest_block * s.gradients // max(s.parameters, 1)
    found = [_layout("DDP", {"dp": chips},
                     {"state": state, "activations": s.activations},
                     {"dp": _ring("all_reduce", s.gradients, chips)}, hbm)]
    if chips > 1:
        fsdp = lambda n, p=s.parameters, g=s.gradients: (  # noqa: E731
            2 * _ring("all_gather", p, n) + _ring("reduce_scatter", g, n))
        found.append(_layout("FSDP2", {"dp_shard": chips},
                             {"state": state / chips, "activations": s.activations,
                              "gathered": working}, {"dp_shard": fsdp(chips)}, hbm))
        # the blocks' linear layers split over all chips, the rest (embeddings, norms, the
        # head) only over dp: whole on every TP rank
        split = s.tp_parameters * state / max(s.parameters, 1)
        for tp in _tp_degrees(model, s, chips):
            dp = chips // tp
            acts = s.residual_activations + (s.activations - s.residual_activations) / tp
            tp_bytes = 4 * s.blocks * _ring("all_reduce", s.block_input, tp)
            memory = {"state": split / chips + (state - split) / dp, "activations": acts}
            collectives = {"tp": tp_bytes}
            if dp > 1:
                memory["gathered"] = working / tp
                collectives["dp_shard"] = fsdp(dp, s.parameters / tp, s.gradients / tp)
            name = f"FSDP2 x TP ({dp}x{tp})" if dp > 1 else f"TP ({tp})"
            found.append(_layout(name, {"dp_shard": dp, "tp": tp} if dp > 1 else {"tp": tp},
                                 memory, collectives, hbm))
        for shard in range(2, chips):
            if chips % shard:
                continue
            replicate = chips // shard
            found.append(_layout(
                f"HSDP ({replicate}x{shard})", {"dp_replicate": replicate, "dp_shard": shard},
                {"state": state / shard, "activations": s.activations, "gathered": working},
                {"dp_shard": fsdp(shard),
                 "dp_replicate": _ring("all_reduce", s.gradients / shard, replicate)}, hbm))
    found.sort(key=lambda lay: (not lay.fits, lay.collective_bytes, lay.bytes_per_chip))
    return found


def code(model: torch.nn.Module, s: Sizes, layout: Layout) -> str:
    """The DeviceMesh / fully_shard / parallelize_module lines that set ``layout`` up."""
    blocks = f"model.{s.blocks_path}" if s.blocks_path else "model.children()"
    if layout.name == "DDP":
        return ("from torch.nn.parallel import DistributedDataParallel as DDP\n"
                "model = DDP(model.to(\"tpu\"))")
    names = tuple(layout.mesh)
    shape = tuple(layout.mesh.values())
    lines = ["from torch.distributed.device_mesh import init_device_mesh"]
    if "dp_shard" in layout.mesh:
        lines.append("from torch.distributed.fsdp import fully_shard")
    if "tp" in layout.mesh:
        lines.append("from torch.distributed.tensor.parallel import ColwiseParallel, "
                     "RowwiseParallel, parallelize_module")
    lines += [f"mesh = init_device_mesh(\"tpu\", {shape}, mesh_dim_names={names})",
              "model = model.to(\"tpu\")"]
    if "tp" in layout.mesh:
        _, blocks_list = _blocks(model)
        styles = {n: st for n, st in _linears(blocks_list[0], s.hidden).items() if st}
        lines += ["tp_plan = {"] + [
            f"    \"{n}\": {'Colwise' if st == 'colwise' else 'Rowwise'}Parallel(),"
            for n, st in styles.items()] + ["}", f"for block in {blocks}:",
                                            "    parallelize_module(block, mesh[\"tp\"], tp_plan)"]
        if "dp_shard" not in layout.mesh:
            return "\n".join(lines)
    fsdp_mesh = "mesh" if "dp_replicate" in layout.mesh or len(names) == 1 \
        else "mesh[\"dp_shard\"]"
    lines += [f"for block in {blocks}:", f"    fully_shard(block, mesh={fsdp_mesh})",
              f"fully_shard(model, mesh={fsdp_mesh})"]
    return "\n".join(lines)


def plan(model: torch.nn.Module, inputs, *, chips: int | None = None,
         hbm_bytes: int | None = None, topology: str | None = None) -> Plan:
    """Measure the step of ``model(*inputs)`` and price its layouts over ``chips`` chips of
    ``hbm_bytes`` each (or of ``topology``'s chip, and by default all its chips)."""
    chip = "given"
    if topology is not None:
        # the chip's figures only: no compile, so no libtpu needed
        from torchtpu.targets import tpu_target

        try:
            name = tpu_target.check_name(topology)
        except tpu_target.TargetError as e:
            raise ToolError(str(e).removeprefix("torchtpu.tpu: ")) from None
        spec = tpu_target.CHIPS[name.split(":")[0]]
        available = math.prod(int(x) for x in name.split(":")[1].split("x"))
        chip = spec.device_kind
        hbm_bytes = hbm_bytes or spec.hbm_bytes
        chips = chips or available
        if chips > available:
            raise ToolError(f"--chips {chips} is more than {name}'s {available} chips")
    if not isinstance(chips, int) or chips < 1:
        raise ToolError(f"the chip count must be a positive int, not {chips!r}")
    if not hbm_bytes or hbm_bytes <= 0:
        raise ToolError("say how much memory a chip has: --hbm GiB or --topology NAME")
    model, inputs = check((model, inputs))
    if next(model.parameters(), None) is None:
        raise ToolError("the model has no parameters: there is nothing to shard")
    sizes = measure(model, inputs)
    result = Plan(chips=chips, hbm_bytes=int(hbm_bytes), chip=chip, sizes=sizes,
                  layouts=layouts(model, sizes, chips, int(hbm_bytes)))
    for layout in result.layouts:
        layout.code = code(model, sizes, layout)
    return result


def format_plan(p: Plan) -> str:
    s = p.sizes
    lines = [f"{p.chips} chips of {render.size(p.hbm_bytes)} ({p.chip}); the step holds "
             f"parameters {render.size(s.parameters)}, gradients {render.size(s.gradients)}, "
             f"AdamW state {render.size(s.optimizer)}, activations {render.size(s.activations)} "
             f"({s.blocks} blocks at {s.blocks_path or 'top level'})", ""]
    rows = [[lay.name, "yes" if lay.fits else "no", render.size(lay.bytes_per_chip),
             render.size(lay.collective_bytes),
             ", ".join(f"{k} {render.size(v)}" for k, v in lay.collectives.items())]
            for lay in p.layouts]
    lines += render.table(["layout", "fits", "per chip", "sent/step", "by mesh dim"], rows)
    best = p.best
    if best:
        lines += ["", f"best: {best.name}", best.code]
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtpu.plan",
        description="Rank the layouts (DDP, FSDP2, FSDP2 x TP, HSDP) of a model's training step "
                    "that fit N chips, from its measured sizes, with the code for the best one.")
    parser.add_argument("target", help="path/to/script.py:make; make() returns (model, inputs) "
                                       "on CPU, inputs being one chip's batch")
    parser.add_argument("--chips", type=int, default=None)
    parser.add_argument("--topology", default=None, help="a TPU topology (v5e:2x2, ...): its "
                                                         "chip's HBM, and its chips by default")
    parser.add_argument("--hbm", type=float, default=None, help="GiB per chip")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    def go() -> int:
        model, inputs = load(args.target)
        hbm = int(args.hbm * (1 << 30)) if args.hbm is not None else None
        p = plan(model, inputs, chips=args.chips, hbm_bytes=hbm, topology=args.topology)
        print(json.dumps(p.to_dict(), indent=1) if args.json else format_plan(p))
        if p.best is None:
            least = min(p.layouts, key=lambda lay: lay.bytes_per_chip)
            raise ToolError(f"no layout fits {p.chips} chips of {render.size(p.hbm_bytes)}: the "
                            f"smallest, {least.name}, needs {render.size(least.bytes_per_chip)} "
                            "per chip; use more chips, larger ones or a smaller batch")
        return 0
    return tool_main(go)
