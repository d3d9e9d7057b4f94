"""The tpu attention backend's paged path: ragged paged attention over the cache's own pages.

The gathered path (``attention.py``) copies each request's context, padded to a power-of-two
bucket of blocks, out of the cache at every layer and step, and compiles a program per bucket.
On a TPU, JAX's ragged paged-attention Pallas kernel (``torchtpu::ragged_paged_attention``)
reads the pages through the block table instead, for decodes, prefills and mixed steps alike,
and needs no context bucket: a decode program is keyed by its padded requests only.

The kernel wants ``[pages, page_size, 2 * kv_heads, head_dim]`` with keys and values
interleaved by head, ``head_dim`` a multiple of the TPU's 128 lanes. A model with 64-wide heads
(Qwen2.5-0.5B, Llama-3.2-1B) packs ``f = 128 / head_size`` adjacent KV heads into one 128-wide
"combined" head: its keys are ``[k_{fj} | ... | k_{fj+f-1}]``, its values likewise, and each
query head is zero outside the slot of its own KV head, so its scores and its output's slot are
exactly its own head's (the other slots hold another head's output, dropped). A cache row (one
token slot, ``[kv_heads, 2 * head_size]`` as the gathered path lays it) then holds
``[K_0, V_0, K_1, V_1, ...]`` of the combined heads; with 128-wide heads (f = 1) that is the
gathered path's own layout. Memory is the same either way.

``TORCHTPU_VLLM_PAGED``: ``auto`` (default: the kernel on a TPU where the heads allow it),
``on`` (also off a TPU, where the op computes the same attention densely in XLA: how CPU tests
check the path), ``off`` (the gathered path).
"""

from __future__ import annotations

import os

import torch

ENV = "TORCHTPU_VLLM_PAGED"
MODES = ("auto", "on", "off")
LANES = 128


def pack_factor(head_size: int, num_kv_heads: int) -> int | None:
    """How many KV heads one combined kernel head holds (1 for 128-wide heads), or None."""
    if head_size % LANES == 0:
        return 1
    if LANES % head_size == 0 and num_kv_heads % (LANES // head_size) == 0:
        return LANES // head_size
    return None


def why_not(head_size: int, num_kv_heads: int, kv_cache_dtype: str) -> str | None:
    """Why this layer cannot use the kernel, or None."""
    f = pack_factor(head_size, num_kv_heads)
    if kv_cache_dtype.startswith("fp8"):
        return f"its KV cache is {kv_cache_dtype}"
    if f is None:
        return (f"{num_kv_heads} KV heads of size {head_size} do not fill whole {LANES}-lane "
                "heads")
    combined = num_kv_heads // f
    if not (combined in (1, 2, 4, 8) or combined % 8 == 0):
        return f"{combined} combined KV heads is not 1, 2, 4 or a multiple of 8 (its tiling)"
    return None


def enabled(head_size: int, num_kv_heads: int, kv_cache_dtype: str) -> bool:
    """Whether a layer of these heads runs the paged kernel (see the module doc)."""
    from torchtpu.runtime import platform

    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"torchtpu.config: {ENV}={mode!r} is not one of {', '.join(MODES)}")
    if mode == "off":
        return False
    problem = why_not(head_size, num_kv_heads, kv_cache_dtype)
    if mode == "on" and problem:
        raise ValueError(f"torchtpu.argument: {ENV}=on, but the paged attention kernel cannot "
                         f"serve this model: {problem}; unset {ENV} for the gathered path")
    return problem is None and (mode == "on" or platform.platform() == "tpu")


def cache_rows(key: torch.Tensor, value: torch.Tensor, f: int) -> torch.Tensor:
    """Cache rows ``[n, kv_heads, 2 * d]`` in the kernel's layout from keys and values
    ``[n, kv_heads, d]``."""
    n, heads, d = key.shape
    packed = torch.stack([key.reshape(n, heads // f, f * d), value.reshape(n, heads // f, f * d)],
                         dim=2)
    return packed.reshape(n, heads, 2 * d)


def attend(query: torch.Tensor, slots: torch.Tensor, f: int, block_size: int,
           seq_lens: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Attention of the step's packed queries [n, heads, d] through the kernel: [n, heads, d].

    ``slots`` is the layer cache, one row per token slot ([B * N, kv_heads, 2 * d]);
    ``seq_lens``/``block_table``/``query_start_loc`` the step's R requests' (padded requests
    have length 0 and come last)."""
    from torchtpu.kernels.ragged_paged_attention import ragged_paged_attention

    n, heads, d = query.shape
    kv_heads = slots.shape[1]
    combined, group = kv_heads // f, heads // kv_heads
    pages = slots.view(-1, block_size, 2 * combined, f * d)
    if f > 1:  # each query head in its KV head's slot of the combined head, zeros elsewhere
        eye = torch.eye(f, dtype=query.dtype, device=query.device).view(1, 1, f, 1, f, 1)
        query = (query.view(n, combined, f, group, 1, d) * eye).reshape(n, heads, f * d)
    reqs = seq_lens.shape[0]
    num_seqs = (seq_lens > 0).sum().to(torch.int32).reshape(1)
    out = ragged_paged_attention(query, pages, seq_lens.to(torch.int32),
                                 block_table.to(torch.int32), query_start_loc[:reqs + 1]
                                 .to(torch.int32), num_seqs, sm_scale=scale)
    if f > 1:  # each head's own slot
        out = (out.view(n, combined, f, group, f, d) * eye).sum(dim=4).reshape(n, heads, d)
    return out
