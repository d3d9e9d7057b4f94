"""Ragged paged attention, the kernel vLLM on TPU serves with: ``torchtpu::ragged_paged_attention``.

One step's queries of many sequences, packed (``q``: [tokens, q_heads, head_dim], sequence ``i``
owning rows ``cu_q_lens[i]:cu_q_lens[i+1]``), attend causally to their sequences' KV caches held
in pages (``kv_pages``: [pages, page_size, 2 * kv_heads, head_dim], keys and values interleaved
along the heads as vLLM's TPU backend stores them; ``page_indices[i]`` lists sequence ``i``'s
pages and ``kv_lens[i]`` its length). The last query of a sequence sits at its last KV position,
so a decode (one query) sees the whole context and a prefill the causal triangle. Only the first
``num_seqs[0]`` sequences count; rows past ``cu_q_lens[num_seqs[0]]`` are padding (zeros here,
unspecified from the TPU kernel).

Pages may hold float8 (an fp8 KV cache): ``k_scale``/``v_scale`` (per-tensor, static) scale
the keys and values read back, in float32, before they meet the queries' dtype, as JAX's kernel
does. The kernel loads four 8-bit heads from one 32-bit word, so float8 pages need their
``2 * kv_heads`` rows a multiple of 4 that tiles (4, 8, 16, 32 or a multiple of 32).

On TPU (the platform, or a TPU target's compile: ``pallas_mode.for_tpu()``) this is JAX's Pallas
kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) through Mosaic, which needs
``head_dim`` a multiple of 128 (the TPU's lanes). Elsewhere that kernel runs in neither interpret
mode (bench/RESULTS.md), so the op computes the same attention densely in XLA: each sequence's
pages gathered, then a masked softmax. Inference only: it has no backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchtpu import errors
from torchtpu.kernels import pallas_mode
from torchtpu.kernels.jax_op import define
from torchtpu.kernels.signature import from_function

_LANES = 128
# KV blocks: the kernel copies a block's pages one DMA each, descriptors built by the scalar
# core, and copies whole blocks (pages past a sequence's end read its first page again). Pages of
# 16 tokens (vLLM's default) are 8 KiB copies at Qwen2.5-0.5B's packed heads: its batch-64 decode
# ran at ~1/5 of HBM bandwidth on v5e (bench/RESULTS.md, serving11). Hence the platform's larger
# pages (integrations/vllm/paged.page_size: a max_model_len in <= 16 pages) and blocks of whole
# sequences, as JAX's tuned v5e table picks them (one block of <= 16 pages a sequence), capped at
# 1,024 tokens: past that a decode of a short context mostly copies padding
_MAX_PAGES_PER_BLOCK, _MAX_KV_TOKENS_PER_BLOCK = 16, 1024
_QUERIES_PER_BLOCK = 32
# JAX's kernel scores a sequence's KV block against the whole block of queries and keeps the
# sequence's own rows: in a decode step (one query a sequence) a block of 32 queries does 32x
# the attention arithmetic (at 256 requests x 576 tokens, ~1.1 TFLOP a step of Qwen2.5-0.5B
# for 25 GFLOP of use), the scores' softmax work likewise. Fewer queries a block cost more grid
# steps (each carries the KV prefetch on): 8, the sublane tile (1.77 against 2.44 ms a layer at
# 256 decodes on v5e, session 24; bench/paged_sweep.py sweeps it)
_DECODE_QUERIES_PER_BLOCK = 8
# Mosaic's default scoped VMEM (16 MiB) is too little for 32 query heads (Llama-3.2-1B: 17.1
# MiB); every TPU since v4 has at least 32 MiB of VMEM (v5e: 128 MiB). A KV block's two
# buffers (the next one prefetched) take at most a quarter of it
_VMEM_LIMIT = 32 << 20


def kernel_heads_problem(rows: int, itemsize: int) -> str | None:
    """Why JAX's TPU kernel cannot tile pages of ``rows`` (``2 * kv_heads``) head rows of
    ``itemsize``-byte elements, or None: it packs ``4 / itemsize`` rows into 32-bit words and
    wants whole words, in 1, 2, 4, 8 or a multiple of 8 rows of them."""
    packing = max(1, 4 // itemsize)
    words = rows // packing
    if rows % packing or not (words in (1, 2, 4, 8) or words % 8 == 0):
        return (f"{rows} head rows a token (keys and values) of {itemsize}-byte elements: "
                f"the TPU kernel packs {packing} rows a 32-bit word and needs 1, 2, 4, 8 or a "
                "multiple of 8 whole words")
    return None


def _check(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> None:
    seqs = page_indices.shape[0]
    problem = None
    if q.ndim != 3 or kv_pages.ndim != 4 or kv_pages.shape[2] % 2:
        problem = (f"q {q.shape} must be [tokens, q_heads, head_dim] and kv_pages "
                   f"{kv_pages.shape} [pages, page_size, 2 * kv_heads, head_dim]")
    elif q.shape[2] != kv_pages.shape[3] or q.shape[1] % (kv_pages.shape[2] // 2):
        problem = (f"q {q.shape} and kv_pages {kv_pages.shape} disagree: the head_dims must be "
                   "equal and q_heads a multiple of kv_heads")
    elif kv_lens.shape != (seqs,) or cu_q_lens.shape != (seqs + 1,) or num_seqs.shape != (1,):
        problem = (f"kv_lens {kv_lens.shape}, cu_q_lens {cu_q_lens.shape} and num_seqs "
                   f"{num_seqs.shape} must be ({seqs},), ({seqs + 1},) and (1,) for "
                   f"page_indices {page_indices.shape}")
    elif pallas_mode.for_tpu() and q.shape[2] % _LANES:
        problem = (f"head_dim {q.shape[2]}: JAX's TPU kernel needs a multiple of {_LANES} (the "
                   "TPU's lanes); pad the heads, or use the dense attention of "
                   "torchtpu.integrations.vllm off this kernel")
    elif pallas_mode.for_tpu():
        problem = kernel_heads_problem(kv_pages.shape[2], kv_pages.dtype.itemsize)
    if problem:
        raise ValueError(errors.message("kernel", f"torchtpu::ragged_paged_attention: {problem}"))


def _dense(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, k_scale,
           v_scale):
    """The kernel's attention in XLA: [tokens, q_heads, head_dim]."""
    tokens, q_heads, d = q.shape
    seqs, per_seq = page_indices.shape
    page_size, kv_heads = kv_pages.shape[1], kv_pages.shape[2] // 2
    kv = kv_pages[page_indices].reshape(seqs, per_seq * page_size, 2 * kv_heads, d)
    rep = q_heads // kv_heads
    # [seqs, ctx, q_heads, d]
    k = jnp.repeat(_scaled(kv[:, :, 0::2], k_scale, q.dtype), rep, axis=2)
    v = jnp.repeat(_scaled(kv[:, :, 1::2], v_scale, q.dtype), rep, axis=2)
    row = jnp.arange(tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, row, side="right") - 1, 0, seqs - 1)
    live = row < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    last = kv_lens[seq] - q_len + (row - cu_q_lens[seq])  # the KV position of this query
    s = jnp.einsum("thd,tkhd->thk", q, k[seq], preferred_element_type=jnp.float32) * sm_scale
    cols = jnp.arange(k.shape[1], dtype=jnp.int32)
    s = jnp.where((cols[None, :] <= last[:, None])[:, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("thk,tkhd->thd", p, v[seq], preferred_element_type=jnp.float32)
    return jnp.where(live[:, None, None], out, 0).astype(q.dtype)


def _scaled(x, scale, dtype):
    """Cached keys or values in ``dtype``, times their scale (in float32, as the kernel does)."""
    return x.astype(dtype) if scale is None else (x.astype(jnp.float32) * scale).astype(dtype)


def _ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array,
                            page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                            sm_scale: float = 1.0, k_scale: float | None = None,
                            v_scale: float | None = None) -> jax.Array:
    index = [a.astype(jnp.int32) for a in (kv_lens, page_indices, cu_q_lens, num_seqs)]
    _check(q, kv_pages, *index)
    if not pallas_mode.for_tpu():
        return _dense(q, kv_pages, *index, sm_scale, k_scale, v_scale)
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    with pallas_mode.kernel_defaults(q.dtype):
        return rpa.ragged_paged_attention(
            q, kv_pages, *index, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
            vmem_limit_bytes=_VMEM_LIMIT,
            **blocks(q.shape[0], *page_indices.shape, kv_pages.shape[1],
                     kv_pages.shape[2] * kv_pages.shape[3] * kv_pages.dtype.itemsize))


def blocks(tokens: int, seqs: int, pages_per_seq: int, page_size: int,
           token_bytes: int) -> dict:
    """The kernel's blocks for ``tokens`` queries over ``seqs`` sequence slots of
    ``pages_per_seq`` pages of ``page_size`` tokens (``token_bytes``: one token's keys and
    values): a whole sequence's pages a KV block, at most 16 pages and 1,024 tokens, its two
    buffers in a quarter of the VMEM limit; queries by 8 where there is at most one a slot (a
    decode step), else by 32. Given here, not JAX's tuned table's: that asks jax.devices() for
    the TPU's generation, which on a compile-only target is the host's CPU (it then refuses)."""
    queries = _DECODE_QUERIES_PER_BLOCK if tokens <= seqs else _QUERIES_PER_BLOCK
    kv_tokens = min(_MAX_KV_TOKENS_PER_BLOCK, _VMEM_LIMIT // 4 // (2 * token_bytes))
    pages = min(pages_per_seq, _MAX_PAGES_PER_BLOCK, max(1, kv_tokens // page_size))
    return dict(num_kv_pages_per_block=pages, num_queries_per_block=min(tokens, queries))


ragged_paged_attention = define("torchtpu::ragged_paged_attention", _ragged_paged_attention,
                                from_function("torchtpu::ragged_paged_attention",
                                              _ragged_paged_attention), differentiable=False)
ragged_paged_attention.__doc__ = """``ragged_paged_attention(q, kv_pages, kv_lens, page_indices,
cu_q_lens, num_seqs, sm_scale=1.0, k_scale=None, v_scale=None)``: one serving step's packed
queries against their paged KV caches, causal (see the module doc); on TPU JAX's Pallas kernel."""
