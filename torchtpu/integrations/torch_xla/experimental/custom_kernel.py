"""``torch_xla.experimental.custom_kernel``: ``flash_attention`` and ``FlashAttention``.

PyTorch/XLA's ``flash_attention(q, k, v, causal, ..., sm_scale)`` is its Pallas kernel; here it
is ``torch.nn.functional.scaled_dot_product_attention`` on the tpu tensors, which torchtpu routes
to its own flash kernel where one fits (docs, attention). Same layout, ``[batch, heads, seq,
head_dim]``, the same ``sm_scale`` (PyTorch/XLA's default 1.0: the caller scales q). Segment ids
and ``ab`` (an additive bias) are refused; ``partition_spec`` / ``mesh`` (PyTorch/XLA's sharding
of the kernel over an SPMD mesh) change nothing with one process per device. ``FlashAttention``
is the class whose ``DEFAULT_BLOCK_SIZES`` scripts set (kept, unused: XLA picks the blocks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtpu.integrations.torch_xla import _missing


class FlashAttention:
    """Holds ``DEFAULT_BLOCK_SIZES`` as PyTorch/XLA's does; ``apply`` is ``flash_attention``."""

    DEFAULT_BLOCK_SIZES: dict = {}

    @staticmethod
    def apply(q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0,
              ab=None, partition_spec=None, mesh=None):
        return flash_attention(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale, ab,
                               partition_spec, mesh)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    q_segment_ids=None, kv_segment_ids=None, sm_scale: float = 1.0, ab=None,
                    partition_spec=None, mesh=None) -> torch.Tensor:
    """Attention of q over k, v (``[batch, heads, seq, head_dim]``): softmax(sm_scale q k^T
    (+ the causal mask)) v."""
    for name, value in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids),
                        ("ab", ab)):
        if value is not None:
            raise NotImplementedError(_missing.text(
                f"torch_xla.experimental.custom_kernel.flash_attention({name}=...)").replace(
                "use the torch", "pass attn_mask to F.scaled_dot_product_attention, or the torch"))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
