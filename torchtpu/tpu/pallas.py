"""``torch.tpu.pallas``: JAX and Pallas functions as torch ops (``kernels/jax_op.py``), and
unannotated JAX functions and bare Pallas kernels called on tpu tensors
(``kernels/custom_kernel.py``)."""

from torchtpu.kernels.custom_kernel import custom_jax_kernel, custom_kernel
from torchtpu.kernels.jax_op import jax_op

__all__ = ["custom_jax_kernel", "custom_kernel", "jax_op"]
