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

Pages (vLLM's KV blocks) are larger than vLLM's default 16 tokens where the kernel serves:
:func:`page_size` fits ``max_model_len`` in at most 16 pages, as vLLM's own TPU backend does
(the kernel copies one page a DMA: 16-token pages ran its batch-64 decode at ~1/5 of the v5e's
HBM bandwidth, bench/RESULTS.md, serving11). A ``--block-size`` the user gives is kept.

``TORCHTPU_VLLM_PAGED``: ``auto`` (default: the kernel on a TPU where the heads allow it),
``on`` (also off a TPU, where the op computes the same attention densely in XLA: how CPU tests
check the path), ``off`` (the gathered path). An fp8 KV cache is served here where its float8
pages tile (``2 * combined heads`` a multiple of 4: Llama-3.2-1B, not Qwen2.5-0.5B's one
combined head), the kernel scaling the keys and values it reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtpu import settings

LANES = 128
# a sequence's pages the kernel's scalar core addresses well (JAX's tuned table keeps <= 16);
# pages from 16 tokens (vLLM's default) to 256 (vLLM's TPU backend's largest)
PAGES_PER_SEQ, MIN_PAGE, MAX_PAGE = 16, 16, 256


def pack_factor(head_size: int, num_kv_heads: int) -> int | None:
    """How many KV heads one combined kernel head holds (1 for 128-wide heads), or None."""
    if head_size % LANES == 0:
        return 1
    if LANES % head_size == 0 and num_kv_heads % (LANES // head_size) == 0:
        return LANES // head_size
    return None


def why_not(head_size: int, num_kv_heads: int, kv_cache_dtype: str) -> str | None:
    """Why this layer cannot use the kernel, or None."""
    from torchtpu.kernels.ragged_paged_attention import kernel_heads_problem

    f = pack_factor(head_size, num_kv_heads)
    if f is None:
        return (f"{num_kv_heads} KV heads of size {head_size} do not fill whole {LANES}-lane "
                "heads")
    # an fp8 cache's pages are float8: the kernel packs 4 head rows a word, not bf16's 2
    itemsize = 1 if kv_cache_dtype.startswith("fp8") else 2
    problem = kernel_heads_problem(2 * (num_kv_heads // f), itemsize)
    return problem and f"its {'float8 ' * (itemsize == 1)}pages have {problem}"


def enabled(head_size: int, num_kv_heads: int, kv_cache_dtype: str) -> bool:
    """Whether a layer of these heads runs the paged kernel (see the module doc)."""
    from torchtpu.runtime import platform

    mode = settings.VLLM_PAGED.get()
    if mode == "off":
        return False
    problem = why_not(head_size, num_kv_heads, kv_cache_dtype)
    if mode == "on" and problem:
        name = settings.VLLM_PAGED.name
        raise ValueError(f"torchtpu.argument: {name}=on, but the paged attention kernel cannot "
                         f"serve this model: {problem}; unset {name} for the gathered path")
    return problem is None and (mode == "on" or platform.platform() == "tpu")


def page_size(max_model_len: int) -> int:
    """The KV page (vLLM block) size in tokens for a model of ``max_model_len`` served by the
    kernel: the length rounded up to a power of two, in 16 pages, within 16 to 256 tokens.

    Past 4,096 tokens a sequence has more than 16 pages (the kernel's KV blocks stay at most
    1,024 tokens: ``kernels/ragged_paged_attention.blocks``); vLLM's TPU backend falls back to
    16-token pages past 8,192 for its whole-sequence blocks' VMEM, which capped blocks avoid."""
    if max_model_len < 1:
        raise ValueError(f"torchtpu.argument: max_model_len={max_model_len} must be positive")
    whole = 1 << (max_model_len - 1).bit_length()
    return min(MAX_PAGE, max(MIN_PAGE, whole // PAGES_PER_SEQ))


def cache_rows(key: torch.Tensor, value: torch.Tensor, f: int) -> torch.Tensor:
    """Cache rows ``[n, kv_heads, 2 * d]`` in the kernel's layout from keys and values
    ``[n, kv_heads, d]``."""
    n, heads, d = key.shape
    packed = torch.stack([key.reshape(n, heads // f, f * d), value.reshape(n, heads // f, f * d)],
                         dim=2)
    return packed.reshape(n, heads, 2 * d)


def attend(query: torch.Tensor, slots: torch.Tensor, f: int, block_size: int,
           seq_lens: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
           scale: float, kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """Attention of the step's packed queries [n, heads, d] through the kernel: [n, heads, d].

    ``slots`` is the layer cache, one row per token slot ([B * N, kv_heads, 2 * d]), float8
    for an fp8 cache, whose keys and values the kernel multiplies by ``kv_scales``;
    ``seq_lens``/``block_table``/``query_start_loc`` the step's R requests' (padded requests
    have length 0 and come last)."""
    from torchtpu.kernels.ragged_paged_attention import ragged_paged_attention

    n, heads, d = query.shape
    kv_heads = slots.shape[1]
    combined, group = kv_heads // f, heads // kv_heads
    pages = slots.view(-1, block_size, 2 * combined, f * d)
    if f > 1:  # each query head in its KV head's slot of the combined head, zeros elsewhere
        # (slices and pads: a product with an identity mask and its sum over the slots were
        # ~2x the estimated v5e cycles, ~0.2 ms of batch 64's step over 24 layers; serving13)
        q = query.view(n, combined, f, group, d)
        query = torch.stack([F.pad(q[:, :, j], (j * d, (f - 1 - j) * d)) for j in range(f)],
                            dim=2).reshape(n, heads, f * d)
    reqs = seq_lens.shape[0]
    num_seqs = (seq_lens > 0).sum().to(torch.int32).reshape(1)
    out = ragged_paged_attention(query, pages, seq_lens.to(torch.int32),
                                 block_table.to(torch.int32), query_start_loc[:reqs + 1]
                                 .to(torch.int32), num_seqs, sm_scale=scale,
                                 k_scale=kv_scales and kv_scales[0],
                                 v_scale=kv_scales and kv_scales[1])
    if f > 1:  # each head's own slot
        out = out.view(n, combined, f, group, f, d)
        out = torch.stack([out[:, :, j, :, j] for j in range(f)], dim=2).reshape(n, heads, d)
    return out
