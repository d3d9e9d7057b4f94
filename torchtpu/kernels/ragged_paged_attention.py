"""Ragged paged attention, the kernel vLLM on TPU serves with: ``torchtpu::ragged_paged_attention``.

One step's queries of many sequences, packed (``q``: [tokens, q_heads, head_dim], sequence ``i``
owning rows ``cu_q_lens[i]:cu_q_lens[i+1]``), attend causally to their sequences' KV caches held
in pages (``kv_pages``: [pages, page_size, 2 * kv_heads, head_dim], keys and values interleaved
along the heads as vLLM's TPU backend stores them; ``page_indices[i]`` lists sequence ``i``'s
pages and ``kv_lens[i]`` its length). The last query of a sequence sits at its last KV position,
so a decode (one query) sees the whole context and a prefill the causal triangle. Only the first
``num_seqs[0]`` sequences count; rows past ``cu_q_lens[num_seqs[0]]`` are padding (zeros here,
unspecified from the TPU kernel).

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
# a KV block of ~256 tokens (JAX's tuned v5e table picks 4-16 pages of 16 tokens): pages past
# a sequence's end are still copied (page 0), so larger blocks waste bandwidth on short
# contexts, and 128 pages of 8 combined heads exceed v5e's scoped VMEM
_KV_TOKENS_PER_BLOCK, _QUERIES_PER_BLOCK = 256, 32
# JAX's kernel scores a sequence's KV block against the whole block of queries and keeps the
# sequence's own rows: in a decode step (one query a sequence) a block of 32 queries does 32x
# the attention arithmetic (at 256 requests x 576 tokens, ~1.1 TFLOP a step of Qwen2.5-0.5B
# for 25 GFLOP of use), the scores' softmax work likewise. Fewer queries a block cost more grid
# steps (each carries the KV prefetch on): 8, the sublane tile, for now (bench/paged_blocks.py
# sweeps it on a chip)
_DECODE_QUERIES_PER_BLOCK = 8
# Mosaic's default scoped VMEM (16 MiB) is too little for 32 query heads (Llama-3.2-1B: 17.1
# MiB); every TPU since v4 has at least 32 MiB of VMEM (v5e: 128 MiB)
_VMEM_LIMIT = 32 << 20


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
    if problem:
        raise ValueError(errors.message("kernel", f"torchtpu::ragged_paged_attention: {problem}"))


def _dense(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale):
    """The kernel's attention in XLA: [tokens, q_heads, head_dim]."""
    tokens, q_heads, d = q.shape
    seqs, per_seq = page_indices.shape
    page_size, kv_heads = kv_pages.shape[1], kv_pages.shape[2] // 2
    kv = kv_pages[page_indices].reshape(seqs, per_seq * page_size, 2 * kv_heads, d)
    rep = q_heads // kv_heads
    k = jnp.repeat(kv[:, :, 0::2], rep, axis=2)  # [seqs, ctx, q_heads, d]
    v = jnp.repeat(kv[:, :, 1::2], rep, axis=2)
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


def _ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array,
                            page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                            sm_scale: float = 1.0) -> jax.Array:
    index = [a.astype(jnp.int32) for a in (kv_lens, page_indices, cu_q_lens, num_seqs)]
    _check(q, kv_pages, *index)
    if not pallas_mode.for_tpu():
        return _dense(q, kv_pages, *index, sm_scale)
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    with pallas_mode.kernel_defaults(q.dtype):
        return rpa.ragged_paged_attention(
            q, kv_pages, *index, sm_scale=sm_scale, vmem_limit_bytes=_VMEM_LIMIT,
            **blocks(q.shape[0], *page_indices.shape, kv_pages.shape[1]))


def blocks(tokens: int, seqs: int, pages_per_seq: int, page_size: int) -> dict:
    """The kernel's blocks for ``tokens`` queries over ``seqs`` sequence slots: KV pages of
    ~256 tokens, and queries by 8 where there is at most one a slot (a decode step), else by
    32. Given here, not JAX's tuned table's: that asks jax.devices() for the TPU's generation,
    which on a compile-only target is the host's CPU (it then refuses)."""
    queries = _DECODE_QUERIES_PER_BLOCK if tokens <= seqs else _QUERIES_PER_BLOCK
    return dict(num_kv_pages_per_block=min(pages_per_seq,
                                           max(1, _KV_TOKENS_PER_BLOCK // page_size)),
                num_queries_per_block=min(tokens, queries))


ragged_paged_attention = define("torchtpu::ragged_paged_attention", _ragged_paged_attention,
                                from_function("torchtpu::ragged_paged_attention",
                                              _ragged_paged_attention), differentiable=False)
ragged_paged_attention.__doc__ = """``ragged_paged_attention(q, kv_pages, kv_lens, page_indices,
cu_q_lens, num_seqs, sm_scale=1.0)``: one serving step's packed queries against their paged KV
caches, causal (see the module doc); on TPU JAX's Pallas kernel."""
