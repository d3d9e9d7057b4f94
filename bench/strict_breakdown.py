"""What a Strict Llama training step does to the device, counted on the host (no chip needed).

    python bench/strict_breakdown.py [--layers 1] [--batch 2] [--seq 32] [--small] [--json F]
    TORCHTPU_TPU_TARGET=v5e:2x2 python bench/strict_breakdown.py --layers 1 --batch 1 --seq 1024

``torchtpu.testing.llama``'s step (autocast bf16, backward, clipping, AdamW) after two warm-up
steps, one step under ``testing/step_census.py``: launches, distinct programs, host waits,
numbers crossing per launch, bytes moved each way, view copies, and every product's operand
dtypes and precision. With a TPU target (``runtime/tpu_target.py``; the venv needs libtpu) one
more step runs under the JAX profiler and each program's run is costed by the TPU compiler's
cost model: the step's device seconds on that chip, and the programs that take them. ``--small``
shrinks the model's width and vocabulary (tiny programs, for the counts); the layer count, batch
and sequence scale the rest.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

import torchtpu
from torchtpu.runtime import tpu_hook, tpu_target
from torchtpu.testing.llama import Llama, LlamaConfig, train_step
from torchtpu.testing.step_census import census


def _device_seconds(step) -> dict:
    """The step's programs costed by the target's compiler, summed over their runs."""
    from torchtpu.tools import aot

    runs, _ = aot._profiled(step)
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


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/strict_breakdown.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--small", action="store_true", help="width 64, vocab 256, 2 heads")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dims = dict(vocab=256, dim=64, heads=2, hidden=128) if args.small else {}
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
    if tpu_hook.active():
        out["tpu"] = _device_seconds(lambda: step(x, y))
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return out


if __name__ == "__main__":
    main()
