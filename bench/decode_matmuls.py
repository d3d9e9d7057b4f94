"""Decode-sized products on the chip beside libtpu's cost model: is a step's matmul at HBM speed?

Compile-only, libtpu's cost model gives ``[b, d] x [o, d]^T`` bfloat16 products of equal bytes
times 5x apart (``[8, 2048] x [16384, 2048]^T``: 0.455 ms, 147 GB/s; ``[8, 2048] x [32768,
2048]^T``: 0.183 ms, 733 GB/s; bench/RESULTS.md, "Serving decode steps compiled for v5e"). The
shapes are the decode steps' (Llama-3.2-1B's merged gate/up and head, Qwen2.5-0.5B's gate/up).
On a TPU this times each (median of 50 runs after a warm-up) and prints its GB/s of weight;
anywhere it runs (a CPU too: figures meaningless there). Needs only JAX.

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
            product(x, w).block_until_ready()
            times = []
            for _ in range(args.runs):
                start = time.perf_counter()
                product(x, w).block_until_ready()
                times.append(time.perf_counter() - start)
            s = sorted(times)[len(times) // 2]
            row = {"out": o, "in": d, "batch": b, "ms": s * 1e3, "weight_gb_s": 2 * o * d / s / 1e9}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
