"""torchtpu on a real TPU chip: GPT-2 small's bf16 training step timed beside its JAX twin, and
the first checks of torchtpu's paths there against CPU.

Everything else in bench/ measures XLA:CPU or the TPU compiler's cost model; this script is for
a machine where JAX sees a TPU (``TORCHTPU_PLATFORM=tpu`` makes torchtpu insist on it):

    TORCHTPU_PLATFORM=tpu python bench/on_tpu.py [--batch 8] [--layers 12] [--steps 10]
                                                 [--rounds 3] [--json out.json]

Sections, each reported on its own (one failing does not stop the others):
- ``agree``: a small TinyGPT trained 5 AdamW steps on tpu and on CPU (float32; torchtpu's
  default matmul precision is HIGHEST, so the TPU's products are float32-exact): the losses.
- ``accuracy``: float32 log, exp, tanh, sigmoid, lgamma, rsqrt, logaddexp on tpu against CPU's
  float64, largest error (relative, absolute below 1), at HIGHEST and DEFAULT precision.
- ``per_op``: one 4x4 add through Strict eager against ``jnp`` on the same chip, µs a call.
- ``gpt2``: GPT-2 small's dims (``TinyGPT``: 12 blocks, 12 heads, width 768, vocab 50304,
  1024 positions, tied head, no dropout) at ``batch`` x 1024 tokens, the whole step (forward
  under ``torch.autocast("tpu", bfloat16)``, ``backward``, ``clip_grad_norm_``, AdamW) under
  ``torch.compile(step, backend="tpu")``, which runs it as one captured program per call;
  beside it ``tpu_gpt2.py``'s JAX step (HF GPT-2's math with autocast's casts, the same AdamW
  with clipping) at the same batch; interleaved rounds of ``steps`` steps, each ended by a wait
  for its last loss. MFU = model flops / (seconds x the chip's bf16 peak), with nanoGPT's count
  of model flops (6 N + 12 L d T per token, N the parameters less the position table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import torch

import torchtpu  # noqa: F401
from torchtpu.demo.gpt import TinyGPT
from torchtpu.runtime import platform

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile import bench_module  # noqa: E402  (bench/ is no package)

# bf16 matmul peak per chip (the vendor's figures), by JAX's device_kind.
PEAKS = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v6 lite": 918e12, "TPU v5p": 459e12,
         "TPU v4": 275e12}
VOCAB, SEQ, WIDTH, HEADS = 50304, 1024, 768, 12


def model_flops(params: int, layers: int, tokens: int, seq: int = SEQ) -> float:
    """nanoGPT's estimate of a training step's flops: 6N per token plus attention's 12 L d T."""
    return tokens * (6 * params + 12 * layers * WIDTH * seq)


def agree() -> dict:
    """Five float32 TinyGPT steps on tpu and on CPU from the same weights and batches."""
    data = torch.randint(96, (4096,), generator=torch.Generator().manual_seed(0))
    out = {}
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        model = TinyGPT(96, 64, n_layer=2, n_head=4, n_embd=64).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(5):
            starts = torch.randint(len(data) - 65, (8,), generator=gen).tolist()
            x = torch.stack([data[s:s + 64] for s in starts]).to(device)
            y = torch.stack([data[s + 1:s + 65] for s in starts]).to(device)
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
        out[device] = losses
    out["max_abs_diff"] = max(abs(a - b) for a, b in zip(out["cpu"], out["tpu"]))
    return out


def accuracy() -> dict:
    """Largest error (relative; absolute where |value| < 1) of float32 transcendentals on tpu
    against CPU's float64, under HIGHEST precision (accurate forms asked of XLA,
    ``runtime/tpu_accuracy.py``) and DEFAULT."""
    x = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 8 + 0.01
    ops = {"log": torch.log, "exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
           "lgamma": torch.lgamma, "rsqrt": torch.rsqrt,
           "logaddexp": lambda t: torch.logaddexp(t, t.flip(0))}
    out = {}
    for mode in ("HIGHEST", "DEFAULT"):
        with torch.tpu.precision(getattr(torch.tpu.Precision, mode)):
            for name, fn in ops.items():
                ref = fn(x.double())
                got = fn(x.to("tpu")).cpu().double()
                # relative, but absolute near zero (lgamma's roots at 1 and 2)
                out[f"{name} {mode}"] = ((got - ref).abs() / ref.abs().clamp_min(1)).max().item()
    return out


