"""DTensor, tensor parallel and 2-D (FSDP x TP) meshes on device "tpu", ranks as threads.

Every result is compared with the same computation on local CPU tensors. Each test also runs
its ranks as processes over ``tpu_dist`` on request (``runners.py``).
"""

import copy

import pytest
import torch
from runners import ALL
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


def _dtensor_ops(rank, world, a, b):
    mesh = init_device_mesh("tpu", (world,))
    da = distribute_tensor(a.to("tpu"), mesh, [Shard(0)])
    db = distribute_tensor(b.to("tpu"), mesh, [Replicate()])
    assert da.to_local().shape == (a.shape[0] // world, a.shape[1])
    out = {
        "matmul": (da @ db).full_tensor(),  # Shard(0) @ Replicate stays sharded: no collective
        "sum": da.sum().full_tensor(),  # Partial -> all-reduce
        "softmax": torch.softmax(da, dim=0).full_tensor(),  # over the sharded dim
        "shard1": da.redistribute(mesh, [Shard(1)]).to_local(),  # all-to-all
        "replicate": da.redistribute(mesh, [Replicate()]).to_local(),  # all-gather
        "scaled": (da * 2 + 1).full_tensor(),
    }
    assert all(v.device.type == "tpu" for v in out.values())
    return {k: v.cpu() for k, v in out.items()}


@pytest.mark.parametrize("run", ALL)
def test_dtensor_ops_equal_local_reference(run):
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    for rank, out in enumerate(run(_dtensor_ops, 2, args=(a, b))):
        torch.testing.assert_close(out["matmul"], a @ b)
        torch.testing.assert_close(out["sum"], a.sum())
        torch.testing.assert_close(out["softmax"], torch.softmax(a, dim=0))
        torch.testing.assert_close(out["shard1"], a.chunk(2, dim=1)[rank])
        torch.testing.assert_close(out["replicate"], a)
        torch.testing.assert_close(out["scaled"], a * 2 + 1)


_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def _full_grads(model) -> list:
    return [p.grad.full_tensor().cpu() for p in model.parameters()]


def _tensor_parallel(rank, world, ref, x):
    mesh = init_device_mesh("tpu", (world,))
    model = parallelize_module(copy.deepcopy(ref).to("tpu"), mesh, _PLAN)
    assert model[0].weight.placements == (Shard(0),)
    assert model[2].weight.placements == (Shard(1),)
    y = model(x.to("tpu"))
    y.pow(2).sum().backward()
    return y.cpu(), _full_grads(model)


@pytest.mark.parametrize("run", ALL)
def test_tensor_parallel_mlp_equals_local(run):
    ref, x = _mlp(), torch.randn(8, 16)
    expected = ref(x)
    expected.pow(2).sum().backward()
    for y, grads in run(_tensor_parallel, 2, args=(ref, x)):
        torch.testing.assert_close(y, expected)
        for g, p in zip(grads, ref.parameters()):
            torch.testing.assert_close(g, p.grad)


def _fsdp_x_tp(rank, world, ref, x):
    mesh = init_device_mesh("tpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(copy.deepcopy(ref).to("tpu"), mesh["tp"], _PLAN)
    fully_shard(model, mesh=mesh["dp"])
    weight = model[0].weight
    assert isinstance(weight, DTensor) and weight.device_mesh.mesh_dim_names == ("dp", "tp")
    dp = mesh["dp"].get_local_rank()
    # FSDP averages over dp: each dp rank's half-batch loss is scaled to the full-batch sum.
    (model(x.chunk(2)[dp].to("tpu")).pow(2).sum() * 2).backward()
    return _full_grads(model)


@pytest.mark.parametrize("run", ALL)
def test_2d_mesh_fsdp_x_tp_equals_full_batch(run):
    ref, x = _mlp(), torch.randn(8, 16)
    ref(x).pow(2).sum().backward()
    for grads in run(_fsdp_x_tp, 4, args=(ref, x)):
        for g, p in zip(grads, ref.parameters()):
            torch.testing.assert_close(g, p.grad)
