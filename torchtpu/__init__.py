"""torchtpu: XLA devices (TPU, GPU, CPU through PJRT) as the native PyTorch device "tpu".

Importing torchtpu (or plain ``import torch``, through the ``torch.backends`` entry point)
registers the device without importing JAX: the kernels and the lowering table load at the first
tpu op (``registration.py``). Layers, one folder each, bottom up: ``runtime`` (PJRT platform),
``cache`` (compile cache, warm starts) and ``targets`` (compile-only TPU targets) above it,
``device`` (tensors, storages, transfers, RNG, memory), ``lowering`` (the one ATen -> JAX table),
``eager`` (the executors), ``compile`` (the ``torch.compile`` backend), ``distributed`` (the
process-group backend ``tpu_dist``), ``testing`` (conformance against CPU).
``tpu`` is ``torch.tpu``, the face of all of them.
"""

import importlib

from torchtpu.registration import register as _register

_register()

# Names whose modules import JAX: they load on first access.
_LAZY = {"DeviceLoader": "torchtpu.device.loader", "scan_layers": "torchtpu.layers"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "metrics":
        return importlib.import_module("torchtpu.metrics")
    raise AttributeError(f"module 'torchtpu' has no attribute {name!r}")


__all__ = ["DeviceLoader", "metrics", "scan_layers"]
