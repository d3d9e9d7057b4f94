"""``torch_xla.experimental.stablehlo_custom_call``: ``place_to_host`` / ``place_to_device``
import, and refuse when called: they annotate a value for host-memory offload inside
PyTorch/XLA's traced graph, which torchtpu's programs do not take. Keep activations on the device
or checkpoint them (``torch.utils.checkpoint``; ``torch.tpu`` keeps a memory history to find what
to drop)."""

from __future__ import annotations

from torchtpu.integrations.torch_xla import _missing


def _refused(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(_missing.text(
            f"torch_xla.experimental.stablehlo_custom_call.{name}") + ": host offload of "
            "activations is not in torchtpu; checkpoint them (torch.utils.checkpoint) instead")
    call.__name__ = name
    return call


place_to_host = _refused("place_to_host")
place_to_device = _refused("place_to_device")

__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
