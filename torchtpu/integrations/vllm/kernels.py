"""vLLM's Triton kernels that the GPU model runner launches, written as torch ops on "tpu".

vLLM lets a platform replace a core Triton kernel by its qualified name
(``vllm.triton_utils.dispatcher.register_kernels``); Triton cannot take "tpu" tensors, so
:func:`register` points the kernels the plain decoder path needs at these, and those of
speculative decoding's rejection sampler at ``spec_kernels``. Each takes the
Triton kernel's arguments (pointers become tensors) and writes its outputs in place.
"""

from __future__ import annotations

import torch


def compute_slot_mapping(num_tokens: int, max_num_tokens: int, query_start_loc: torch.Tensor,
                         positions: torch.Tensor, block_table: torch.Tensor,
                         block_table_stride: int, slot_mapping: torch.Tensor,
                         KV_CACHE_BLOCK_SIZE: int, TOTAL_CP_WORLD_SIZE: int = 1,  # noqa: N803
                         TOTAL_CP_RANK: int = 0, CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,  # noqa: N803
                         PAD_ID: int = -1, BLOCK_SIZE: int = 1024) -> None:  # noqa: N803
    """The KV-cache slot of each scheduled token, from its request's block table and position."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError(
            "torchtpu.unsupported: vLLM on device 'tpu' has no context parallelism"
        )
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID
    if num_tokens == 0:
        return
    token = torch.arange(num_tokens, device=positions.device, dtype=query_start_loc.dtype)
    request = torch.searchsorted(query_start_loc[1:], token, right=True)
    position = positions[:num_tokens]
    block = block_table[request, position // KV_CACHE_BLOCK_SIZE].long()
    slot_mapping[:num_tokens] = block * KV_CACHE_BLOCK_SIZE + position % KV_CACHE_BLOCK_SIZE


def register() -> None:
    from vllm.triton_utils.dispatcher import register_kernels

    from torchtpu.integrations.vllm import spec_kernels

    register_kernels({
        "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping,
        **spec_kernels.OVERRIDES,
    })
