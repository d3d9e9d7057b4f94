"""A CPU reference for ``aten._flash_attention_forward/backward``, built from SDPA per sequence.

PyTorch has no CPU kernel for the flash ops (only CUDA's FlashAttention), so tests compare the
tpu lowering (``torchtpu/lowering/attention.py``) with this: each sequence of a packed varlen
batch (or each row of a dense one) through ``F.scaled_dot_product_attention``'s math on CPU with
FlashAttention's bottom-right causal/window mask, and the backward as autograd of the same.
``install_cpu_kernels()`` registers it as the ops' CPU kernels, so a whole program that calls
them (TorchTitan's varlen attention) can run on CPU as the reference of a tpu run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _allowed(len_q: int, len_k: int, is_causal: bool, left: int | None,
             right: int | None) -> torch.Tensor:
    """FlashAttention's (len_q, len_k) mask: windows and causal aligned bottom-right."""
    i = torch.arange(len_q)[:, None] + (len_k - len_q)
    j = torch.arange(len_k)[None, :]
    keep = torch.ones(len_q, len_k, dtype=torch.bool)
    right = 0 if is_causal else right
    if right is not None and right >= 0:
        keep &= j <= i + right
    if left is not None and left >= 0:
        keep &= j >= i - left
    return keep


def _spans(x: torch.Tensor, cum: torch.Tensor | None) -> list[tuple[int, int]]:
    if cum is None:
        return [(b, b + 1) for b in range(x.shape[0])]
    bounds = cum.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _one(q, k, v, scale, mask):
    """SDPA (math) and the logsumexp of one sequence: q (L, H, E), k/v (S, Hk, E)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1).float() for t in (q, k, v))  # (H, L, E)
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return out.transpose(0, 1), torch.logsumexp(scores, -1)  # (L, H, E), (H, L)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cum_seq_q: torch.Tensor | None = None, cum_seq_k: torch.Tensor | None = None,
              is_causal: bool = False, scale: float | None = None,
              window_size_left: int | None = None,
              window_size_right: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash forward's (output, logsumexp) in its dense or varlen layout, differentiably."""
    dense = cum_seq_q is None
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(_spans(q, cum_seq_q), _spans(k, cum_seq_k)):
        qs, ks, vs = q[q0:q1], k[k0:k1], v[k0:k1]
        if dense:
            qs, ks, vs = qs[0], ks[0], vs[0]
        mask = _allowed(qs.shape[0], ks.shape[0], is_causal, window_size_left, window_size_right)
        out, lse = _one(qs, ks, vs, scale, mask)
        outs.append(out)
        lses.append(lse)
    if dense:
        return torch.stack(outs).to(q.dtype), torch.stack(lses)
    # Tokens outside every sequence get zeros, as in the lowering.
    inside = torch.cat([torch.arange(q0, q1) for q0, q1 in _spans(q, cum_seq_q)])
    out = torch.cat(outs).new_zeros(q.shape[0], *outs[0].shape[1:])
    lse = lses[0].new_zeros(q.shape[1], q.shape[0])
    return (out.index_copy(0, inside, torch.cat(outs)).to(q.dtype),
            lse.index_copy(1, inside, torch.cat(lses, -1)))


def _forward_kernel(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                    return_debug_mask, *, scale=None, window_size_left=None,
                    window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
                    num_splits=None):
    out, lse = reference(q, k, v, cum_seq_q, cum_seq_k, is_causal, scale, window_size_left,
                         window_size_right)
    return (out, lse, torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64),
            torch.empty(0, dtype=q.dtype))


def _backward_kernel(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                     is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                     window_size_right=None):
    # Called below autograd (a custom op's backward excludes its keys): take them back to
    # differentiate the reference.
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(
        keys.AutogradFunctionality).remove(keys.ADInplaceOrView)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        again, _ = reference(*inputs, cum_seq_q, cum_seq_k, is_causal, scale, window_size_left,
                             window_size_right)
        return torch.autograd.grad(again, inputs, grad_out)


_LIBRARIES: list = []


def install_cpu_kernels() -> None:
    """Register the reference as the flash ops' CPU kernels (once per process)."""
    if _LIBRARIES:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", _forward_kernel, "CPU")
    lib.impl("_flash_attention_backward", _backward_kernel, "CPU")
    _LIBRARIES.append(lib)
