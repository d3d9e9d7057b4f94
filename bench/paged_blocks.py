"""The ragged paged-attention kernel's blocks at decode, timed on a chip: queries a block, KV
tokens a block, page size.

JAX's kernel scores each sequence's KV block against its whole block of queries (the other
sequences' rows are dropped when stored), so at one query a sequence the arithmetic grows with
the queries a block; fewer queries a block cost more grid steps. KV blocks copy whole pages past
a sequence's end (page 0), so larger blocks read more than the context. libtpu's cost model
gives the kernel no time (bench/RESULTS.md, serving2), so only a chip can say which blocks are
best. For each served model's packed heads (``integrations/vllm/paged.py``: Qwen2.5-0.5B 14
query heads over 1 combined 128-wide head, Llama-3.2-1B 32 over 4) and each batch, decode
steps of ``--context`` tokens a request through ``--layers`` layers of caches (one jitted scan,
so the launch is paid once): per configuration the median ms a layer, the KV bytes it copies (whole
blocks) and the GB/s of the bytes the context needs. The first row of each batch is the old
default (32 queries, 256 tokens), the row marked ``default`` is
``torchtpu.kernels.ragged_paged_attention.blocks``' choice. Needs only JAX (and libtpu);
``--compile-only`` compiles every configuration for a v5e target instead (torchtpu and libtpu:
checks Mosaic takes each, on any host).

    python3 bench/paged_blocks.py --json $OUT/paged_blocks.json [--budget 420]
    PYTHONPATH=$PWD /work/venvs/tpu/bin/python bench/paged_blocks.py --compile-only \
        --models qwen2-0.5b --batch 8
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
# (queries a block, KV tokens a block, page size): the old default first, then the
# queries swept, the KV block swept, larger pages (vLLM's TPU backend's page size for a
# max_model_len of 1,024 is 64)
CONFIGS = [(32, 256, 16), (16, 256, 16), (8, 256, 16), (4, 256, 16), (2, 256, 16), (1, 256, 16),
           (8, 128, 16), (8, 512, 16), (8, 256, 64), (1, 256, 64)]
DEFAULT = (8, 256, 16)  # blocks() of a decode step, vLLM's pages of 16 tokens


def _inputs(model: str, batch: int, context: int, max_len: int, page: int, layers: int,
            concrete: bool):
    """q, the layers' pages and the index arrays of a decode step (one query a sequence)."""
    q_heads, combined = MODELS[model]
    per_seq, used = max_len // page, -(-context // page)
    pages = batch * used + 1
    shapes = dict(q=((batch, q_heads, HEAD), jnp.bfloat16),
                  kv=((layers, pages, page, 2 * combined, HEAD), jnp.bfloat16),
                  lens=((batch,), jnp.int32), table=((batch, per_seq), jnp.int32),
                  cu=((batch + 1,), jnp.int32), seqs=((1,), jnp.int32))
    if not concrete:
        return {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}
    rng = np.random.default_rng(0)
    table = np.zeros((batch, per_seq), np.int32)
    table[:, :used] = 1 + rng.permutation(batch * used).reshape(batch, used)
    key = jax.random.PRNGKey(0)
    return dict(q=jax.random.normal(key, shapes["q"][0], jnp.bfloat16),
                kv=jax.random.normal(key, shapes["kv"][0], jnp.bfloat16),
                lens=jnp.full((batch,), context, jnp.int32), table=jnp.asarray(table),
                cu=jnp.arange(batch + 1, dtype=jnp.int32),
                seqs=jnp.array([batch], jnp.int32))


def _step(queries: int, tokens: int, page: int):
    """A jitted decode step through every layer's pages with these blocks."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    def step(q, kv, lens, table, cu, seqs):
        def layer(carry, pages):
            # one pass of bf16 products, as torchtpu's kernel_defaults trace it: Mosaic refuses
            # the fp32 contraction torchtpu's "highest" default would ask at most blocks
            with jax.default_matmul_precision("default"):
                out = rpa.ragged_paged_attention(
                    carry, pages, lens, table, cu, seqs, sm_scale=0.125,
                    num_kv_pages_per_block=min(table.shape[1], max(1, tokens // page)),
                    num_queries_per_block=min(carry.shape[0], queries),
                    vmem_limit_bytes=32 << 20)
            return out, None
        return jax.lax.scan(layer, q, kv)[0]

    return jax.jit(step)


def _compile_only(model: str, batch: int, args, config) -> dict:
    from torchtpu.runtime import tpu_target

    device = tpu_target.devices(1, "v5e:1x1")[0]
    structs = _inputs(model, batch, args.context, args.max_model_len, config[2], 2, False)
    placed = [jax.ShapeDtypeStruct(s.shape, s.dtype,
                                   sharding=jax.sharding.SingleDeviceSharding(device))
              for s in structs.values()]
    with jax.default_device(device), jax.enable_x64(False):
        lowered = _step(*config).lower(*placed)
    report = tpu_target.compile_lowered(lowered, name="paged_blocks", target_name="v5e:1x1")
    return {"compiles": report.compiles, "error": report.error and report.error[:200]}


def _timed(model: str, batch: int, args, config, reference) -> dict:
    inputs = _inputs(model, batch, args.context, args.max_model_len, config[2], args.layers, True)
    fn = _step(*config)
    start = time.perf_counter()
    out = fn(*inputs.values()).block_until_ready()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        fn(*inputs.values()).block_until_ready()
        times.append(time.perf_counter() - start)
    layer_s = sorted(times)[len(times) // 2] / args.layers
    row = {"compile_s": compile_s, "ms_a_layer": layer_s * 1e3}
    if reference is not None and config[2] == 16:  # the same pages: the same attention
        row["max_diff_vs_first"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference)))
    return row, out.astype(jnp.float32)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, default=576)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--budget", type=float, default=420, help="seconds: no new row after")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    began, rows = time.perf_counter(), []
    for model in args.models:
        q_heads, combined = MODELS[model]
        token_bytes = 2 * combined * HEAD * 2  # keys and values of one layer, bf16
        for batch in args.batch:
            reference = None
            for config in CONFIGS:
                if time.perf_counter() - began > args.budget:
                    break
                queries, tokens, page = config
                block = min(args.max_model_len // page, max(1, tokens // page)) * page
                read = batch * -(-args.context // block) * block * token_bytes
                row = {"model": model, "batch": batch, "queries": queries, "kv_tokens": tokens,
                       "page": page, "default": config == DEFAULT, "kv_mb_read": read / 1e6}
                try:
                    if args.compile_only:
                        row |= _compile_only(model, batch, args, config)
                    else:
                        found, out = _timed(model, batch, args, config, reference)
                        reference = out if reference is None else reference
                        row |= found
                        need = batch * args.context * token_bytes
                        row["gb_s_of_context"] = need / (row["ms_a_layer"] / 1e3) / 1e9
                except Exception as e:  # noqa: BLE001 (a configuration Mosaic refuses)
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f,
                                  indent=1)
    return rows


if __name__ == "__main__":
    main()
