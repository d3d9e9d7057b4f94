"""The refusal every name the layer does not have gives: what it is and the torchtpu way.

A script that reaches for ``torch_xla.<something>`` this layer does not map gets an
``AttributeError`` (``hasattr`` probes keep working) or, for a module, a ``ModuleNotFoundError``
(``try: import ... except ImportError`` keeps working), whose text starts with
``torchtpu.unsupported:`` and names the call and what to use instead.
"""

from __future__ import annotations

from collections.abc import Callable

from torchtpu import errors

# What to use instead, for the PyTorch/XLA names scripts reach for most that have no mapping here.
HINTS: dict[str, str] = {
    "torch_xla._XLAC": "torch_xla's C++ bindings do not exist here (only "
                       "_xla_metrics_report and _get_xla_sharding_spec); "
                       "torch.tpu.pending_hlo() gives the pending program",
    "torch_xla.distributed.xla_backend": "dist.init_process_group('tpu_dist') "
                                         "(xmp.spawn / torch_xla.launch start it for you)",
    "torch_xla.distributed.fsdp": "torch.distributed.fsdp.fully_shard over "
                                  "init_device_mesh('tpu', ...) (docs, FSDP2)",
    "torch_xla.experimental.spmd_fully_sharded_data_parallel":
        "FSDPv2 is torch.distributed.fsdp.fully_shard(module, mesh=xs_mesh.device_mesh()) here, "
        "one process per device (docs, FSDP2)",
    "torch_xla.experimental.scan_layers": "a plain Python loop over the layers "
                                          "(torch.compile(backend='tpu') compiles it once)",
    "torch_xla.debug.profiler": "torch.profiler with ProfilerActivity.TPU (docs, profiler)",
    "torch_xla.amp": "torch.autocast('tpu', dtype=torch.bfloat16)",
    "torch_xla.core.xla_model.get_stablehlo": "torch.tpu.pending_hlo() (what DeferAndFuse "
                                              "holds, as StableHLO text)",
    "torch_xla.core.xla_model.optimization_barrier_": "torch.tpu.ops.optimization_barrier",
    "torch_xla.core.xla_model.all_to_all": "torch.distributed.all_to_all_single on 'tpu' tensors",
    "torch_xla.core.xla_model.send": "torch.distributed.send / isend on 'tpu' tensors",
    "torch_xla.core.xla_model.recv": "torch.distributed.recv / irecv on 'tpu' tensors",
    "torch_xla.core.xla_model.collective_permute": "torch.distributed.batch_isend_irecv",
}

GENERAL = ("torchtpu runs PyTorch/XLA scripts through a layer over its own API (docs, "
           "PyTorch/XLA scripts); use the torch or torch.tpu equivalent, or file an issue "
           "with the call")


def text(name: str) -> str:
    """The message for a PyTorch/XLA name this layer does not map."""
    hint = next((HINTS[k] for k in sorted(HINTS, key=len, reverse=True)
                 if name == k or name.startswith(k + ".")), GENERAL)
    return errors.message("unsupported", f"{name} is not in torchtpu's PyTorch/XLA layer: "
                          f"{hint}")


def module_getattr(module: str) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for the layer's ``module`` that refuses unmapped names."""

    def __getattr__(name: str):
        if name.startswith("__"):  # module protocol probes (__path__, __file__) stay plain
            raise AttributeError(name)
        raise AttributeError(text(f"{module}.{name}"))

    return __getattr__
