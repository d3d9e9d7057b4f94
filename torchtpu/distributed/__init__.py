"""torch.distributed on the tpu device: the process-group backend ``tpu_dist`` (alias ``tpu``).

``register()`` (run when torchtpu loads) makes ``dist.init_process_group("tpu_dist")`` work and
makes it the default backend for device "tpu": ``init_process_group()`` with no backend picks it,
and ``"cpu:gloo,tpu:tpu_dist"`` serves CPU tensors by gloo in the same group. Layers: ``group``
(the ProcessGroup), ``protocol`` (the header that catches mismatched collectives), ``host`` (the
host transport through gloo), ``xla`` (the XLA transport: XLA collective programs),
``jax_runtime`` (which transport, and JAX's multi-process runtime), ``launch`` (the backend
creator and start-up).
"""

from __future__ import annotations

import importlib

import torch.distributed as dist

BACKENDS = ("tpu_dist", "tpu")

# The process group's own modules. C++ callers (DDP's buffer broadcast and reducer, c10d's
# coalesced ops) enter them through PyTorch's trampoline also while a compiled function runs
# its eager parts, where Dynamo would try to trace their frames as user code (and fail on the
# group, an opaque object to it): Dynamo must run them, as it runs the device runtime.
# ``simple_fsdp``, ``topology``, ``dtensor_sdpa`` and ``spawn`` are user-facing and stay traceable.
_TRANSPORT = ("group", "group_core", "host", "p2p", "protocol", "work", "xla", "programs",
              "jax_runtime", "launch", "device_binding", "solo")


def _in_program(nodes: list):
    from torchtpu.distributed import programs  # the XLA transport's modules load on first use

    return programs.resolve(nodes)


def _hide_transport_from_dynamo() -> None:
    from torch._dynamo import trace_rules

    for name in _TRANSPORT:
        trace_rules.add(f"{__name__}.{name}")


def _create(*args, **kwargs):
    """The backend creator (``launch.create``), imported when a group is made."""
    from torchtpu.distributed.launch import create

    return create(*args, **kwargs)


def register() -> None:
    """Register tpu_dist (and its alias tpu) with torch.distributed, without importing JAX (at
    ``import torch``); idempotent."""
    for name in BACKENDS:
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, _create, extended_api=True, devices=["tpu"])
    from torchtpu.distributed import solo  # torch only: groups of one process (solo.py)

    solo.register()


def load() -> None:
    """What waits for the device to load: collectives in compiled graphs, DTensor's rules."""
    from torchtpu.compile import eager_split
    from torchtpu.distributed import dtensor_sdpa, fsdp_capture
    from torchtpu.eager import capture
    from torchtpu.import_hooks import after_import
    from torchtpu.lowering import collectives

    # Under torch.compile, Dynamo turns collectives into _c10d_functional ops: on the XLA
    # transport they stay inside the graph's program, else they run eagerly between compiled
    # pieces (compile/eager_split, distributed/programs).
    collectives.register()
    eager_split.run_eagerly("_c10d_functional", _in_program)
    # Tensor-parallel attention: DTensor's sharding rules for the tpu's fused SDPA op.
    after_import("torch.distributed.tensor", dtensor_sdpa.register)
    after_import("torch._dynamo", _hide_transport_from_dynamo)
    # FSDP2's per-step state rolled back when a captured step aborts (fsdp_capture).
    if fsdp_capture.reset_after_abort not in capture.ON_ABORT:
        capture.ON_ABORT.append(fsdp_capture.reset_after_abort)


# Names whose modules import JAX: they load on first access.
_LAZY = {"Transport": "torchtpu.distributed.jax_runtime",
         "CollectiveMismatchError": "torchtpu.distributed.protocol"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKENDS", "CollectiveMismatchError", "Transport", "load", "register"]
