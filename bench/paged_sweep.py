"""The ragged paged-attention kernel alone at decode, timed on a chip beside the HBM roofline of
the KV bytes it needs: page size, KV pages a block, queries a block.

Each decode step is one query a sequence over ``--context`` tokens (the served model's length:
context + 64 rounded up to 128, so 576 -> 640 and 1,928 -> 2,048). JAX's kernel copies a KV
block's pages one DMA each and copies whole blocks (pages past a sequence's end read its first
page again), so small pages mean many small copies and large blocks copy padding; it scores a
sequence's keys against its whole block of queries, so at decode the arithmetic grows with the
queries a block. libtpu's cost model gives the kernel no time (bench/RESULTS.md, serving2): only
a chip says which is best. For each model's packed heads (``integrations/vllm/paged.py``:
Qwen2.5-0.5B 14 query heads over 1 combined 128-wide KV head, Llama-3.2-1B 32 over 4), batch and
context, each page size (16-128) with KV blocks of 256 tokens (torchtpu's rule before serving11),
of 1,024 tokens and of the whole sequence, then the queries a block swept at pages of
``--queries-page``: the median ms a layer (a jitted loop over ``layers`` caches, repeated so a
call is milliseconds), the KV bytes needed and copied, ``x_roofline`` (ms against the needed
bytes at the chip's HBM bandwidth) and ``max_diff`` against the shape's first row (every row
reads the same logical keys and values through its own pages).

Needs only JAX and libtpu on the chip. ``--dense`` times torchtpu's XLA form of the same
attention instead (any host: checks the harness; JAX's kernel runs in neither of JAX's
interpreters on CPU); ``--compile-only`` compiles each configuration for a v5e target (torchtpu
and libtpu, any host: checks Mosaic takes it).

    python3 bench/paged_sweep.py --json $OUT/paged_sweep.json --budget 170
    PYTHONPATH=$PWD /work/venvs/tpu/bin/python bench/paged_sweep.py --compile-only \\
        --batch 64 --context 576
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

# (query heads, combined 128-wide KV heads) after paged.py's packing of 64-wide heads
MODELS = {"qwen2-0.5b": (14, 1), "llama-1b": (32, 4)}
HEAD = 128
# HBM GB/s by device kind (v5e: 819); others fall back to v5e's
HBM_GBS = {"TPU v5 lite": 819, "TPU v6 lite": 1640, "TPU v5": 2765, "TPU v4": 1200}
PAGES = (16, 32, 64, 128)
KV_TOKENS = (256, 1024, None)  # a KV block: 256 tokens, 1,024, the whole sequence (None)
QUERIES = (1, 4, 16, 32)  # swept at --queries-page; every other row takes 8 a block


def max_len(context: int) -> int:
    return -(-(context + 64) // 128) * 128


def configs(context: int, queries_page: int) -> list[tuple[int, int, int]]:
    """(queries a block, KV pages a block, page size) of one shape, in the order timed."""
    out = []
    for page in PAGES:
        per_seq = -(-max_len(context) // page)
        for tokens in KV_TOKENS:
            block = per_seq if tokens is None else min(per_seq, max(1, tokens // page))
            if (8, block, page) not in out:
                out.append((8, block, page))
    per_seq = -(-max_len(context) // queries_page)
    return out + [(q, min(per_seq, 1024 // queries_page), queries_page) for q in QUERIES]


def _logical(model: str, batch: int, context: int, layers: int):
    """q [batch, q_heads, 128] and each sequence's keys and values [layers, batch, tokens,
    2 * combined, 128] (tokens: the context rounded up to the largest page)."""
    q_heads, combined = MODELS[model]
    tokens = -(-context // max(PAGES)) * max(PAGES)
    kq, kk = jax.random.split(jax.random.PRNGKey(0))
    return (jax.random.normal(kq, (batch, q_heads, HEAD), jnp.bfloat16),
            jax.random.normal(kk, (layers, batch, tokens, 2 * combined, HEAD), jnp.bfloat16))


def _paged(kv, context: int, page: int):
    """The logical caches in shuffled pages of ``page`` tokens (page 0 unused, vLLM's null
    block) and the block table [batch, max_len / page] that reads them back."""
    layers, batch, _, rows, _ = kv.shape
    used, per_seq = -(-context // page), -(-max_len(context) // page)
    flat = kv[:, :, :used * page].reshape(layers, batch * used, page, rows, HEAD)
    order = np.random.default_rng(0).permutation(batch * used)
    pages = jnp.concatenate([jnp.zeros_like(flat[:, :1]), flat[:, order]], axis=1)
    table = np.zeros((batch, per_seq), np.int32)
    table[:, :used] = 1 + np.argsort(order).reshape(batch, used)
    return pages, jnp.asarray(table)


def _attention(dense: bool, queries: int, block: int):
    if dense:
        from torchtpu.kernels.ragged_paged_attention import _dense

        return lambda q, pages, lens, table, cu, seqs: _dense(q, pages, lens, table, cu, seqs,
                                                              0.125, None, None)
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    def kernel(q, pages, lens, table, cu, seqs):
        # one pass of bf16 products, as torchtpu's kernel_defaults trace it
        with jax.default_matmul_precision("default"):
            return rpa.ragged_paged_attention(
                q, pages, lens, table, cu, seqs, sm_scale=0.125, num_kv_pages_per_block=block,
                num_queries_per_block=min(q.shape[0], queries), vmem_limit_bytes=32 << 20)
    return kernel


def _step(attend, reps: int):
    """A jitted decode step through every layer's pages, ``reps`` times over (each layer's
    output is the next one's queries, so nothing is skipped)."""
    def step(q, kv, lens, table, cu, seqs):
        def layer(carry, pages):
            return attend(carry, pages, lens, table, cu, seqs).astype(carry.dtype), None
        return jax.lax.fori_loop(0, reps, lambda _, x: jax.lax.scan(layer, x, kv)[0], q)
    return jax.jit(step)


