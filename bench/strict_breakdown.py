"""What a Strict Llama training step does to the device, counted on the host (no chip needed).

    python bench/strict_breakdown.py [--layers 1] [--batch 2] [--seq 32] [--small] [--json F]
        [--host-steps N]
    TORCHTPU_TPU_TARGET=v5e:2x2 python bench/strict_breakdown.py --layers 1 --batch 1 --seq 1024
    TORCHTPU_TPU_TARGET=v5e:1x1 python bench/strict_breakdown.py --layers 1 --batch 8 --seq 1024 \
        --vocab 2048 --programs DIR

``torchtpu.testing.llama``'s step (autocast bf16, backward, clipping, AdamW) after two warm-up
steps, one step under ``testing/step_census.py``: launches, distinct programs, host waits,
numbers crossing per launch, bytes moved each way, view copies, and every product's operand
dtypes and precision. With a TPU target (``targets/tpu_target.py``; the venv needs libtpu) one
more step runs under the JAX profiler and each program's run is costed by the TPU compiler's
cost model: the step's device seconds on that chip, and the programs that take them. With
``--programs DIR`` each distinct program of the census's step is compiled for the target again
on its own: its runs, the cost model's time, its ideal (its flops at the chip's peak or its
arguments and results once at HBM bandwidth, whichever is longer), the bytes the compiler says it
accesses, and its arguments, largest total time first, in ``DIR/programs.json``, and its
optimized HLO under DIR: how the byte-array products were found (at the Llama's 8 x 1024 tokens
they accessed 4.6 GB where a plain product accesses 0.1). The cost model overstates some
programs several times over (AdamW's foreach passes, products of 128 rows): compare programs of
a kind, and confirm on the chip. ``--small`` shrinks the model's width and vocabulary (tiny
programs, for the counts; ``--vocab`` the vocabulary alone); the layer count, batch and sequence
scale the rest.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import jax
import torch

import torchtpu
from torchtpu import settings
from torchtpu.targets import tpu_hook, tpu_target
from torchtpu.testing.llama import Llama, LlamaConfig, train_step
from torchtpu.testing.step_census import census


def _device_seconds(step) -> dict:
    """The step's programs costed by the target's compiler, summed over their runs."""
    from torchtpu.tools import aot_step

    runs, _ = aot_step.profiled(step)
    reports = {r.module: r for r in tpu_hook.wait()}
    by_name = collections.defaultdict(lambda: [0, 0.0])
    total, unknown = 0.0, 0
    for module, n in runs.items():
        r = reports.get(module)
        if r is None or r.seconds is None:
            unknown += n
            continue
        total += n * r.seconds
        by_name[r.name][0] += n
        by_name[r.name][1] += n * r.seconds
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    return {"target": tpu_target.target_name(), "device_ms": total * 1e3,
            "program_runs": sum(runs.values()), "uncosted_runs": unknown,
            "top": [{"program": k, "runs": n, "ms": s * 1e3} for k, (n, s) in top]}


def _programs(c, folder: str) -> list:
    """Each distinct program of census c compiled for the target on its own (see the doc)."""
    os.makedirs(folder, exist_ok=True)
    os.environ[settings.TPU_DUMP.name] = folder
    chip = tpu_target.target().chip
    rows = []
    for i, (key, (name, fn, args)) in enumerate(c.examples.items()):
        if not hasattr(fn, "lower"):
            continue
        r = tpu_target.compile_function(fn, *args, name=f"{i:03d}_{name}")
        # What it must move: its arguments and results once (as the TPU lays them out).
        moved = r.hbm.get("arguments", 0) + r.hbm.get("outputs", 0)
        ideal = max(r.flops / chip.device_peak_flops, moved / chip.hbm_bandwidth)
        runs = c.programs[key]
        rows.append({"program": f"{i:03d}_{name}", "runs": runs, "error": r.error,
                     "compiles": r.compiles,
                     "us": None if r.seconds is None else r.seconds * 1e6,
                     "ideal_us": ideal * 1e6, "bytes": r.bytes_accessed, "moved": moved,
                     "flops": r.flops,
                     "arguments": [f"{a.dtype}{list(a.shape)}" for a in
                                   jax.tree_util.tree_leaves(args) if hasattr(a, "shape")]})
    rows.sort(key=lambda row: -(row["us"] or 0) * row["runs"])
    with open(os.path.join(folder, "programs.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def _host_ms(step, n: int) -> dict:
    """Median ms of n steps, each waited for (``.item()``) before the next: the calling
    thread's CPU time (not backward's, which runs on autograd's device thread), the process's
    (both threads, and on XLA:CPU the device's work too) and the wall clock."""
    thread, process, wall = [], [], []
    for _ in range(n):
        t, p, w = time.thread_time(), time.process_time(), time.perf_counter()
        loss = step()
        thread.append(time.thread_time() - t)
        loss.item()
        process.append(time.process_time() - p)
        wall.append(time.perf_counter() - w)
    return {"host_thread_ms": statistics.median(thread) * 1e3,
            "host_process_ms": statistics.median(process) * 1e3,
            "wall_ms": statistics.median(wall) * 1e3}


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/strict_breakdown.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--small", action="store_true", help="width 64, vocab 256, 2 heads")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--host-steps", type=int, default=0, metavar="N",
                   help="also time N steps: the median host thread and process CPU ms a step")
    p.add_argument("--programs", default=None, metavar="DIR",
                   help="each program compiled for the target: costs and HLO under DIR")
    args = p.parse_args(argv)
    dims = dict(vocab=256, dim=64, heads=2, hidden=128) if args.small else {}
    if args.vocab:
        dims["vocab"] = args.vocab
    config = LlamaConfig(layers=args.layers, seq=args.seq, **dims)
    torch.manual_seed(0)
    model = Llama(config).to("tpu")
    step, _ = train_step(model)
    ids = torch.randint(config.vocab, (args.batch, config.seq + 1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    for _ in range(2):
        step(x, y).item()
    before = torchtpu.metrics.snapshot()
    with census() as c:
        step(x, y)
    torch.tpu.synchronize()
    after = torchtpu.metrics.snapshot()
    out = {"layers": args.layers, "batch": args.batch, "seq": args.seq, "small": args.small,
           **c.summary()}
    for k in ("host_to_device_bytes", "device_to_host_bytes", "number_transfers",
              "executable_compiles"):
        out[k] = after.get(k, 0) - before.get(k, 0)
    if args.host_steps:
        out.update(_host_ms(lambda: step(x, y), args.host_steps))
    if tpu_hook.active():
        out["tpu"] = _device_seconds(lambda: step(x, y))
    if args.programs:
        out["programs_top"] = _programs(c, args.programs)[:15]
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return out


if __name__ == "__main__":
    main()
