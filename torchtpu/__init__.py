"""torchtpu: XLA devices (TPU, GPU, CPU through PJRT) as the native PyTorch device "tpu".

Importing torchtpu (or plain ``import torch``, through the ``torch.backends`` entry point)
registers the device. Layers, one folder each: ``runtime`` (PJRT platform and compile cache),
``device`` (tensors, storages, transfers, RNG, ``torch.tpu``), ``lowering`` (the one ATen -> JAX
table), ``eager`` (the executors), ``testing`` (conformance against CPU).
"""

from torchtpu.device.registration import register as _register

_register()

from torchtpu import compile as _compile  # noqa: E402, F401 (the "tpu" torch.compile backend)
from torchtpu import metrics  # noqa: E402
from torchtpu.device.loader import DeviceLoader  # noqa: E402

__all__ = ["DeviceLoader", "metrics"]
