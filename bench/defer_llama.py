"""The Llama training step in Strict, DeferAndFuse and as one compiled step, side by side, with
the programs each loads per step: DeferAndFuse's steady state at a realistic depth.

``torchtpu.testing.llama``'s model and ``train_step`` (forward under autocast to bfloat16,
backward, ``clip_grad_norm_(1.0)``, AdamW, ``zero_grad(set_to_none=True)``), every step ended by
``loss.item()``. Each mode trains its own copy of the model (same weights, same batch: modes
taking turns on one optimizer change each other's programs, a compiled step making AdamW's step
counts device tensors), so after each mode's warm-up, interleaved rounds of ``steps`` steps per
mode compare like with like; each mode's figure is its median round, in wall milliseconds and in
the process's CPU milliseconds (all its threads: XLA:CPU's compute too; on a loaded host the
steadier figure). "loads" is programs compiled or read from the persistent cache (a steady loop
loads none), "runs" programs executed, "ops" DeferAndFuse's recorded ops, all per step.

    python bench/defer_llama.py [--layers 12 --dim 64 --vocab 256 --seq 64 --batch 1]
                                [--modes strict,defer,compiled] [--json out.json]
                                [--target v5e:1x1]

``--target`` (with libtpu) also compiles every program for that TPU, compile-only, and prints
the cost model's figures of the largest programs each mode's warm-up loaded (DeferAndFuse's step
against the whole compiled step's): flops, bytes accessed, seconds, HBM peak, 64-bit ops.
    # the chip (issue 35's row): --dim 1024 --vocab 32768 --heads 8 --hidden 2816 --seq 1024
    #                            --batch 8, TORCHTPU_PLATFORM=tpu
"""

from __future__ import annotations

import argparse
import json
import os
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
    before, t, cpu = torchtpu.metrics.snapshot(), time.perf_counter(), time.process_time()
    for _ in range(steps):
        call()
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    after = torchtpu.metrics.snapshot()
    return {"ms": seconds / steps * 1e3, "cpu_ms": cpu / steps * 1e3,
            "loads": _loads(before, after) / steps,
            "runs": (after["executions"] - before["executions"]) / steps,
            "ops": (after.get("deferred_ops", 0) - before.get("deferred_ops", 0)) / steps}


def _largest(reports: list, n: int = 4) -> list:
    """The n programs of most flops, as the TPU compiler's cost model sees them."""
    top = sorted(reports, key=lambda r: -r.flops)[:n]
    return [{"name": r.name, "compiles": r.compiles, "gflop": r.flops / 1e9,
             "gb_accessed": r.bytes_accessed / 1e9, "ms": (r.seconds or 0) * 1e3,
             "hbm_peak_gb": r.hbm.get("peak", 0) / 1e9, "wide_ops": r.wide_ops} for r in top]


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/defer_llama.py", description=__doc__.splitlines()[0])
    for name, default in (("layers", 12), ("dim", 64), ("vocab", 256), ("heads", 4),
                          ("hidden", 0), ("seq", 64), ("batch", 1), ("steps", 5), ("rounds", 3),
                          ("warmup", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--modes", default="strict,defer,compiled")
    p.add_argument("--json", default=None)
    p.add_argument("--target", default=None, help="a TPU topology to compile for, e.g. v5e:1x1")
    a = p.parse_args(argv)
    if a.target:
        from torchtpu.targets import tpu_hook

        tpu_hook.install(a.target, on_error="keep")
    c = LlamaConfig(vocab=a.vocab, dim=a.dim, layers=a.layers, heads=a.heads,
                    hidden=a.hidden or 2 * a.dim, seq=a.seq)
    g = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, c.vocab, (a.batch, c.seq), generator=g).to("tpu")
                    for _ in range(2))
    calls, modes = {}, a.modes.split(",")
    for mode in modes:
        torch.manual_seed(0)
        model = Llama(c).to("tpu")
        step, _ = train_step(model)
        calls[mode] = (DEFER if mode == "defer" else STRICT,
                       torch.compile(step, backend="tpu") if mode == "compiled" else step)
    out: dict = {"config": vars(a), "params": sum(q.numel() for q in model.parameters()),
                 "load": os.getloadavg()}

    def run(mode: str, steps: int) -> dict:
        eager, fn = calls[mode]
        with torch.tpu.set_eager_mode(eager):
            return _timed(lambda: fn(ids, targets).item(), steps)

    for mode in modes:
        t = time.perf_counter()
        seen = len(tpu_hook.wait()) if a.target else 0
        out[mode] = {"warmup": [run(mode, 1) for _ in range(a.warmup)],
                     "warmup_s": time.perf_counter() - t, "rounds": []}
        print(mode, "warm-up", json.dumps(out[mode]), flush=True)
        if a.target:
            out[mode]["tpu_programs"] = _largest(tpu_hook.wait()[seen:])
            for r in out[mode]["tpu_programs"]:
                print("   ", json.dumps(r), flush=True)
    # One untimed turn first: a mode entered again after another ran loads one program of its
    # re-entry (DeferAndFuse gives back its kept buffers on leaving), once.
    for _ in range(a.rounds + 1):
        for mode in modes:
            out[mode]["rounds"].append(run(mode, a.steps))
    for mode in modes:
        rounds = out[mode]["rounds"] = out[mode]["rounds"][1:]
        out[mode]["ms_per_step"] = statistics.median(r["ms"] for r in rounds)
        out[mode]["cpu_ms_per_step"] = statistics.median(r["cpu_ms"] for r in rounds)
        out[mode]["loads_per_step"] = max(r["loads"] for r in rounds)
        out[mode]["runs_per_step"] = max(r["runs"] for r in rounds)
        print(f"{mode:9s} {out[mode]['ms_per_step']:9.1f} ms/step "
              f"({out[mode]['cpu_ms_per_step']:.1f} ms of CPU)  loads/step "
              f"{out[mode]['loads_per_step']:.2f}  runs/step {out[mode]['runs_per_step']:.1f}  "
              f"rounds {[round(r['ms'], 1) for r in rounds]}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
