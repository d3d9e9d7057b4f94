"""torchtpu: XLA devices (TPU, GPU, CPU through PJRT) as the native PyTorch device "tpu".

Importing torchtpu (or plain ``import torch``, through the ``torch.backends`` entry point)
registers the device. Layers, one folder each, bottom up: ``runtime`` (PJRT platform and compile
cache), ``device`` (tensors, storages, transfers, RNG, memory), ``lowering`` (the one ATen -> JAX
table), ``eager`` (the executors), ``compile`` (the ``torch.compile`` backend), ``distributed``
(the process-group backend ``tpu_dist``), ``testing`` (conformance against CPU). ``tpu`` is
``torch.tpu``, the face of all of them.
"""

from torchtpu.registration import register as _register

_register()

from torchtpu import metrics  # noqa: E402
from torchtpu.device.loader import DeviceLoader  # noqa: E402
from torchtpu.layers import scan_layers  # noqa: E402

__all__ = ["DeviceLoader", "metrics", "scan_layers"]