def _index(batch: int, context: int):
    return (jnp.full((batch,), context, jnp.int32), jnp.arange(batch + 1, dtype=jnp.int32),
            jnp.array([batch], jnp.int32))


def _compile_only(q, kv, table, lens, cu, seqs, config) -> dict:
    from torchtpu.targets import tpu_target

    device = tpu_target.devices(1, "v5e:1x1")[0]
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                                   sharding=jax.sharding.SingleDeviceSharding(device))
              for a in (q, kv, lens, table, cu, seqs)]
    with jax.default_device(device), jax.enable_x64(False):
        lowered = _step(_attention(False, config[0], config[1]), 1).lower(*placed)
    report = tpu_target.compile_lowered(lowered, name="paged_sweep", target_name="v5e:1x1")
    return {"compiles": report.compiles, "error": report.error and report.error[:200]}


def _timed(fn, inputs, runs: int) -> tuple[float, float, jax.Array]:
    start = time.perf_counter()
    out = fn(*inputs).block_until_ready()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(*inputs).block_until_ready()
        times.append(time.perf_counter() - start)
    return compile_s, sorted(times)[len(times) // 2], out


def sweep_shape(model: str, batch: int, context: int, args, gbs: float) -> list[dict]:
    """Every configuration of one (model, batch, context), as rows."""
    q_heads, combined = MODELS[model]
    token_bytes = 2 * combined * HEAD * 2  # one layer's keys and values of a token, bf16
    layers = 1 if args.compile_only else max(1, min(args.layers, int(
        args.kv_gb * 1e9 / 3 // (batch * max_len(context) * token_bytes))))
    reps = max(1, min(50, int(4e6 // (layers * batch * context))))
    q, logical = _logical(model, batch, context, layers)
    lens, cu, seqs = _index(batch, context)
    need = batch * context * token_bytes
    rows, first, paged = [], None, {}
    for queries, block, page in configs(context, args.queries_page):
        if time.perf_counter() - args.began > args.budget:
            break
        if page not in paged:
            paged = {page: _paged(logical, context, page)}  # one page size's copy at a time
        kv, table = paged[page]
        copied = batch * -(-context // (block * page)) * block * page * token_bytes
        row = {"model": model, "batch": batch, "context": context,
               "max_model_len": max_len(context), "page": page, "kv_pages_per_block": block,
               "kv_tokens_per_block": block * page, "queries": queries, "layers": layers,
               "reps": reps, "kv_mb_needed": need / 1e6, "kv_mb_copied": copied / 1e6,
               "roofline_ms": need / gbs / 1e6}
        try:
            if args.compile_only:
                row |= _compile_only(q, kv, table, lens, cu, seqs, (queries, block, page))
            else:
                fn = _step(_attention(args.dense, queries, block), reps)
                compile_s, wall, out = _timed(fn, (q, kv, lens, table, cu, seqs), args.runs)
                ms = wall / (layers * reps) * 1e3
                out = out.astype(jnp.float32)
                first = out if first is None else first
                row |= {"compile_s": compile_s, "ms_a_layer": ms,
                        "x_roofline": ms / row["roofline_ms"], "gb_s_needed": need / ms / 1e6,
                        "max_diff": float(jnp.max(jnp.abs(out - first)))}
        except Exception as e:  # noqa: BLE001 (a configuration Mosaic refuses)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2-0.5b"], choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256, 8, 1])
    ap.add_argument("--context", type=int, nargs="+", default=[576, 1928])
    ap.add_argument("--queries-page", type=int, default=64, choices=PAGES)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-gb", type=float, default=4.0, help="the caches' bytes at most")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--budget", type=float, default=170, help="seconds: no new row after")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.began = time.perf_counter()
    kind = jax.devices()[0].device_kind
    gbs = HBM_GBS.get(kind, HBM_GBS["TPU v5 lite"])
    rows = []
    for model in args.models:
        for context in args.context:
            for batch in args.batch:
                rows += sweep_shape(model, batch, context, args, gbs)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"device": kind, "hbm_gb_s": gbs, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
