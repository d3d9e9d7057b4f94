"""Sharded TinyGPT training on 2 processes: eager FSDP2, compiled FSDP2, compiled simple_fsdp,
against the unsharded compiled step at the same per-rank batch, ms/step in interleaved rounds.

Two processes on localhost with the XLA transport (``TORCHTPU_DIST_TRANSPORT=xla``). Each
builds every variant first, from the same initial weights:

- ``fsdp2 eager``: ``fully_shard`` on each block and the root, eager steps;
- ``fsdp2 compiled``: each block compiled (``torch.compile(backend="tpu")``), then sharded, as
  TorchTitan does; torch 2.13 hides FSDP2's hooks from Dynamo (compiling the root compiles
  nothing), so FSDP2's all-gathers and reduce-scatters run eagerly between the blocks' programs,
  and the embeddings, final norm and loss run eagerly;
- ``simple_fsdp compiled``: ``torchtpu.distributed.simple_fsdp`` (the sharding in the
  parameters): the compiled forward and backward are one SPMD program each, the collectives
  inside;
- ``unsharded compiled``: the plain model compiled on each rank with no communication (the
  per-rank cost the sharded steps are set against);
- ``... whole step``: ``torch.compile(train_step, backend="tpu")`` of the whole step, AdamW
  included: one captured program per call; ``simple_fsdp whole step (local collectives)`` is
  that program with each collective replaced by local work on the same bytes (what the
  collectives cost, so whether XLA overlaps them: their compiled schedule is printed too).
  With simple_fsdp or FSDP2 the capture records the XLA transport's collectives too
  (``distributed/xla.py``), so it is one SPMD program per rank (``eager/spanning.py``): the
  all-gathers, reduce-scatters and all-reduces inside it with the
  forward, backward and AdamW on the shards. ``fsdp2 whole step`` is ``fully_shard`` (eager
  blocks), ``fsdp2 compiled whole step`` the same over compiled blocks (TorchTitan's order,
  their graphs recorded into the capture).

A step is forward, backward, AdamW (eager in the non-whole-step variants) and a host read of
the loss. After ``--warmup`` steps each, the variants run ``--steps`` steps in turn for ``--rounds``
rounds, each round in another order, so load from other processes falls on all alike; the table
gives each variant's median ms/step over rounds (rank 0) and its ratio to ``fsdp2 eager`` and to
``unsharded compiled``, plus its programs launched and eager collectives per step.

    python bench/sharded.py [--rounds 5] [--steps 5] [--batch 8] [--layers 2] [--embd 64]
                            [--only "simple_fsdp whole step,unsharded whole step"]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from torchtpu.distributed.spawn import run

VOCAB, BLOCK = 128, 64
# The sharded whole step's program with each collective replaced by local work on the same
# bytes (``eager/spanning.LOCAL_COLLECTIVES``): the step without communication.
LOCAL = "simple_fsdp whole step (local collectives)"


def _model(args):
    from torchtpu.demo.gpt import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(VOCAB, BLOCK, n_layer=args.layers, n_head=4, n_embd=args.embd)


def _variants(args, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchtpu.distributed.simple_fsdp import simple_fsdp

    mesh = init_device_mesh("tpu", (world,))

    def fsdp2(compiled: bool):
        model = _model(args).to("tpu")
        for i, block in enumerate(model.blocks):
            # As TorchTitan does: compile each block, then shard it (its hooks stay outside).
            model.blocks[i] = fully_shard(
                torch.compile(block, backend="tpu") if compiled else block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def stepped(model, call):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            loss = call(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    def whole(model):
        return torch.compile(stepped(model, model), backend="tpu")

    makers = {"fsdp2 eager": lambda: stepped(m := fsdp2(False), m),
              "fsdp2 compiled": lambda: stepped(m := fsdp2(True), m),
              "simple_fsdp compiled": lambda: stepped(
                  m := simple_fsdp(_model(args).to("tpu"), mesh), torch.compile(m, backend="tpu")),
              "unsharded compiled": lambda: stepped(m := _model(args).to("tpu"),
                                                    torch.compile(m, backend="tpu")),
              "fsdp2 whole step": lambda: whole(fsdp2(False)),
              "fsdp2 compiled whole step": lambda: whole(fsdp2(True)),
              "simple_fsdp whole step": lambda: whole(simple_fsdp(_model(args).to("tpu"), mesh)),
              LOCAL: lambda: whole(simple_fsdp(_model(args).to("tpu"), mesh)),
              "unsharded whole step": lambda: whole(_model(args).to("tpu"))}
    only = [n.strip() for n in args.only.split(",")] if args.only else list(makers)
    unknown = [n for n in only if n not in makers]
    if unknown:
        raise ValueError(f"bench/sharded.py: --only names unknown variants {unknown}; "
                         f"known: {list(makers)}")
    return {name: makers[name]() for name in only}


def _bench(rank, world, args):
    import torch.distributed as dist

    from torchtpu.device.hooks import HOOKS
    from torchtpu.eager import spanning

    group = dist.group.WORLD
    variants = _variants(args, world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(VOCAB, (args.batch, BLOCK), generator=g).to("tpu")
    y = torch.randint(VOCAB, (args.batch, BLOCK), generator=g).to("tpu")
    launched: list = []

    def step(name):
        return variants[name](x, y).item()

    counts, schedules = {}, {}
    for name in variants:
        spanning.LOCAL_COLLECTIVES = name == LOCAL  # read when its capture finishes
        try:
            with warnings.catch_warnings():  # a refused whole step warns once
                warnings.simplefilter("ignore")
                for _ in range(args.warmup):
                    step(name)
        finally:
            spanning.LOCAL_COLLECTIVES = False
        schedules[name] = _schedule(variants[name])
        launched.clear()
        seq = group._seq
        HOOKS.launch_observer = torch._dynamo.disable(
            lambda label, fn, a: (launched.append(label), fn(*a))[1])
        step(name)
        HOOKS.launch_observer = None
        counts[name] = (len(launched), group._seq - seq)
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    return ({name: (statistics.median(ts), *counts[name]) for name, ts in times.items()},
            schedules)


def _schedule(step) -> dict | None:
    """A whole step's compiled SPMD program: its collectives as XLA scheduled them, synchronous
    (``all-reduce(``) or split into start/done pairs that compute may run between."""
    import re

    from torchtpu.eager import spanning

    kept = list(getattr(step, "_steps", {}).values())
    fn = kept[0].captured._fn if kept else None
    if not isinstance(fn, spanning.Spanning) or fn._compiled is None:
        return None
    hlo = fn._compiled.as_text()
    ops = re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all)(-start|-done)?\(",
                     hlo)
    found: dict = {}
    for op, phase in ops:
        found[op + (phase or "")] = found.get(op + (phase or ""), 0) + 1
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--only", default="", help="comma-separated variants to run (default all)")
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        print("loadavg before:", f.read().strip())
    results = run(_bench, 2, args=(args,), env={"TORCHTPU_DIST_TRANSPORT": "xla"},
                  pg_timeout=300, timeout=3000)
    with open("/proc/loadavg") as f:
        print("loadavg after:", f.read().strip())
    rows, schedules = results[0]
    nan = float("nan")
    eager, single, whole = (rows.get(name, (nan,))[0] for name in (
        "fsdp2 eager", "unsharded compiled", "unsharded whole step"))
    print(f"TinyGPT {args.layers} layers, n_embd {args.embd}, batch {args.batch} x {BLOCK} "
          f"per rank, 2 ranks, XLA transport; median of {args.rounds} rounds x {args.steps} "
          "steps (rank 0)")
    print(f"{'variant':42} {'ms/step':>9} {'eager/x':>8} {'x/unsharded':>12} "
          f"{'x/unsh. whole':>14} {'programs':>9} {'eager coll.':>12}")
    for name, (ms, programs, collectives) in rows.items():
        print(f"{name:42} {ms:9.1f} {eager / ms:8.2f} {ms / single:12.2f} {ms / whole:14.2f} "
              f"{programs:9d} {collectives:12d}")
    if LOCAL in rows and "simple_fsdp whole step" in rows:
        print(f"collectives' cost in the whole step: {rows['simple_fsdp whole step'][0]:.1f} - "
              f"{rows[LOCAL][0]:.1f} ms (the same program, local work instead)")
    for name, found in schedules.items():
        if found is not None:
            print(f"{name}: compiled program's collectives {found}")


if __name__ == "__main__":
    main()
