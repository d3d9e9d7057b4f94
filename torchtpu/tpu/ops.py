"""``torch.tpu.ops``: device ops beyond ATen (``kernels/ops.py``)."""

from torchtpu.kernels.ops import (
    flash_attention,
    flash_sdpa,
    optimization_barrier,
    ragged_dot,
    rms_norm,
)

__all__ = ["flash_attention", "flash_sdpa", "optimization_barrier", "ragged_dot", "rms_norm"]
