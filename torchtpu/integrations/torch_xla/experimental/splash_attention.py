"""``torch_xla.experimental.splash_attention``: ``SplashAttentionConfig`` (a record of the
kernel's settings, so scripts that build one import and run) and ``splash_attention``, refused
when called: it is PyTorch/XLA's call into JAX's TPU splash kernel over an SPMD mesh. Use
``torch.nn.functional.scaled_dot_product_attention`` (torchtpu's flash kernel), or the JAX kernel
itself as a torch op through ``torchtpu.kernels.jax_op``."""

from __future__ import annotations

from torchtpu.integrations.torch_xla import _missing


class SplashAttentionConfig:
    """The settings as given (``mesh``, ``qkv_partition_spec``, block sizes ...), as attributes."""

    def __init__(self, **settings) -> None:
        self.__dict__.update(settings)

    def to_json(self) -> str:
        import json

        return json.dumps({k: v for k, v in self.__dict__.items()
                           if isinstance(v, (int, float, str, bool, type(None), list))})


def splash_attention(*args, **kwargs):
    raise NotImplementedError(_missing.text(
        "torch_xla.experimental.splash_attention.splash_attention") + ": use "
        "F.scaled_dot_product_attention, or torchtpu.kernels.jax_op over JAX's splash kernel")


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
