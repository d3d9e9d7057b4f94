"""What Dynamo must know about "tpu": the backend name, the device interface, and that Inductor
(named, or torch.compile's default) hands graphs on the device to "tpu".

``register`` runs once, right after ``torch._dynamo`` is first imported
(``torchtpu/import_hooks.py``), so ``import torch`` does not load Dynamo. The backend itself
(``backend``, which imports AOTAutograd and the decompositions) loads at the first compile.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchtpu import metrics

# The device runtime runs inside PyTorch's dispatcher, also when a compiled function falls back
# to eager (a graph break): Dynamo must run those frames, never trace them as user code.
_RUNTIME_PACKAGES = ("torchtpu.device", "torchtpu.eager", "torchtpu.lowering",
                     "torchtpu.runtime", "torchtpu.compile", "torchtpu.metrics", "jax", "jaxlib")


def tpu(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None = None,
        options: dict | None = None) -> Callable:
    """The backend registered as "tpu": ``backend.tpu_backend``, imported at the first compile."""
    from torchtpu.compile.backend import tpu_backend

    phase = metrics.Phase("aot").start()  # AOTAutograd and the graphs' plans, as warm-ups split
    try:
        return tpu_backend(gm, example_inputs, mode=mode, options=options)
    finally:
        _backend_seconds[0] += phase.stop()


_backend_seconds = [0.0]  # the backend's calls, inside Dynamo's compiles


def _dynamo_seconds() -> dict:
    """Dynamo's own work on the frames it compiled (tracing bytecode, guards), for
    ``metrics.snapshot``: its own timer of each compile (which ``torch._dynamo.reset()`` keeps,
    unlike its compile callbacks) less the backend's calls inside them."""
    from torch._dynamo.utils import compilation_time_metrics

    total = sum(compilation_time_metrics.get("_compile.compile_inner", ()))
    return {"dynamo_seconds": total - _backend_seconds[0]}


def _on_device(example_inputs: list) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "tpu" for x in example_inputs)


def _route_inductor_on_device() -> None:
    """``backend="inductor"`` (also torch.compile's default) compiles graphs on tpu with "tpu".

    Inductor has no code generator for this device, and scripts written for CUDA name it
    (TorchTitan passes ``backend=compile.backend``, "inductor" by default); graphs off the
    device still go to Inductor. The mode and options given travel with the graph, so Inductor
    modes are refused by name (``options.parse``) as with ``backend="tpu"``.
    """
    wrapper = torch._TorchCompileInductorWrapper
    if getattr(wrapper, "_torchtpu_routed", False):
        return
    inductor_init, inductor_call = wrapper.__init__, wrapper.__call__

    def __init__(self, mode, options, dynamic, *args, **kwargs):
        inductor_init(self, mode, options, dynamic, *args, **kwargs)
        self._torchtpu_request = (mode, options)

    def __call__(self, model_, inputs_):
        if _on_device(inputs_):
            mode, options = getattr(self, "_torchtpu_request", (None, None))
            return tpu(model_, inputs_, mode=mode, options=options)
        return inductor_call(self, model_, inputs_)

    wrapper.__init__, wrapper.__call__ = __init__, __call__
    wrapper._torchtpu_routed = True


def register() -> None:
    """Register "tpu" with Dynamo (called once Dynamo is imported)."""
    from torch._dynamo import trace_rules
    from torch._dynamo.backends import registry

    from torchtpu.compile import device_interface

    for name in _RUNTIME_PACKAGES:
        trace_rules.add(name)
    registry.register_backend(tpu, name="tpu")
    device_interface.register()
    _route_inductor_on_device()
    metrics.add_source(_dynamo_seconds)
