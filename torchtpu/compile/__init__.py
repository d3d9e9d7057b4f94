"""``torch.compile(backend="tpu")``: Dynamo + AOTAutograd graphs run as XLA programs.

``install()`` (called by ``torchtpu/registration.py``, the one place that wires torchtpu into
PyTorch) arranges for "tpu" to be registered with Dynamo (``registration``) the moment Dynamo is
first imported (``torchtpu/import_hooks.py``), so ``import torch`` stays free of Dynamo's import
cost, and, unless ``TORCHTPU_EAGER_BUCKETS=0``, serves eager op calls whose sizes grow from size
buckets (``eager_buckets``).
``backend`` wires AOTAutograd, ``graph_function`` turns one FX graph into one JAX function from
the lowering table and its graph forms of eager's device kernels (views, copies, allocation:
``lowering/graph_forms.py``), ``dynamic`` pads symbolic sizes to buckets, ``options`` checks
what the user passed; ``whole_step`` runs a compiled training-step function as one captured
program per call.
"""

import functools

import torch

from torchtpu import settings
from torchtpu.import_hooks import after_import


def _register_with_dynamo() -> None:
    from torchtpu.compile import registration

    registration.register()


def _register_inductor_prims() -> None:
    from torchtpu.lowering import elementwise

    elementwise.register_inductor_prims()


def _route_whole_steps() -> None:
    """``torch.compile(fn, backend="tpu")`` of a step function is a ``whole_step.WholeStep``
    (decided in ``whole_step``, imported at the first such compile)."""
    original = torch.compile
    if getattr(original, "_torchtpu_whole_step", False):
        return

    @functools.wraps(original)
    def compile_(model=None, **kwargs):
        if model is None:
            return lambda fn: compile_(fn, **kwargs)
        if kwargs.get("backend") == "tpu":
            from torchtpu.compile import torch_caches, whole_step

            # Before Dynamo looks for a precompiled function (graph_cache places it for other
            # compiles of tpu graphs); not at Dynamo's import, which PyTorch's meta kernels
            # cause at the first eager op: the user's environment stays as it was till then.
            torch_caches.place()
            return whole_step.compile_step(original, model, kwargs)
        return original(model, **kwargs)

    compile_._torchtpu_whole_step = True
    torch.compile = compile_


def install() -> None:
    """Register "tpu" with Dynamo once it is imported, route whole-step compiles, and keep
    activation checkpointing's recomputation from being merged back (``checkpoint``). Nothing
    here imports JAX: ``import torch`` runs it."""
    from torchtpu.compile import checkpoint

    after_import("torch._dynamo", _register_with_dynamo)
    after_import("torch._inductor.inductor_prims", _register_inductor_prims)
    _route_whole_steps()
    checkpoint.install()


def load() -> None:
    """What waits for the device to load: eager calls over growing sizes run in size buckets
    (``TORCHTPU_EAGER_BUCKETS=0``: never), Strict's optimizer steps run as one program each
    (``optimizer_steps``; ``TORCHTPU_FUSED_STEPS=0``: never)."""
    from torchtpu.compile import eager_buckets, optimizer_steps

    eager_buckets.set_enabled(settings.EAGER_BUCKETS.get())
    optimizer_steps.install()
