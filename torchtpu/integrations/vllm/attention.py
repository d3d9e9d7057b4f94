"""vLLM's paged attention on device "tpu" in plain PyTorch: KV-cache writes, prefill, decode, mixed.

One layer's cache is a tensor of its own, ``[num_blocks, block_size, kv_heads, 2 * head_size]``
in memory (vLLM's ``LBNHC`` layout: keys then values in the last axis), handed to vLLM as its
logical ``[B, H, N, C]`` view. A step writes the new keys and values into their slots with one
``index_copy_`` and each request reads its context back through its block table with one
``index_select``; every op here has a torchtpu lowering, so the whole backend runs on the device.

Attention pads the step's ragged queries to ``[requests, max_query_len]`` and masks each query
to the keys at or before its own position in its request, which serves prefill, decode, chunked
prefill and prefix-cache hits (context already in the cache, fewer new tokens) alike. The masks
and gather indices are built once a step by :class:`TpuAttentionMetadataBuilder` and shared by
every layer. The context read spans the step's longest sequence rounded up to a power of two of
blocks, so programs are reused across steps.
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


class TpuAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float32", "bfloat16", "float16"]
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
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # block-major, token-major pages: a layer's cache flattens to one row per slot
        return (KVCacheLayout.LBNHC,)


def new_kv_cache(spec: AttentionSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    """One layer's cache, zeroed, as vLLM's logical ``[B, H, N, C]`` view of ``[B, N, H, C]``."""
    if spec.head_size_v != spec.head_size:
        raise NotImplementedError(
            f"torchtpu.unsupported: the tpu attention backend stores keys and values of one head "
            f"size; this model has {spec.head_size} and {spec.head_size_v}"
        )
    pages = torch.zeros(
        (num_blocks, spec.block_size, spec.num_kv_heads, 2 * spec.head_size),
        dtype=spec.dtype, device=device,
    )
    return pages.transpose(1, 2)


def allocate_kv_caches(kv_cache_config: KVCacheConfig, device: torch.device,
                       layout: KVCacheLayout | None = None,
                       kernel_block_sizes: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Every attention layer's cache as a tensor of its own (the GPU runner's allocator's role).

    vLLM packs all layers into one byte buffer viewed per layer; on "tpu" a write through
    such a view rewrites the whole buffer, every layer, every step, so each layer gets its own.
    """
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
                                        device)
    return caches


def _slots(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[B * N, H, C]``: the layer cache, one row per token slot (a view: writes go through)."""
    pages = kv_cache.transpose(1, 2)
    return pages.view(-1, *pages.shape[2:])


@dataclass
class TpuAttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_rows: torch.Tensor  # [R, Q] the step token each padded query row reads
    token_rows: torch.Tensor  # [T] the padded row (r * Q + i) each step token's output is in
    context_slots: torch.Tensor  # [R * L] the cache slot of each request's context position
    mask: torch.Tensor  # [R, 1, Q, L] True where a query sees a context position
    context_len: int  # L


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TpuAttentionMetadataBuilder(AttentionMetadataBuilder[TpuAttentionMetadata]):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TpuAttentionMetadata:
        m = common_attn_metadata
        num_reqs, num_tokens, q_max = m.num_reqs, m.num_actual_tokens, m.max_query_len
        block_table = m.block_table_tensor[:num_reqs]
        num_blocks = min(block_table.shape[1],
                         _pow2_at_least(-(-m.max_seq_len // self.block_size)))
        context_len = num_blocks * self.block_size

        # the ragged layout is known on the host: index tensors are made there and sent once
        starts = m.query_start_loc_cpu[: num_reqs + 1].long()
        lens = starts[1:] - starts[:-1]
        offsets = torch.arange(q_max)
        query_rows = (starts[:-1, None] + offsets).clamp(max=max(num_tokens - 1, 0))
        valid = offsets < lens[:, None]
        req_of_token = torch.repeat_interleave(torch.arange(num_reqs), lens)
        token_rows = req_of_token * q_max + torch.arange(num_tokens) - starts[req_of_token]
        to_dev = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731

        # positions need the cached context lengths, which live on the device
        seq_lens = m.seq_lens[:num_reqs].long()
        first = seq_lens - to_dev(lens)
        positions = first[:, None] + to_dev(offsets)
        # a padded query row sees position 0 only, so its softmax stays finite (it is dropped)
        positions = torch.where(to_dev(valid), positions, 0)
        keys = torch.arange(context_len, device=self.device)
        mask = (keys[None, None, :] <= positions[:, :, None])[:, None]

        pages = block_table[:, :num_blocks].long()
        in_block = torch.arange(self.block_size, device=self.device)
        context_slots = (pages[:, :, None] * self.block_size + in_block).reshape(-1)
        return TpuAttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=num_reqs, max_query_len=q_max,
            query_rows=to_dev(query_rows), token_rows=to_dev(token_rows),
            context_slots=context_slots, mask=mask, context_len=context_len,
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
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
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
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        slots = _slots(kv_cache)
        # rows past the step's tokens are padding (slot -1, which indexing would wrap)
        n = min(key.shape[0], slot_mapping.shape[0])
        rows = torch.cat([key[:n], value[:n]], dim=-1).to(slots.dtype)
        slots.index_copy_(0, slot_mapping[:n].long(), rows)

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
        context = _slots(kv_cache).index_select(0, md.context_slots)
        context = context.view(reqs, md.context_len, self.num_kv_heads, 2 * d).transpose(1, 2)
        k, v = context[..., :d], context[..., d:]
        q = query[:n][md.query_rows].transpose(1, 2)  # [R, heads, Q, d]
        out = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=md.mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(reqs * q_len, self.num_heads, d)
        output[:n] = out[md.token_rows]
        return output
