"""vLLM's paged attention on device "tpu" in plain PyTorch: KV-cache writes, prefill, decode, mixed.

One layer's cache is a tensor of its own, ``[num_blocks, block_size, kv_heads, 2 * head_size]``
in memory (vLLM's ``LBNHC`` layout: keys then values in the last axis), handed to vLLM as its
logical ``[B, H, N, C]`` view. A step writes the new keys and values into their slots with one
``index_copy_`` and each request reads its context back through its block table with one
``index_select``; every op here has a torchtpu lowering, so the whole backend runs on the device.

Attention pads the step's ragged queries to ``[requests, max_query_len]`` and masks each query
to the keys at or before its own position in its request, which serves prefill, decode, chunked
prefill and prefix-cache hits (context already in the cache, fewer new tokens) alike. The masks
and gather indices are derived once a step, by the first layer, from vLLM's persistent buffers
(:meth:`TpuAttentionMetadata.layout`) and shared by every layer, so a captured forward
(``graphs.py``) computes them inside its one program. The query length and the context read
are rounded up to powers of two (of tokens, of blocks), so programs are reused across steps;
tokens and requests that the runner pads (slot -1, block table rows on the null block 0) are
computed and dropped.

With ``kv_cache_dtype="fp8"`` (``fp8_e4m3``, ``fp8_e5m2``) vLLM sizes the cache in bytes (its
spec's dtype is uint8); the backend reads those bytes as float8, writes ``key / k_scale``
saturated to the float8 range, as vLLM's CUDA cache kernels do, and reads ``k_scale * key``
back in the query's dtype (the same for values, with the layer's per-tensor scales: 1.0 unless
the checkpoint has them). On the gathered path its storage holds the bytes as 16-bit words, one
flat row a slot, the shape every step reads and writes (:func:`_byte_rows`: an 8-bit one is
copied whole on a TPU). Where the paged kernel serves it (``paged.why_not``), the storage is
float8 in the kernel's layout, written and read as float8: the kernel's operand is then the
storage itself (a byte view of it would be a whole-cache copy a layer), the scales its own.

Encoder-only attention (BERT-style embedding models, vLLM's ``EncoderOnlyAttention``) has no
cache: each request's queries see all of its own new keys and values, which the layer passes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheLayout,
    UniformTypeKVCacheSpecs,
)

from torchtpu.integrations.vllm import paged
from torchtpu.integrations.vllm.support import KV_CACHE_DTYPES

# the float8 type each fp8 kv_cache_dtype's bytes hold
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2}
# what an fp8 cache's storage holds its bytes in (see _byte_rows)
BYTE_ROW_WORD = torch.int16


class TpuAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(KV_CACHE_DTYPES)
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "TORCHTPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[TpuAttentionImpl]:
        return TpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TpuAttentionMetadataBuilder]:
        return TpuAttentionMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in (AttentionType.DECODER, AttentionType.ENCODER_ONLY)

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        # vLLM asks this (with the engine's config current) where the user gave no --block-size:
        # the paged kernel's pages by the model's length (paged.page_size), vLLM's elsewhere
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        model = getattr(config, "model_config", None)
        if model is None or not paged.enabled(
                model.get_head_size(), model.get_num_kv_heads(config.parallel_config),
                config.cache_config.cache_dtype):
            return default_block_size
        return paged.page_size(model.max_model_len)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # block-major, token-major pages: a layer's cache flattens to one row per slot
        return (KVCacheLayout.LBNHC,)


def new_kv_cache(spec: AttentionSpec, num_blocks: int, device: torch.device,
                 cache_dtype: str = "auto") -> torch.Tensor:
    """One layer's cache, zeroed, as vLLM's logical ``[B, H, N, C]`` view of ``[B, N, H, C]``
    (``cache_dtype``: vLLM's ``kv_cache_dtype``, which says an fp8 cache's float8)."""
    if spec.head_size_v != spec.head_size:
        raise NotImplementedError(
            f"torchtpu.unsupported: the tpu attention backend stores keys and values of one head "
            f"size; this model has {spec.head_size} and {spec.head_size_v}"
        )
    # made in the shape every step writes it through (one row per slot, see _slots): a
    # captured step then reads and writes the storage in one shape, so XLA updates it in place
    # (a first capture that saw the page shape would copy the whole cache at every replay)
    n, row = num_blocks * spec.block_size, (spec.num_kv_heads, 2 * spec.head_size)
    fp8 = FP8_KV_DTYPES.get(cache_dtype)
    if spec.dtype.itemsize == 1 and fp8 is not None and paged.enabled(
            spec.head_size, spec.num_kv_heads, cache_dtype):  # the kernel's float8 pages
        slots = torch.zeros((n, *row), dtype=fp8, device=device).view(spec.dtype)
    elif spec.dtype.itemsize == 1:  # an fp8 cache's bytes, held in 16-bit words (_byte_rows)
        slots = torch.zeros((n, row[0] * row[1] // 2), dtype=BYTE_ROW_WORD, device=device)
        slots = slots.view(spec.dtype).view(n, *row)
    else:
        slots = torch.zeros((n, *row), dtype=spec.dtype, device=device)
    return slots.view(num_blocks, spec.block_size, *row).transpose(1, 2)


def allocate_kv_caches(kv_cache_config: KVCacheConfig, device: torch.device,
                       layout: KVCacheLayout | None = None,
                       kernel_block_sizes: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Every attention layer's cache as a tensor of its own (the GPU runner's allocator's role).

    vLLM packs all layers into one byte buffer viewed per layer; on "tpu" a write through
    such a view rewrites the whole buffer, every layer, every step, so each layer gets its own.
    """
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    cache_dtype = getattr(getattr(config, "cache_config", None), "cache_dtype", "auto")
    specs = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            specs[name] = (spec.kv_cache_specs[name]
                           if isinstance(spec, UniformTypeKVCacheSpecs) else spec)
    caches = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        for name in tensor.layers:
            if not isinstance(specs[name], AttentionSpec):
                raise NotImplementedError(
                    f"torchtpu.unsupported: layer {name} needs a {type(specs[name]).__name__} "
                    "cache; vLLM on device 'tpu' runs attention layers only"
                )
            caches[name] = new_kv_cache(specs[name], kv_cache_config.num_blocks_of(tensor),
                                        device, cache_dtype)
    return caches


