"""ATen op -> JAX lowerings, one module per op family; importing this fills the table."""

from torchtpu.lowering import elementwise  # noqa: F401
