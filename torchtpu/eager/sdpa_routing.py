"""Which kernel serves ``F.scaled_dot_product_attention`` on tpu tensors (and DTensors of them).

PyTorch picks an SDPA backend through ``_fused_sdp_choice_stub``, a C++ DispatchStub that only a
C++ extension can fill for PrivateUse1; without it every call takes the math path (~15 ATen ops
forward, ~20 backward). So torchtpu serves ``aten::scaled_dot_product_attention`` itself for the
device (Autograd and plain PrivateUse1 keys): ``sdp_choice`` (also the device's
``aten::_fused_sdp_choice`` kernel) picks OVERRIDEABLE or MATH, and the call becomes
``_scaled_dot_product_fused_attention_overrideable`` (lowered in ``lowering/attention.py``, whose
autograd formula calls the overrideable backward), or PyTorch's own composite (the math path,
its checks and errors).

``torch.nn.attention.sdpa_kernel`` is honoured as on CUDA: the fused op only while the
OVERRIDEABLE backend is enabled, the math path only while MATH is, and a call that no enabled
backend can serve raises. DTensors arrive here too (their dispatch keys are the device's): the
fused op then runs through DTensor's sharding rules for it (``distributed/dtensor_sdpa.py``).
"""

from __future__ import annotations

import sys

import torch

from torchtpu import errors

aten = torch.ops.aten
_SDPBackend = torch._C._SDPBackend
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _broadcastable(shape, target) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _fusable(query, key, value, attn_mask, is_causal) -> bool:
    """Whether the fused lowering computes what the math path would for this call."""
    if any(t.dim() != 4 for t in (query, key, value)):
        return False
    # float64 keeps the math path: the fused op's logsumexp is float32 by its schema's meta.
    if not (query.dtype == key.dtype == value.dtype and query.dtype in _FUSED_DTYPES):
        return False
    n, h, L, e = query.shape
    if key.shape[:2] != (n, h) or value.shape[:3] != key.shape[:3] or key.shape[-1] != e:
        return False  # GQA (enable_gqa with fewer k/v heads) included
    if attn_mask is not None:
        if is_causal or attn_mask.dtype not in (torch.bool, query.dtype):
            return False
        if not _broadcastable(attn_mask.shape, (n, h, L, key.shape[2])):
            return False
    return all(t.device == query.device for t in (key, value, attn_mask) if t is not None)


def sdp_choice(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
               scale=None, enable_gqa=False) -> int:
    """OVERRIDEABLE where the fused lowering computes what the math path would and
    ``sdpa_kernel`` allows it, else MATH.

    MATH also gets every call PyTorch would reject (mismatched dtypes or shapes), so its own
    composite raises its own errors; a call neither enabled backend serves raises here.
    """
    fused_ok = torch._C._get_overrideable_sdp_enabled()
    if fused_ok and _fusable(query, key, value, attn_mask, is_causal):
        return int(_SDPBackend.OVERRIDEABLE)
    if torch._C._get_math_sdp_enabled():
        return int(_SDPBackend.MATH)
    why = ("the fused kernel (SDPBackend.OVERRIDEABLE) cannot serve this call (it needs 4-D "
           "float32/bfloat16/float16 q, k, v with equal heads, and no mask with is_causal)"
           if fused_ok else "SDPBackend.OVERRIDEABLE (the fused kernel) and SDPBackend.MATH are "
           "both disabled")
    raise RuntimeError(errors.message(
        "unsupported", f"scaled_dot_product_attention: no available kernel on tpu: {why}; "
        "torch.nn.attention.sdpa_kernel must allow SDPBackend.OVERRIDEABLE or SDPBackend.MATH "
        "(the tpu's two; FLASH_ATTENTION, EFFICIENT_ATTENTION and CUDNN_ATTENTION are CUDA's)"))


# (min length, op) installed by an upper layer (``torch.tpu.ops.flash_sdpa``): calls without
# mask and dropout at least that long go to op(q, k, v, is_causal, scale) instead.
_long_sequence_path: list = [None]


