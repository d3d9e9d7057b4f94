"""What XLA's memory analysis says of a program torchtpu built: temporaries, arguments, outputs.

``temp_bytes(stablehlo)`` compiles StableHLO text (a compiled graph's, as
``torch.compile(..., options={"debug_callback": ...})`` hands it; a capture's, from
``TPUGraph.captured().hlo()``) for the first device and returns ``temp_size_in_bytes`` of the
compiled executable: the bytes the program needs beyond its inputs and outputs, where the
activations a training step keeps for its backward live when forward and backward are one
program. Used by the activation-checkpointing tests and ``bench/compile_depth.py``.
"""

from __future__ import annotations

import jax.extend
from jax._src import compiler
from jax._src.interpreters import mlir
from jax._src.lib import xla_client


def memory_stats(stablehlo: str):
    """XLA's compiled-memory statistics of the program (``CompiledMemoryStats``)."""
    backend = jax.extend.backend.get_backend()
    with mlir.make_ir_context():
        module = mlir.ir.Module.parse(stablehlo)
        data = mlir.module_to_bytecode(module)
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    devices = xla_client.DeviceList(tuple(backend.local_devices()[:1]))
    return backend.compile_and_load(data, devices, options).get_compiled_memory_stats()


def temp_bytes(stablehlo: str) -> int:
    """The program's temporary bytes (XLA's ``temp_size_in_bytes``)."""
    return int(memory_stats(stablehlo).temp_size_in_bytes)
