"""Decode-sized products on the chip beside libtpu's cost model: is a step's matmul at HBM speed?

Compile-only, libtpu's cost model gives ``[b, d] x [o, d]^T`` bfloat16 products of equal bytes
times 5x apart (``[8, 2048] x [16384, 2048]^T``: 0.455 ms, 147 GB/s; ``[8, 2048] x [32768,
2048]^T``: 0.183 ms, 733 GB/s; bench/RESULTS.md, "Serving decode steps compiled for v5e"). The
shapes are the decode steps' (Llama-3.2-1B's merged gate/up and head, Qwen2.5-0.5B's gate/up).
On a TPU this times each (median of 50 runs after a warm-up) and prints its GB/s of weight;
anywhere it runs (a CPU too: figures meaningless there). Needs only JAX.

Then the chain (``CHAIN``): Qwen2.5-0.5B's 24 layers of products alone (merged q/k/v, o, merged
gate/up, down, then the 151,936-row head and argmax), one jitted call a decode step, at batch 1,
batch 1 padded to 8 rows (the MXU's path instead of the VPU's multiply-reduce) and batch 8.
Compiled for v5e it is what the served step and the JAX anchor compile to at batch 1 (the
cost model: 5.21 ms, 4.3x its 1.21-ms roofline; bench/RESULTS.md, serving6); on the chip it
says how much of a step's time over the roofline the products alone take.

    python3 bench/decode_matmuls.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

SHAPES = [(16384, 2048), (32768, 2048), (8192, 2048), (9728, 896), (128256, 2048)]
BATCHES = (1, 8, 64, 256)
# Qwen2.5-0.5B's products a layer, torch's (out, in): q/k/v merged, o, gate/up merged, down
CHAIN = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
CHAIN_LAYERS, CHAIN_VOCAB = 24, 151936


def _median_s(fn, *args, runs: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def chain(runs: int) -> list[dict]:
    """The 24-layer product chain's step at batch 1, 1 padded to 8, and 8, beside its
    roofline (its weights once at 819 GB/s)."""
    key = jax.random.PRNGKey(0)
    layers = [{k: jax.random.normal(key, s, jnp.bfloat16) * 0.02 for k, s in CHAIN.items()}
              for _ in range(CHAIN_LAYERS)]
    head = jax.random.normal(key, (CHAIN_VOCAB, 896), jnp.bfloat16) * 0.02
    weight_bytes = 2 * (CHAIN_LAYERS * sum(o * i for o, i in CHAIN.values()) + CHAIN_VOCAB * 896)

    @jax.jit
    def step(x, layers, head):
        for w in layers:
            qkv = x @ w["qkv"].T
            x = x + qkv[:, :896] @ w["o"].T
            gate, up = jnp.split(x @ w["gate_up"].T, 2, axis=-1)
            x = x + (jax.nn.silu(gate) * up) @ w["down"].T
        return jnp.argmax(x @ head.T, axis=-1)

    rows = []
    for name, b, pad in (("batch 1", 1, 1), ("batch 1 padded to 8", 1, 8), ("batch 8", 8, 8)):
        x = jnp.ones((pad, 896), jnp.bfloat16).at[b:].set(0)
        s = _median_s(step, x, layers, head, runs=runs)
        row = {"chain": name, "ms": s * 1e3, "roofline_ms": weight_bytes / 819e9 * 1e3,
               "over_roofline": s / (weight_bytes / 819e9)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    product = jax.jit(lambda x, w: jnp.einsum("bd,od->bo", x, w))
    rows = []
    for o, d in SHAPES:
        w = jnp.ones((o, d), jnp.bfloat16)
        for b in BATCHES:
            x = jnp.ones((b, d), jnp.bfloat16)
            s = _median_s(product, x, w, runs=args.runs)
            row = {"out": o, "in": d, "batch": b, "ms": s * 1e3, "weight_gb_s": 2 * o * d / s / 1e9}
            print(json.dumps(row), flush=True)
            rows.append(row)
    chained = chain(args.runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows, "chain": chained},
                      f, indent=1)
    return rows


if __name__ == "__main__":
    main()
