"""``torch_xla.experimental.scan_layers``: ``scan_layers(layers, input_data, ...)``.

PyTorch/XLA compiles the first layer once and scans it over the stacked weights of all of them.
Here the layers run in a Python loop, each on the previous one's output (a tuple is passed as
the positional arguments, as ``torch.func.functional_call`` passes it): the same values, one
program per layer call (``torch.compile(backend="tpu")`` compiles the loop as one graph;
``torchtpu.layers`` scans layers for real). ``partition_fn`` and ``is_layer_pure`` concern how
PyTorch/XLA traces the scan and change nothing here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from torchtpu.integrations.torch_xla import _missing


def scan_layers(layers: Iterable[torch.nn.Module], input_data, partition_fn=None,
                is_layer_pure: bool = False):
    """The output of the last of ``layers``, applied in order to ``input_data``."""
    layers = list(layers)
    if not layers:
        raise ValueError("torchtpu.argument: scan_layers needs at least one layer")
    for layer in layers:
        input_data = layer(*input_data) if isinstance(input_data, tuple) else layer(input_data)
    return input_data


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
