"""``torchtpu.pallas``: ``jax_op``, the same as ``torch.tpu.pallas``."""

from torchtpu.kernels.jax_op import jax_op

__all__ = ["jax_op"]