def per_op(calls: int = 300, rounds: int = 7) -> dict:
    x = torch.randn(4, 4, device="tpu")
    jx = jnp.ones((4, 4), jnp.float32)
    (x + x).cpu()
    (jx + jx).block_until_ready()
    tpu, ref = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            y = x + x
        torch.tpu.synchronize()
        tpu.append((time.perf_counter() - t) / calls)
        t = time.perf_counter()
        for _ in range(calls):
            jy = jx + jx
        jy.block_until_ready()
        ref.append((time.perf_counter() - t) / calls)
    del y
    a, b = statistics.median(tpu), statistics.median(ref)
    return {"strict_add_us": a * 1e6, "jnp_add_us": b * 1e6, "ratio": a / b}


def torch_gpt2(batch: int, layers: int):
    """(step, x, y, parameters counted for flops) of torchtpu's compiled GPT-2 step."""
    torch.manual_seed(0)
    with torch.device("tpu"):
        model = TinyGPT(VOCAB, SEQ, n_layer=layers, n_head=HEADS, n_embd=WIDTH)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)

    def step(x, y):
        with torch.autocast("tpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (batch, SEQ + 1), generator=gen)
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    n = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()
    return torch.compile(step, backend="tpu"), x, y, n


def jax_gpt2(batch: int, layers: int):
    """(run, parameters counted for flops, its compiled program) of the JAX twin."""
    g = bench_module("tpu_gpt2")
    jm = bench_module("jax_models")
    step = jax.jit(jm.train_step(g.loss, 6e-4, (0.9, 0.999), 1e-8, 0.1, 1.0),
                   donate_argnums=(0, 1, 2))
    shapes = g.shapes(layers)
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    params = jax.tree.map(lambda s: 0.02 * jax.random.normal(next(keys), s, jnp.float32),
                          shapes, is_leaf=lambda s: isinstance(s, tuple))
    state = [params, jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params),
             jnp.zeros((), jnp.float32)]
    ids = jax.random.randint(jax.random.key(1), (batch, SEQ + 1), 0, g.VOCAB)
    x, y = ids[:, :-1], ids[:, 1:]
    compiled = step.lower(*state, x, y).compile()

    def run():
        state[:4] = list(compiled(*state, x, y))[:4]
        return state
    n = sum(int(np.prod(s)) for s in jax.tree.leaves(
        shapes, is_leaf=lambda s: isinstance(s, tuple))) - g.POSITIONS * g.WIDTH
    return run, n, compiled


def gpt2(batch: int, layers: int, steps: int, rounds: int) -> dict:
    kind = jax.devices()[0].device_kind
    peak = PEAKS.get(kind)
    t = time.perf_counter()
    tstep, x, y, tn = torch_gpt2(batch, layers)
    first = [tstep(x, y).item() for _ in range(3)]  # captured at the first two calls
    torch_warm = time.perf_counter() - t
    t = time.perf_counter()
    jrun, jn, compiled = jax_gpt2(batch, layers)
    jax.block_until_ready(jrun())
    jax_warm = time.perf_counter() - t
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    times = {"torchtpu": [], "jax": []}
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            loss = tstep(x, y)
        last = loss.item()
        times["torchtpu"].append((time.perf_counter() - t) / steps)
        t = time.perf_counter()
        for _ in range(steps):
            state = jrun()
        jax.block_until_ready(state)
        times["jax"].append((time.perf_counter() - t) / steps)
    tokens = batch * SEQ
    out = {"device_kind": kind, "peak_flops": peak, "batch": batch, "layers": layers,
           "tokens": tokens, "torch_first_losses": first, "torch_last_loss": last,
           "torch_warmup_s": torch_warm, "jax_warmup_s": jax_warm,
           "jax_cost_model": {k: float(v) for k, v in (cost or {}).items()
                              if k in ("flops", "bytes accessed", "optimal_seconds")}}
    for name, n in (("torchtpu", tn), ("jax", jn)):
        s = statistics.median(times[name])
        flops = model_flops(n, layers, tokens)
        out[name] = {"ms_per_step": s * 1e3, "rounds_ms": [r * 1e3 for r in times[name]],
                     "params": n, "model_tflop": flops / 1e12,
                     "mfu": flops / (s * peak) if peak else None}
    out["torchtpu_over_jax"] = out["torchtpu"]["ms_per_step"] / out["jax"]["ms_per_step"]
    return out


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/on_tpu.py", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sections", default="agree,accuracy,per_op,gpt2")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, torch {torch.__version__}, devices {jax.devices()}, "
          f"torchtpu platform {platform.platform()}", flush=True)
    sections = {"agree": agree, "accuracy": accuracy, "per_op": per_op,
                "gpt2": lambda: gpt2(args.batch, args.layers, args.steps, args.rounds)}
    results = {}
    for name in args.sections.split(","):
        t = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception:  # each section reports on its own; the rest still run
            results[name] = {"error": traceback.format_exc()}
        results[name]["wall_s"] = time.perf_counter() - t
        print(name, json.dumps(results[name], indent=1, default=str), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
