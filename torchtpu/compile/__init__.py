"""``torch.compile(backend="tpu")``: Dynamo + AOTAutograd graphs run as XLA programs.

``install()`` (called by ``torchtpu/registration.py``, the one place that wires torchtpu into
PyTorch) arranges for "tpu" to be registered with Dynamo (``registration``) the moment Dynamo is
first imported (``torchtpu/import_hooks.py``), so ``import torch`` stays free of Dynamo's import
cost, and, unless ``TORCHTPU_EAGER_BUCKETS=0``, serves eager op calls whose sizes grow from size
buckets (``eager_buckets``).
``backend`` wires AOTAutograd, ``graph_function`` turns one FX graph into one JAX function from
the lowering table, ``graph_ops`` holds the graph forms of eager's device kernels (views,
copies, allocation), ``dynamic`` pads symbolic sizes to buckets, ``options`` checks what the
user passed; ``whole_step`` runs a compiled training-step function as one captured program per
call.
"""

import os

from torchtpu.compile import checkpoint, eager_buckets, registration, whole_step
from torchtpu.import_hooks import after_import
from torchtpu.lowering import elementwise


def install() -> None:
    """Register "tpu" with Dynamo once it is imported, route whole-step compiles, and keep
    activation checkpointing's recomputation from being merged back (``checkpoint``)."""
    after_import("torch._dynamo", registration.register)
    after_import("torch._inductor.inductor_prims", elementwise.register_inductor_prims)
    whole_step.install()
    checkpoint.install()
    # Eager calls over growing sizes run in size buckets (TORCHTPU_EAGER_BUCKETS=0: never).
    eager_buckets.set_enabled(os.environ.get("TORCHTPU_EAGER_BUCKETS", "1") != "0")
