"""``torch_tpu._internal.pallas``: ``jax_op``, ``custom_jax_kernel``, ``custom_kernel``
(``torch.tpu.pallas``)."""

from torchtpu.tpu.pallas import custom_jax_kernel, custom_kernel, jax_op

__all__ = ["custom_jax_kernel", "custom_kernel", "jax_op"]
