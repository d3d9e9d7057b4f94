"""Compiled sharded training on the XLA transport (2 processes on localhost, XLA:CPU):
``simple_fsdp`` (torchtpu/distributed/simple_fsdp.py) compiles forward and backward to one
SPMD program each, the all-gathers and reduce-scatters inside, no eager collective;
``fully_shard`` (FSDP2, whose hooks torch 2.13 hides from Dynamo) over compiled layers trains
too, its collectives eager between the layers' programs. Both train like the single-process CPU
model on the full batch; program counts are deltas around one steady step."""

import pytest
import torch
from torch import nn

from torchtpu.testing.distributed import run
from torchtpu.testing.models import sgd_full_batch

XLA = {"TORCHTPU_DIST_TRANSPORT": "xla"}
STEPS = 3


def _model():
    torch.manual_seed(0)
    # 7 rows: the last Linear's weight and bias are not divisible over 2 ranks (replicated).
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 7))


def _data():
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(1))


def _reference():
    return sgd_full_batch(_model(), _data(), STEPS)


def _collectives(graphs: list):
    """A debug_callback that appends each compiled graph's collective ops, counted."""
    import collections

    def seen(gm, hlo):
        graphs.append(dict(collections.Counter(
            n.target.__name__.split(".")[0] for n in gm.graph.nodes
            if n.op == "call_function" and "c10d" in str(n.target)
            and n.target is not torch.ops._c10d_functional.wait_tensor.default)))

    return seen


def _steps(rank, world, model, compile_root=True, graphs=None):
    """Train STEPS steps; the losses, and the last step's compiled program launches and eager
    collectives (deltas around it)."""
    import torch.distributed as dist

    from torchtpu.runtime import launch

    group = dist.group.WORLD
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="tpu", options={
        "debug_callback": _collectives(graphs if graphs is not None else [])}) \
        if compile_root else model
    x = _data().chunk(world)[rank].to("tpu")
    launched: list = []
    launch.observer = torch._dynamo.disable(
        lambda label, fn, args: (launched.append(str(label)), fn(*args))[1])
    losses = []
    try:
        for _ in range(STEPS):
            launched.clear()
            seq = group._seq
            loss = compiled(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().cpu())
    finally:
        launch.observer = None
    programs = sorted(label.rsplit("_", 1)[0] for label in launched
                      if label.startswith("compiled_"))
    return torch.stack(losses), programs, group._seq - seq


def _train(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchtpu import metrics
    from torchtpu.distributed.simple_fsdp import simple_fsdp

    mesh = init_device_mesh("tpu", (world,))
    model = simple_fsdp(_model().to("tpu"), mesh)
    before = metrics.snapshot()
    graphs: list = []
    simple = (*_steps(rank, world, model, graphs=graphs), graphs)
    in_programs = (metrics.snapshot().get("collective_programs", 0)
                   - before.get("collective_programs", 0))
    params = [p.full_tensor().cpu() for p in model.parameters()]
    # As TorchTitan does: each layer compiled, then sharded (its hooks outside the graph).
    model = _model().to("tpu")
    for i in (0, 2):
        model[i] = fully_shard(torch.compile(model[i], backend="tpu"), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return simple, in_programs, params, _steps(rank, world, model, compile_root=False)


def test_compiled_sharded_training_equals_cpu():
    ref_losses, ref_params = _reference()
    results = run(_train, 2, env=XLA, pg_timeout=120, timeout=500)
    # Equal per-rank batches: the mean of the ranks' losses is the full batch's.
    torch.testing.assert_close(torch.stack([r[0][0] for r in results]).mean(0), ref_losses)
    for rank, (simple, in_programs, params, cut) in enumerate(results):
        losses, programs, eager, graphs = simple
        # Each graph's collectives combined (compile/spmd.combine): the forward's two
        # all-gathers (Linear 1's weight and bias) are one, and so are the backward's two
        # reduce-scatters and the two all-reduces of Linear 2's replicated weight and bias.
        assert graphs == [{"all_gather_into_tensor": 1},
                          {"all_reduce": 1, "reduce_scatter_tensor": 1}], (rank, graphs)
        for got, want in zip(params, ref_params, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # One forward and one backward program, every collective inside them.
        assert programs == ["compiled_backward", "compiled_forward"], (rank, programs)
        assert eager == 0, (rank, eager)
        assert in_programs == 2 * STEPS, (rank, in_programs)
        cut_losses, cut_programs, cut_eager = cut
        torch.testing.assert_close(cut_losses, losses, atol=1e-5, rtol=1e-5)
        # fully_shard: each layer's forward and backward program, and FSDP2's collectives
        # eagerly between them (per layer: the forward's all-gather, backward's all-gather
        # again after resharding, and the reduce-scatter).
        assert cut_programs == ["compiled_backward"] * 2 + ["compiled_forward"] * 2, (
            rank, cut_programs)
        assert cut_eager == 6, (rank, cut_eager)


def test_simple_fsdp_refuses_a_mesh_that_is_none():
    from torchtpu.distributed.simple_fsdp import simple_fsdp

    with pytest.raises(ValueError, match="torchtpu.argument: simple_fsdp: mesh must be"):
        simple_fsdp(_model(), None)


def _hsdp(rank, world):
    """HSDP on a (replicate, shard) mesh of 2 slices x 2 ranks: FSDP2 eagerly and simple_fsdp
    compiled; each one's losses and the collectives per step on each mesh dim's group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from torchtpu.distributed.simple_fsdp import simple_fsdp
    from torchtpu.distributed.topology import topology_aware_mesh

    ranks = topology_aware_mesh((1, 2), topology="multi_slice", dcn_mesh_shape=(2, 1))
    mesh = DeviceMesh("tpu", ranks, mesh_dim_names=("replicate", "shard"))
    groups = [mesh.get_group(d) for d in ("replicate", "shard")]
    x = _data().chunk(world)[rank].to("tpu")
    out = {}
    for name, model in (("fully_shard", fully_shard(_model().to("tpu"), mesh=mesh)),
                        ("simple_fsdp", simple_fsdp(_model().to("tpu"), mesh))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        call = model if name == "fully_shard" else torch.compile(model, backend="tpu")
        losses = []
        for _ in range(STEPS):
            seqs = [g._seq for g in groups]
            loss = call(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().cpu())
        out[name] = (torch.stack(losses), [g._seq - s for g, s in zip(groups, seqs)])
    dist.barrier()
    return out


@pytest.mark.full
def test_hsdp_on_two_slices_equals_cpu_with_one_cross_slice_reduction_per_step():
    ref_losses, _ = _reference()
    results = run(_hsdp, 4, env=XLA, pg_timeout=240, timeout=900)
    for name in ("fully_shard", "simple_fsdp"):
        torch.testing.assert_close(torch.stack([r[name][0] for r in results]).mean(0),
                                   ref_losses, atol=1e-5, rtol=1e-5)
    for rank, r in enumerate(results):
        # fully_shard on the root alone: one parameter group, so per step one all-reduce across
        # slices, and within the slice the forward's all-gather and the gradients'
        # reduce-scatter (the root keeps its gathered parameters for backward).
        assert r["fully_shard"][1] == [1, 2], (rank, r["fully_shard"][1])
