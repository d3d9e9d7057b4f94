"""Sharded data parallelism whose collectives torch.compile traces: ``simple_fsdp(module, mesh)``.

In torch 2.13 FSDP2's hooks (``fully_shard``) are always hidden from Dynamo
(``_dynamo_disable``; the ``skip_fsdp_hooks`` switch is gone), so a compiled ``fully_shard`` model
is cut at every all-gather and reduce-scatter, which run eagerly between the compiled pieces.
Here the sharding lives in the parameters instead (the idea of TorchTitan's SimpleFSDP): each
parameter is a DTensor sharded on dim 0 over the mesh, and a parametrization turns it into the
full tensor at each use (``redistribute`` to Replicate, then ``to_local`` with the gradient
declared a Partial average). Dynamo traces that as ``_c10d_functional.all_gather_into_tensor``
in the forward, and AOTAutograd derives ``reduce_scatter_tensor`` (avg) in the backward: on the
XLA transport the compiled forward and backward are each one SPMD program with the collectives
inside (``compile/spmd.py``), where XLA's scheduler may overlap them with compute. Gradients
and the optimizer stay on the shards, as with FSDP2. Eagerly it runs too (the DTensor
collectives go to the process group).

Meshes: 1-D (shard over it) or 2-D (replicate, shard): HSDP, the parameters sharded over the
second dim and replicated over the first, their gradients reduce-scattered within a shard
group and all-reduced across replicas. A parameter whose dim 0 the shard dim does not divide is
replicated over the whole mesh (its gradient all-reduced): every rank's program then sees the
same shapes, which an SPMD program needs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils import parametrize

from torchtpu import errors


class _Gathered(nn.Module):
    """The parametrization: a sharded DTensor parameter as the full local tensor, whose
    gradient flows back as the average over the mesh (reduce-scatter or all-reduce)."""

    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.replicated = (Replicate(),) * ndim
        self.grads = (Partial("avg"),) * ndim

    def forward(self, x: DTensor) -> torch.Tensor:
        return x.redistribute(placements=self.replicated).to_local(grad_placements=self.grads)


def _placements(param: torch.Tensor, mesh: DeviceMesh) -> tuple:
    shards = mesh.size(mesh.ndim - 1)
    shard = Shard(0) if param.dim() > 0 and param.shape[0] % shards == 0 else Replicate()
    return (Replicate(),) * (mesh.ndim - 1) + (shard,)


def _sharded(sub: nn.Module, name: str, param: torch.Tensor, mesh: DeviceMesh) -> nn.Parameter:
    if isinstance(param, DTensor) or parametrize.is_parametrized(sub, name):
        raise ValueError(errors.message(
            "argument", f"simple_fsdp: parameter {name!r} of {type(sub).__name__} is already "
            "distributed (a DTensor or parametrized); apply simple_fsdp once, to a model of "
            "plain parameters"))
    if param.device.type != mesh.device_type:
        raise ValueError(errors.message(
            "placement", f"simple_fsdp: parameter {name!r} of {type(sub).__name__} is on "
            f"{param.device}, the mesh on {mesh.device_type}: move the model first"))
    sharded = distribute_tensor(param.detach(), mesh, _placements(param, mesh))
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def simple_fsdp(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """module with every parameter sharded over mesh (see the module doc), in place; returns it.

    Call it on the whole model once, after moving it to its device; build the optimizer after.
    """
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
        raise ValueError(errors.message(
            "argument", f"simple_fsdp: mesh must be a 1-D (shard) or 2-D (replicate, shard) "
            f"DeviceMesh, got {mesh!r}"))
    # id -> (the original, kept alive so that its id is not reused; its sharded parameter): a
    # tied parameter (an embedding shared with the output head) stays tied.
    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for sub in list(module.modules()):
        for name, param in list(sub.named_parameters(recurse=False)):
            if id(param) not in done:
                done[id(param)] = (param, _sharded(sub, name, param, mesh))
            sub._parameters[name] = done[id(param)][1]
            parametrize.register_parametrization(sub, name, _Gathered(mesh.ndim), unsafe=True)
    return module
