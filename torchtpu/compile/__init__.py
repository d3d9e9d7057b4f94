"""``torch.compile(backend="tpu")``: Dynamo + AOTAutograd graphs run as XLA programs.

Importing this package arranges for "tpu" to be registered with Dynamo (``registration``) the
moment Dynamo is first imported (``on_import``), so ``import torch`` stays free of Dynamo's import
cost. ``backend`` wires AOTAutograd, ``interpret`` turns one FX graph into one JAX function from
the lowering table, ``graph_ops`` holds the graph forms of eager's device kernels (views, copies,
allocation), ``dynamic`` pads symbolic sizes to buckets, ``options`` checks what the user passed;
``whole_step`` runs a compiled training-step function as one captured program per call.
"""

from torchtpu.compile import registration, whole_step
from torchtpu.compile.on_import import after_import
from torchtpu.lowering import elementwise

after_import("torch._dynamo", registration.register)
after_import("torch._inductor.inductor_prims", elementwise.register_inductor_prims)
whole_step.install()
