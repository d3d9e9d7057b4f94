"""``torch.tpu.pallas``: JAX and Pallas functions as torch ops (``kernels/jax_op.py``)."""

from torchtpu.kernels.jax_op import jax_op

__all__ = ["jax_op"]
