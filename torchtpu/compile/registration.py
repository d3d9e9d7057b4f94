"""What Dynamo must know about "tpu": the backend name, the device interface, the default backend.

``register`` runs once, right after ``torch._dynamo`` is first imported
(``torchtpu/import_hooks.py``), so ``import torch`` does not load Dynamo. The backend itself
(``backend``, which imports AOTAutograd and the decompositions) loads at the first compile.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The device runtime runs inside PyTorch's dispatcher, also when a compiled function falls back
# to eager (a graph break): Dynamo must run those frames, never trace them as user code.
_RUNTIME_PACKAGES = ("torchtpu.device", "torchtpu.eager", "torchtpu.lowering",
                     "torchtpu.runtime", "torchtpu.compile", "torchtpu.metrics", "jax", "jaxlib")


def tpu(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None = None,
        options: dict | None = None) -> Callable:
    """The backend registered as "tpu": ``backend.tpu_backend``, imported at the first compile."""
    from torchtpu.compile.backend import tpu_backend

    return tpu_backend(gm, example_inputs, mode=mode, options=options)


def _on_device(example_inputs: list) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "tpu" for x in example_inputs)


def default_backend(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None = None,
                    options: dict | None = None) -> Callable:
    """``torch.compile`` without a backend: "tpu" for graphs on the device, else Inductor."""
    if _on_device(example_inputs):
        return tpu(gm, example_inputs, mode=mode, options=options)
    return torch._TorchCompileInductorWrapper(mode, options, None)(gm, example_inputs)


def register() -> None:
    """Register "tpu" with Dynamo (called once Dynamo is imported)."""
    from torch._dynamo import trace_rules
    from torch._dynamo.backends import registry

    from torchtpu.compile import device_interface

    for name in _RUNTIME_PACKAGES:
        trace_rules.add(name)
    registry.register_backend(tpu, name="tpu")
    device_interface.register()
    if hasattr(registry, "set_default_backend"):  # torch >= 2.13
        registry.set_default_backend(default_backend)
