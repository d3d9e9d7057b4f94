"""``torch_xla.version``: the PyTorch/XLA API level the layer's names follow."""

__version__ = "2.9.0+torchtpu"
