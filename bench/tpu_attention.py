"""Attention on the chip for the Llama benchmark, in JAX alone (the chip machine has no torch):
which form of causal attention is fastest at issue 35's shapes, and what it gives the JAX twin's
whole step.

    python bench/tpu_attention.py [--lengths 1024,2048] [--json out.json] [--steps-only]

Sections:
- ``sweep``: forward + backward of causal attention at (batch, 8 heads, length, 128) bfloat16,
  batch 8 at 1024 and 4 at 2048 (8,192 tokens), ms per call: XLA's naive form (the twin's:
  float32 scores, float32 softmax) against JAX's Pallas splash kernel at its default blocks (128)
  and over a grid of block sizes, with and without its fused backward kernel.
- ``steps``: ``bench/tpu_llama.py``'s whole training step (one ``jax.jit``, AdamW, clipping) with
  naive attention and with the sweep's fastest splash blocks, per length: ms/step, MFU, compile
  seconds, XLA's memory analysis.

The result picks the rule for ``F.scaled_dot_product_attention`` in torchtpu's compiled programs
on a TPU (issue 35 point 5). Nothing here runs anywhere but a TPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_models  # noqa: E402  (bench/ is no package)
import tpu_llama  # noqa: E402

PEAK = 197e12  # v5e bf16
TOKENS = 8192


def timed(fn, *args, rounds: int = 5, iters: int = 10) -> float:
    """Median ms of one call over rounds of ``iters`` calls, each round waited for."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(times)


def forms(length: int) -> dict:
    """name -> attention(q, k, v) for (batch, heads, length, dim) inputs."""
    out = {"naive": tpu_llama.naive_attention, "splash default": tpu_llama.splash_attention()}
    for fused in (False, True):
        for bq, bkv in ((256, 256), (512, 512), (1024, 1024), (512, 1024), (1024, 512),
                        (256, 1024)):
            if max(bq, bkv) <= length:
                out[f"splash q{bq} kv{bkv}{' fused' if fused else ''}"] = \
                    tpu_llama.splash_attention(bq, bkv, fused)
    return out


def sweep(length: int) -> dict:
    batch = TOKENS // length
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dy = (jax.random.normal(x, (batch, 8, length, 128), jnp.bfloat16) for x in keys)
    out = {}
    for name, attend in forms(length).items():
        def fwd_bwd(q, k, v, dy, attend=attend):
            y, back = jax.vjp(attend, q, k, v)
            return y, back(dy)
        try:
            t = time.perf_counter()
            fn = jax.jit(fwd_bwd).lower(q, k, v, dy).compile()
            out[name] = {"compile_s": time.perf_counter() - t, "ms": timed(fn, q, k, v, dy)}
            ref = out.setdefault("_ref", fn(q, k, v, dy)[0]) if name == "naive" else None
            if ref is None:
                err = jnp.abs(fn(q, k, v, dy)[0].astype(jnp.float32)
                              - out["_ref"].astype(jnp.float32)).max()
                out[name]["max_abs_diff_vs_naive"] = float(err)
        except Exception as e:  # a block size the kernel refuses: say so, keep sweeping
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(length, name, out[name], flush=True)
    out.pop("_ref", None)
    return out


def step(length: int, attend, steps: int = 10, rounds: int = 3) -> dict:
    c = tpu_llama.config(seq=length)
    batch = TOKENS // length
    loss = tpu_llama.loss_fn(c, attend)
    fn = jax.jit(jax_models.train_step(loss, 3e-4, (0.9, 0.999), 1e-8, 0.1, 1.0),
                 donate_argnums=(0, 1, 2))
    params = tpu_llama.init(c, jax.random.key(0))
    state = [params, jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params),
             jnp.zeros((), jnp.float32)]
    ids = jax.random.randint(jax.random.key(1), (batch, length + 1), 0, c.vocab)
    x, y = ids[:, :-1], ids[:, 1:]
    t = time.perf_counter()
    compiled = fn.lower(*state, x, y).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    losses = []
    for _ in range(3):
        state[:4] = list(compiled(*state, x, y))[:4]
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            *state[:4], value = compiled(*state, x, y)
        losses.append(float(value))
        times.append((time.perf_counter() - t) / steps)
    n = sum(a.size for a in jax.tree.leaves(params))
    ms = statistics.median(times) * 1e3
    flops = TOKENS * (6 * n + 12 * c.layers * c.dim * length)
    return {"ms_per_step": ms, "rounds_ms": [r * 1e3 for r in times], "mfu": flops / (ms / 1e3
            * PEAK), "model_tflop": flops / 1e12, "params": n, "compile_s": compile_s,
            "losses": losses, "temp_gib": mem.temp_size_in_bytes / 2**30,
            "argument_gib": mem.argument_size_in_bytes / 2**30}


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/tpu_attention.py", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--steps-only", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    results = {}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)

    for length in (int(x) for x in args.lengths.split(",")):
        best = None
        if not args.steps_only:
            results[f"sweep {length}"] = s = sweep(length)
            save()
            timed_forms = {k: v["ms"] for k, v in s.items() if "ms" in v and k != "naive"}
            best = min(timed_forms, key=timed_forms.get) if timed_forms else None
        for name in ("naive", best):
            if name is None:
                continue
            try:
                results[f"step {length} {name}"] = r = step(length, forms(length)[name])
            except Exception as e:
                results[f"step {length} {name}"] = r = {"error": f"{type(e).__name__}: {e}"}
            print(length, name, r, flush=True)
            save()
    return results


if __name__ == "__main__":
    main()
