"""``torch_xla.core.xla_builder``: ``call_jax`` imports, and refuses when called, naming
``torchtpu.kernels.jax_op`` (a JAX function as a torch op on tpu tensors, in every executor and
under torch.compile)."""

from __future__ import annotations

from torchtpu.integrations.torch_xla import _missing


def call_jax(jax_func, args, kwargs=None, name=None):
    raise NotImplementedError(_missing.text("torch_xla.core.xla_builder.call_jax") + ": make "
                              "the JAX function a torch op with torchtpu.kernels.jax_op")


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
