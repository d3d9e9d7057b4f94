"""DeferAndFuse's Llama step as the TPU compiler sees it, split at backward's start or not.

``Recorder._split`` flushes a bounded recording at backward's first call, so a step is two
programs (the forward, then the backward with clipping and AdamW) where it was one: the device
runs the forward while the host records the rest. The cost is on the device: the forward writes
every activation backward reads, which the one program could keep in VMEM, fuse or recompute.
This compiles each mode's programs for a TPU target, compile-only (libtpu, ``/work/venvs/tpu``),
and prints those of the last (steady) step: the cost model's seconds, flops, bytes accessed and
HBM peak of each.

Nothing runs on XLA:CPU at the model's width: the recorder's programs are lowered, compiled for
the target (those of the last step) and answered with zeros of their outputs' shapes (the
step's structure does not depend on values), so a 2-block step at the chip's width costs
minutes of compile CPU only.

    /work/venvs/tpu/bin/python bench/defer_split_tpu.py --layers 2 [--target v5e:1x1]
        [--dim 1024 --vocab 32768 --heads 8 --hidden 2816 --seq 1024 --batch 8] [--steps 3]
        [--modes split,one] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import torch
from jax._src.lax.lax import _convert_element_type

import torchtpu
from torchtpu.eager import defer, fused_program
from torchtpu.targets import tpu_target
from torchtpu.testing.llama import Llama, LlamaConfig, train_step

PROGRAMS: list = []  # per launch of the last step: (step, calls, report)
_STEP = [0, 0]  # the step running, the last one (whose programs compile for the target)
_MODE = [""]


def _zeros(info) -> jax.Array:
    x = jnp.zeros(info.shape, info.dtype)
    return _convert_element_type(x, info.dtype, weak_type=True) if info.weak_type else x


def _compile_only(target: str):
    """``fused_program.keyed`` whose programs compile for target and answer zeros."""

    def keyed(nodes: tuple, outs: tuple, donate: tuple):
        jitted = jax.jit(fused_program.replay(nodes, outs), donate_argnums=donate,
                         keep_unused=True)
        seen: dict = {}

        def call(*args):
            if "out" not in seen:
                seen["lowered"] = jitted.lower(*args)
                seen["out"] = jax.tree_util.tree_leaves(seen["lowered"].out_info)
            if _STEP[0] == _STEP[1] and "report" not in seen:  # the steady step's alone
                t = time.process_time()
                seen["report"] = tpu_target.compile_lowered(
                    seen["lowered"], name=f"defer[{len(nodes)} calls]", kind="step",
                    target_name=target)
                seen["report"].compile_cpu_seconds = time.process_time() - t
            if "report" in seen:
                PROGRAMS.append((_STEP[0], len(nodes), seen["report"]))
                row = _row(*PROGRAMS[-1])
                print(_MODE[0], json.dumps({k: v for k, v in row.items() if k != "hbm"}),
                      flush=True)
            return [_zeros(i) for i in seen["out"]]
        return call
    return keyed


def _row(step: int, calls: int, r) -> dict:
    return {"step": step, "calls": calls, "compiles": r.compiles, "ms": (r.seconds or 0) * 1e3,
            "gflop": r.flops / 1e9, "gb_accessed": r.bytes_accessed / 1e9,
            "hbm_peak_gb": r.hbm_bytes / 1e9, "hbm": r.hbm,
            "compile_cpu_s": round(r.compile_cpu_seconds, 1), "error": r.error}


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/defer_split_tpu.py",
                                description=__doc__.splitlines()[0])
    for name, default in (("layers", 2), ("dim", 1024), ("vocab", 32768), ("heads", 8),
                          ("hidden", 2816), ("seq", 1024), ("batch", 8), ("steps", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--target", default="v5e:1x1")
    p.add_argument("--modes", default="split,one")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    fused_program.keyed = _compile_only(a.target)
    c = LlamaConfig(vocab=a.vocab, dim=a.dim, layers=a.layers, heads=a.heads, hidden=a.hidden,
                    seq=a.seq)
    ids = torch.randint(c.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    out: dict = {"config": vars(a), "load_before": os.getloadavg()}
    for mode in a.modes.split(","):
        torch.manual_seed(0)
        with torch.device("tpu"):
            model = Llama(c)
        step, _ = train_step(model)
        defer.RECORDER.split_min_ops = defer.SPLIT_CALLS if mode == "split" else math.inf
        PROGRAMS.clear()
        _MODE[0], _STEP[1] = mode, a.steps - 1
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            for i in range(a.steps):
                _STEP[0] = i
                step(x, y).item()
        rows = [_row(*e) for e in PROGRAMS]
        last = [r for r in rows if r["step"] == a.steps - 1]
        out[mode] = {"programs": rows, "steady_ms": sum(r["ms"] for r in last),
                     "steady_gb_accessed": sum(r["gb_accessed"] for r in last),
                     "steady_hbm_peak_gb": max(r["hbm_peak_gb"] for r in last),
                     "steady_programs": len(last)}
        print(mode, "steady", json.dumps({k: v for k, v in out[mode].items()
                                          if k != "programs"}), flush=True)
        del model, step
        defer.RECORDER.release_spares()
    defer.RECORDER.split_min_ops = defer.SPLIT_MIN_OPS
    out["load_after"] = os.getloadavg()
    print("load", out["load_before"], "->", out["load_after"], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    torchtpu.metrics  # noqa: B018  (torchtpu loaded: the device "tpu" exists)
    main()