def _slots(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[B * N, H, C]``: the layer cache, one row per token slot (a view: writes go through)."""
    pages = kv_cache.transpose(1, 2)
    return pages.view(-1, *pages.shape[2:])


def _byte_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[B * N, H * C / 2]`` 16-bit words: an fp8 cache's bytes as its storage holds them.

    On a TPU an 8-bit array's entry layout tiles (32, 128), and XLA's scatter into one wants
    (8, 128): a step's ``index_copy_`` copied the whole cache into that layout and back, at
    every layer of every step (``[slots, 2, 128]`` bytes were laid out heads-major as well:
    Qwen2.5-0.5B at batch 8, 72 ms a step, 56x its roofline). A 16-bit array's entry layout
    is the one its scatter and gather use, so the bytes live in 16-bit words, one flat row a
    slot, read and written in that shape: in place.
    """
    return _slots(kv_cache).flatten(1).view(BYTE_ROW_WORD)


@dataclass
class TpuAttentionMetadata:
    """A step's attention layout: sizes on the host, the ragged layout as vLLM's own buffers.

    The tensors are slices of the model runner's persistent device buffers (query start
    locations, sequence lengths, block table), so a captured step that reads them reads each
    new step's values at replay. The gather indices and the mask derived from them are made by
    the first layer's forward (:meth:`layout`) and shared by the others: inside a capture they
    are part of the one program, not ops of their own.
    """

    num_actual_tokens: int  # T, padded where the runner pads the step
    num_reqs: int  # R, likewise
    max_query_len: int  # Q: the longest query, rounded up to a power of two
    context_len: int  # L: the longest context, in whole blocks, a power of two of them
    block_size: int
    query_start_loc: torch.Tensor  # [R + 1], non-decreasing (padded requests query nothing)
    seq_lens: torch.Tensor  # [R]
    block_table: torch.Tensor  # [R, >= L / block_size]
    causal: bool = True  # False: encoder-only, each query sees its request's new tokens
    _layout: tuple | None = None

    def layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query_rows [R, Q], token_rows [T], context_slots [R * L], mask [R, 1, Q, L]).

        query_rows: the step token each padded query row reads; token_rows: the padded row
        each step token's output is in; context_slots: the cache slot of each request's context
        position; mask: True where a query sees a context position (a padded query row sees
        position 0 only, so its softmax stays finite; its output is dropped). Not causal, the
        mask is [R, 1, 1, Q]: the request's own new tokens (at least one, for padded requests).
        """
        if self._layout is None:
            self._layout = _layout(self)
        return self._layout

    def forget_layout(self) -> None:
        """Drop the layout tensors (at the end of the step's forward)."""
        self._layout = None


def _layout(md: TpuAttentionMetadata) -> tuple:
    t, r, q, bs = md.num_actual_tokens, md.num_reqs, md.max_query_len, md.block_size
    dev = md.seq_lens.device
    starts = md.query_start_loc[: r + 1].long()
    lens = starts[1:] - starts[:-1]
    offsets = torch.arange(q, device=dev)
    query_rows = (starts[:-1, None] + offsets).clamp(max=max(t - 1, 0))
    positions = md.seq_lens[:r].long()[:, None] - lens[:, None] + offsets
    positions = torch.where(offsets < lens[:, None], positions, 0)
    if md.causal:
        mask = (torch.arange(md.context_len, device=dev) <= positions[:, :, None])[:, None]
    else:
        mask = (offsets < lens.clamp(min=1)[:, None])[:, None, None]
    token = torch.arange(t, device=dev)
    req = torch.searchsorted(starts[1:], token, right=True).clamp(max=r - 1)
    token_rows = (req * q + token - starts[req]).clamp(0, r * q - 1)
    pages = md.block_table[:r, : md.context_len // bs].long()
    context_slots = (pages[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(-1)
    return query_rows, token_rows, context_slots, mask


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TpuAttentionMetadataBuilder(AttentionMetadataBuilder[TpuAttentionMetadata]):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # the paged kernel reads each request's pages itself: no context bucket to compile for
        cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
        self.paged = paged.enabled(kv_cache_spec.head_size, kv_cache_spec.num_kv_heads,
                                   cache_dtype)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TpuAttentionMetadata:
        # no device work here: the layout is derived inside the model's forward (layout())
        m = common_attn_metadata
        if not isinstance(m.causal, bool):
            raise NotImplementedError("torchtpu.unsupported: the tpu attention backend has no "
                                      "per-request (dynamic) causality yet")
        return self.metadata(m.num_actual_tokens, m.num_reqs, m.max_query_len, m.max_seq_len,
                             m.query_start_loc, m.seq_lens, m.block_table_tensor, m.causal)

    def metadata(self, num_tokens: int, num_reqs: int, max_query_len: int, max_seq_len: int,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_table: torch.Tensor, causal: bool = True) -> TpuAttentionMetadata:
        """A step's metadata from its sizes and vLLM's persistent buffers (the model runner's
        decode steps prepared on the host call this directly)."""
        num_blocks = min(block_table.shape[1],
                         _pow2_at_least(-(-max_seq_len // self.block_size)))
        if self.paged:  # one program per tokens and requests (decodes: max_query_len 1)
            num_blocks = block_table.shape[1]
            max_query_len = 1 if max_query_len == 1 else num_tokens
        return TpuAttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=num_reqs,
            max_query_len=min(_pow2_at_least(max_query_len), num_tokens),
            context_len=num_blocks * self.block_size, block_size=self.block_size,
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
            causal=causal,
        )


class TpuAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "sliding-window attention": sliding_window is not None,
            "logits soft-capping": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            f"attention type {attn_type}": not TpuAttentionBackend.supports_attn_type(attn_type),
        }
        for what, asked in unsupported.items():
            if asked:
                raise NotImplementedError(
                    f"torchtpu.unsupported: the tpu attention backend has no {what} yet"
                )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = FP8_KV_DTYPES.get(kv_cache_dtype)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.paged = attn_type == AttentionType.DECODER and paged.enabled(
            head_size, num_kv_heads, kv_cache_dtype)
        self.pack = paged.pack_factor(head_size, num_kv_heads) if self.paged else None

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.attn_type == AttentionType.ENCODER_ONLY:  # no cache
            return
        n = min(key.shape[0], slot_mapping.shape[0])
        key, value = key[:n], value[:n]
        if self.fp8 is not None:
            top = torch.finfo(self.fp8).max
            key = (key.float() / layer._k_scale).clamp(-top, top)
            value = (value.float() / layer._v_scale).clamp(-top, top)
        rows = (paged.cache_rows(key, value, self.pack) if self.paged
                else torch.cat([key, value], dim=-1))
        # a padded token's slot is -1, which indexing would wrap to the last slot: it writes
        # into block 0 instead, vLLM's null block, which no request's context reads
        slot_index = slot_mapping[:n].long().clamp(min=0)
        if self.fp8 is not None and self.paged:  # float8 rows into the float8 storage
            _slots(kv_cache).view(self.fp8).index_put_((slot_index,), rows.to(self.fp8))
            return
        # float8 rows go in as the cache's bytes: CPU's index_copy_ takes no float8, so
        # neither does tpu's (torchtpu refuses by dtype as CPU does)
        if self.fp8 is not None:
            slots, rows = _byte_rows(kv_cache), rows.to(self.fp8).flatten(1).view(BYTE_ROW_WORD)
        else:
            slots = _slots(kv_cache)
            rows = rows.to(slots.dtype)
        slots.index_copy_(0, slot_index, rows)

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TpuAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "torchtpu.unsupported: the tpu attention backend has no fused output quantization"
            )
        if attn_metadata is None:  # vLLM's profiling run
            return output
        md = attn_metadata
        n, reqs, q_len = md.num_actual_tokens, md.num_reqs, md.max_query_len
        d = self.head_size
        if self.paged:
            slots, scales = _slots(kv_cache), None
            if self.fp8 is not None:  # host floats: the kernel's scales are static
                slots = slots.view(self.fp8)
                scales = (float(layer._k_scale_float), float(layer._v_scale_float))
            output[:n] = paged.attend(query[:n], slots, self.pack, md.block_size,
                                      md.seq_lens[:reqs], md.block_table[:reqs],
                                      md.query_start_loc, self.scale, scales)
            return output
        query_rows, token_rows, context_slots, mask = md.layout()
        q = query[:n][query_rows]  # [R, Q, heads, d]
        if self.attn_type == AttentionType.ENCODER_ONLY:
            q, k, v = (x.transpose(1, 2) for x in (q, key[:n][query_rows],
                                                   value[:n][query_rows]))
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            ).transpose(1, 2)
        else:
            out = self._grouped(q, *self._context(layer, kv_cache, md, context_slots, q.dtype),
                                mask)
        output[:n] = out.reshape(reqs * q_len, self.num_heads, d)[token_rows]
        return output

    def _grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """``[R, Q, heads, d]`` queries over ``[R, kv_heads, L, d]`` keys and values, each KV
        head's query heads attending as one query of ``group * Q`` rows: grouped-query
        attention with no copy of the keys and values per query head (SDPA's ``enable_gqa``
        repeats them: at 64-256 requests most of the gathered step's bytes, serving2's table)."""
        r, q_len, heads, d = q.shape
        kv = self.num_kv_heads
        group = heads // kv
        rows = q.view(r, q_len, kv, group, d).permute(0, 2, 3, 1, 4).reshape(
            r, kv, group * q_len, d)
        length = mask.shape[-1]
        grouped_mask = mask.expand(r, 1, q_len, length)[:, :, None].expand(
            r, 1, group, q_len, length).reshape(r, 1, group * q_len, length)
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=grouped_mask,
                                             scale=self.scale)
        return out.view(r, kv, group, q_len, d).permute(0, 3, 1, 2, 4)

    def _context(self, layer: torch.nn.Module, kv_cache: torch.Tensor, md: TpuAttentionMetadata,
                 context_slots: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's cached keys and values, ``[R, kv_heads, L, d]`` each, in ``dtype``."""
        d = self.head_size
        if self.fp8 is not None:
            context = _byte_rows(kv_cache).index_select(0, context_slots).view(self.fp8)
        else:
            context = _slots(kv_cache).index_select(0, context_slots)
        context = context.view(md.num_reqs, md.context_len, self.num_kv_heads, 2 * d)
        context = context.transpose(1, 2)
        k, v = context[..., :d].to(dtype), context[..., d:].to(dtype)
        if self.fp8 is not None:
            k, v = k * layer._k_scale.to(dtype), v * layer._v_scale.to(dtype)
        return k, v
