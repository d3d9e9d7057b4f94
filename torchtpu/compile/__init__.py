"""``torch.compile(backend="tpu")``: Dynamo + AOTAutograd graphs run as XLA programs.

Importing this package registers the backend name "tpu" with Dynamo and the Dynamo device
interface for "tpu". ``backend`` wires AOTAutograd, ``interpret`` turns one FX graph into one
JAX function from the lowering table, ``graph_ops`` holds the graph forms of eager's device
kernels (views, copies, allocation), ``options`` checks what the user passed.
"""

from torchtpu.compile import backend, device_interface

device_interface.register()
backend.install_default_backend()

__all__ = ["backend"]
