"""``torch_xla._internal``: ``jax_workarounds`` (what scripts reach of PyTorch/XLA's internals)."""

from torchtpu.integrations.torch_xla._internal import jax_workarounds  # noqa: F401
