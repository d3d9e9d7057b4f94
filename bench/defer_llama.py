"""The Llama training step in Strict, DeferAndFuse and as one compiled step, side by side, with
the programs each loads per step: DeferAndFuse's steady state at a realistic depth.

``torchtpu.testing.llama``'s model and ``train_step`` (forward under autocast to bfloat16,
backward, ``clip_grad_norm_(1.0)``, AdamW, ``zero_grad(set_to_none=True)``), every step ended by
``loss.item()``. One model and optimizer serve every mode (the chip holds one 12-layer model's
weights and moments, not three), so modes take turns training it: after each mode's warm-up,
interleaved rounds of ``steps`` steps per mode, each mode's figure the median round. "loads" is
programs compiled or read from the persistent cache (a steady loop loads none), "runs" programs
executed, both per timed step. DeferAndFuse's warm-up also records its recording's ops a step.

    python bench/defer_llama.py [--layers 12 --dim 64 --vocab 256 --seq 64 --batch 1]
                                [--modes strict,defer,compiled] [--json out.json]
    # the chip (issue 35's row): --dim 1024 --vocab 32768 --heads 8 --hidden 2816 --seq 1024
    #                            --batch 8, TORCHTPU_PLATFORM=tpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import torchtpu
from torchtpu.testing.llama import Llama, LlamaConfig, train_step

STRICT = torch.tpu.EagerMode.DEFER_NEVER
DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE


def _loads(before: dict, after: dict) -> int:
    return sum(after[k] - before[k] for k in ("executable_compiles", "persistent_cache_hits"))


def _timed(call, steps: int) -> dict:
    before, t = torchtpu.metrics.snapshot(), time.perf_counter()
    for _ in range(steps):
        call()
    seconds, after = time.perf_counter() - t, torchtpu.metrics.snapshot()
    return {"ms": seconds / steps * 1e3, "loads": _loads(before, after) / steps,
            "runs": (after["executions"] - before["executions"]) / steps,
            "ops": (after.get("deferred_ops", 0) - before.get("deferred_ops", 0)) / steps}


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/defer_llama.py", description=__doc__.splitlines()[0])
    for name, default in (("layers", 12), ("dim", 64), ("vocab", 256), ("heads", 4),
                          ("hidden", 0), ("seq", 64), ("batch", 1), ("steps", 5), ("rounds", 3),
                          ("warmup", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--modes", default="strict,defer,compiled")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    c = LlamaConfig(vocab=a.vocab, dim=a.dim, layers=a.layers, heads=a.heads,
                    hidden=a.hidden or 2 * a.dim, seq=a.seq)
    torch.manual_seed(0)
    model = Llama(c).to("tpu")
    step, _ = train_step(model)
    compiled = torch.compile(step, backend="tpu")
    g = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, c.vocab, (a.batch, c.seq), generator=g).to("tpu")
                    for _ in range(2))
    calls = {"strict": (STRICT, step), "defer": (DEFER, step), "compiled": (STRICT, compiled)}
    modes = a.modes.split(",")
    out: dict = {"config": vars(a), "params": sum(q.numel() for q in model.parameters())}

    def run(mode: str, steps: int) -> dict:
        eager, fn = calls[mode]
        with torch.tpu.set_eager_mode(eager):
            return _timed(lambda: fn(ids, targets).item(), steps)

    for mode in modes:
        t = time.perf_counter()
        out[mode] = {"warmup": [run(mode, 1) for _ in range(a.warmup)],
                     "warmup_s": time.perf_counter() - t, "rounds": []}
        print(mode, "warm-up", json.dumps(out[mode]), flush=True)
    for _ in range(a.rounds):
        for mode in modes:
            out[mode]["rounds"].append(run(mode, a.steps))
    for mode in modes:
        rounds = out[mode]["rounds"]
        out[mode]["ms_per_step"] = statistics.median(r["ms"] for r in rounds)
        out[mode]["loads_per_step"] = max(r["loads"] for r in rounds)
        out[mode]["runs_per_step"] = max(r["runs"] for r in rounds)
        print(f"{mode:9s} {out[mode]['ms_per_step']:9.1f} ms/step  loads/step "
              f"{out[mode]['loads_per_step']:.2f}  runs/step {out[mode]['runs_per_step']:.1f}  "
              f"rounds {[round(r['ms'], 1) for r in rounds]}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