def set_long_sequence_path(path: tuple | None) -> None:
    _long_sequence_path[0] = path


def _long_sequence_op(query, key, attn_mask, dropout_p, enable_gqa):
    path = _long_sequence_path[0]
    if path is None or attn_mask is not None or dropout_p > 0.0 or enable_gqa:
        return None
    # The flash kernel is a custom op with no DTensor sharding rule: DTensors take the fused op.
    if _is_dtensor(query) or _is_dtensor(key):
        return None
    min_len, op = path
    if max(query.shape[-2], key.shape[-2]) < min_len or query.dim() != 4:
        return None
    return op


def _is_dtensor(t) -> bool:
    tensor = sys.modules.get("torch.distributed.tensor")  # never imported here: it is heavy
    return tensor is not None and isinstance(t, tensor.DTensor)


def _grouped(query, key, value) -> int:
    """How many query heads share each key/value head in a grouped-query call (1: none), or 0
    when the grouping is not one the math path would accept."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or _is_dtensor(key):
        return 0
    h, hk = query.shape[-3], key.shape[-3]
    return h // hk if hk and h % hk == 0 and value.shape[-3] == hk else 0


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    groups = _grouped(query, key, value) if enable_gqa else 1
    if groups > 1 and torch._C._get_overrideable_sdp_enabled():
        # Grouped-query attention (Llama, Qwen, Gemma with fewer key/value heads) as the math path
        # computes it, heads repeated, but through the fused op: the math path's ~15 ops (with its
        # transposed copies and fully-masked-row guard) would otherwise serve every such model.
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
        enable_gqa = False
    choice = sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                        enable_gqa=enable_gqa)
    if choice == int(_SDPBackend.OVERRIDEABLE):
        long_op = _long_sequence_op(query, key, attn_mask, dropout_p, enable_gqa)
        if long_op is not None:
            return long_op(query, key, value, is_causal, scale)
        return aten._scaled_dot_product_fused_attention_overrideable.default(
            query, key, value, attn_mask, dropout_p, is_causal, False, scale=scale)[0]
    out = aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    # CPU's flash kernel lays its output out as the query (``empty_like``): a query of
    # transposed heads (B, L, H, E in memory) gives such an output, whose
    # ``.transpose(1, 2).view(B, L, -1)`` works on CPU; the math path's is contiguous.
    if type(out) is torch.Tensor and out.shape == query.shape:  # (not a trace's fake tensors)
        stride = torch.empty_like(query, device="meta").stride()
        if out.stride() != stride and _cpu_takes_flash(query, key, value, attn_mask, dropout_p,
                                                       is_causal, scale, enable_gqa):
            out = torch.empty_strided(out.shape, stride, dtype=out.dtype,
                                      device=out.device).copy_(out)
    return out


def _cpu_takes_flash(query, key, value, attn_mask, dropout_p, is_causal, scale,
                     enable_gqa) -> bool:
    """Whether CPU's SDPA takes its flash kernel for a call of these arguments (float64, a mask
    the fused op does not take: calls the math path serves here), asked of CPU on uninitialized
    stand-ins of the same shapes, strides and dtypes (the choice reads only those)."""
    if query.dim() != 4 or _is_dtensor(query):
        return False
    try:
        stand = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                 for t in (query, key, value, attn_mask)]
        choice = torch._fused_sdp_choice(*stand, dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    except Exception:  # CPU refuses it: the math path's error (or value) stands
        return False
    return choice == int(_SDPBackend.FLASH_ATTENTION)


def register(lib: torch.library.Library) -> None:
    """Serve SDPA and the backend choice for the device (``lib``: an ``aten`` IMPL library).

    The Autograd key is where a CompositeImplicitAutograd op is decomposed, so SDPA is taken
    there (the overrideable op then records its own backward); the PrivateUse1 key serves calls
    that skip autograd (inference mode).
    """
    lib.impl(aten._fused_sdp_choice.default, sdp_choice, "PrivateUse1")
    for key in ("AutogradPrivateUse1", "PrivateUse1"):
        lib.impl(aten.scaled_dot_product_attention.default, _sdpa, key)
