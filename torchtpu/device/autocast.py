"""``torch.autocast("tpu")``: mixed precision on the device, bfloat16 by default.

PyTorch's autocast for a custom device needs the AutocastPrivateUse1 key served. Every op falls
through it except those listed here, which cast their floating-point tensor arguments first, as
CUDA's autocast does: matrix products and convolutions run in the autocast dtype, numerically
sensitive ops in float32, and ops that mix inputs run in the widest input dtype.
"""

from __future__ import annotations

import threading

import torch

aten = torch.ops.aten
_AUTOCAST = torch._C.DispatchKey.AutocastPrivateUse1

LOWER_PRECISION = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "_convolution", "matmul", "mm", "mv", "bmm", "addmm", "addmv", "addbmm",
    "baddbmm", "linear", "prelu", "chain_matmul", "linalg_multi_dot",
    "scaled_dot_product_attention", "_scaled_dot_product_attention_math", "addr", "outer",
)
FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "native_group_norm", "rms_norm", "norm", "linalg_vector_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss_nd", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "softmax", "log_softmax", "cross_entropy_loss",
    "cumprod", "cumsum", "prod", "sum", "_softmax", "_log_softmax",
)
WIDEST = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
    "scatter_add", "tensordot", "cat", "stack",
)


_Tensor = torch.Tensor
# The guard's key set, made once (each autocast call enters the guard).
_EXCLUDE = torch._C.DispatchKeySet(_AUTOCAST)


def _floating_on_device(x) -> bool:
    return isinstance(x, _Tensor) and x.is_floating_point() and not x.is_cpu


def _cast(tree, dtype):
    if isinstance(tree, _Tensor):
        return tree.to(dtype) if tree.is_floating_point() and not tree.is_cpu else tree
    if isinstance(tree, (list, tuple)):
        # Every product and norm of an autocast forward comes here: its plain tensor arguments
        # are cast without a call each.
        return type(tree)([x.to(dtype) if isinstance(x, _Tensor) and x.is_floating_point()
                           and not x.is_cpu else _cast(x, dtype)
                           if isinstance(x, (list, tuple)) else x for x in tree])
    return tree


def _widest(args, kwargs):
    found = [x for x in list(args) + list(kwargs.values()) for x in
             (x if isinstance(x, (list, tuple)) else [x]) if _floating_on_device(x)]
    dtype = found[0].dtype if found else None
    for x in found[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


_casting = threading.local()


def casting() -> bool:
    """Whether this thread is in autocast's casts of an op's arguments (each used by that op
    and, saved, by its backward: a cast no longer alive after the step's backward)."""
    return getattr(_casting, "on", False)


def _kernel(op, policy: str):
    lower, float32 = policy == "lower", policy == "float32"
    call = op._op  # what ``OpOverload.__call__`` calls, without its frame

    def run(*args, **kwargs):
        dtype = torch.get_autocast_dtype("tpu") if lower else torch.float32 if float32 \
            else _widest(args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if dtype is not None:
                _casting.on = True
                try:
                    args = _cast(args, dtype)
                    if kwargs:
                        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
                finally:
                    _casting.on = False
            return call(*args, **kwargs)

    return run


def register(lib: torch.library.Library, fallback: torch.library.Library) -> None:
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    for names, policy in ((LOWER_PRECISION, "lower"), (FLOAT32, "float32"), (WIDEST, "widest")):
        for name in names:
            packet = getattr(aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if not op._schema.is_mutable:
                    lib.impl(op, _kernel(op, policy), "AutocastPrivateUse1")
