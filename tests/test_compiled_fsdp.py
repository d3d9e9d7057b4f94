"""Compiled sharded training on the XLA transport (2 processes on localhost, XLA:CPU):
``simple_fsdp`` (torchtpu/distributed/simple_fsdp.py) compiles forward and backward to one
SPMD program each, the all-gathers and reduce-scatters inside, no eager collective;
``fully_shard`` (FSDP2, whose hooks torch 2.13 hides from Dynamo) over compiled layers trains
too, its collectives eager between the layers' programs. Both train like the single-process CPU
model on the full batch; program counts are deltas around one steady step."""

import pytest
import torch
from torch import nn

from torchtpu.distributed.spawn import run
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

    from torchtpu.device.hooks import HOOKS

    group = dist.group.WORLD
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="tpu", options={
        "debug_callback": _collectives(graphs if graphs is not None else [])}) \
        if compile_root else model
    x = _data().chunk(world)[rank].to("tpu")
    launched: list = []
    HOOKS.launch_observer = torch._dynamo.disable(
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
        HOOKS.launch_observer = None
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


@pytest.mark.full  # 150-290 s here (4 processes on 2 cores, loads 15-30)
def test_hsdp_whole_step_is_one_program_over_the_2d_mesh_with_one_cross_slice_reduction():
    results = run(_whole_step, 4, args=(True,), env=XLA, pg_timeout=240, timeout=900)
    _check_whole_step(results)
    # One program over the (replicate, shard) mesh, devices [[0, 1], [2, 3]]: its collectives
    # on each dim, by the replica groups XLA sees. Merged (eager/spanning.py, looking through
    # the collectives each gradient goes through): within a slice one all-gather (Linear 1's
    # weight and bias), one reduce-scatter (their gradients), one all-reduce of Linear 2's
    # replicated gradients and the clipping norm's; across slices ONE all-reduce, of every
    # gradient (DTensor reduces across slices first).
    within, across = "[[0, 1], [2, 3]]", "[[0, 2], [1, 3]]"
    for rank, r in enumerate(results):
        assert r[5] == {("all_gather", within): 1, ("reduce_scatter", within): 1,
                        ("all_reduce", within): 2, ("all_reduce", across): 1}, (rank, r[5])


def _adamw_reference(steps: int):
    """The CPU model trained on the full batch with the whole step's clipping and AdamW."""
    model, x = _model(), _data()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach() for p in model.parameters()]


WHOLE_STEPS = 4  # the first two capture (the first creates AdamW's state), the rest replay


def _hlo_collectives(hlo: str) -> dict:
    """{(op, its replica groups): count} of a StableHLO program's collectives."""
    import collections
    import re

    found = re.findall(r'"stablehlo\.(all_gather|reduce_scatter|all_reduce)"[^\n]*?'
                       r"replica_groups = dense<([^>]*)>", hlo)
    return dict(collections.Counter(found))


def _sharded(mesh, fsdp2: bool | str):
    """The test model sharded over mesh: simple_fsdp, or FSDP2 on Linear 1 and the root
    (``fsdp2="compiled"``: Linear 1 compiled first, as TorchTitan compiles each block)."""
    from torch.distributed.fsdp import fully_shard

    from torchtpu.distributed.simple_fsdp import simple_fsdp

    if not fsdp2:
        return simple_fsdp(_model().to("tpu"), mesh)
    model = _model().to("tpu")
    if fsdp2 == "compiled":
        model[0] = torch.compile(model[0], backend="tpu")
    fully_shard(model[0], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp_tp(mesh):
    """The test model tensor-parallel over mesh["tp"] (Linear 1 by columns, Linear 2 by rows),
    then FSDP2 over mesh["dp"]: 2-D FSDP x TP."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _model().to("tpu")
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return fully_shard(model, mesh=mesh["dp"])


def _whole_step(rank, world, hsdp=False, fsdp2=False, tp=False):
    """simple_fsdp's (or FSDP2's) whole step (forward, backward, clipping, AdamW) compiled, on
    a 1-D mesh, HSDP's (replicate, shard) mesh of 2 slices or (``tp``) FSDP2 x TP's (dp, tp)
    mesh: the losses, the trained parameters, the warnings, the last step's counts (deltas
    around it; eager collectives per mesh dim) and the kept program's collectives by replica
    groups."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from torchtpu import metrics
    from torchtpu.device.hooks import HOOKS
    from torchtpu.distributed.topology import topology_aware_mesh

    replicas = world
    if hsdp:
        ranks = topology_aware_mesh((1, 2), topology="multi_slice", dcn_mesh_shape=(2, 1))
        mesh = DeviceMesh("tpu", ranks, mesh_dim_names=("replicate", "shard"))
        groups = [mesh.get_group(d) for d in ("replicate", "shard")]
    elif tp:  # 2 x 2: the ranks of one tp group see the same batch
        mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
        groups, replicas = [mesh.get_group(d) for d in ("dp", "tp")], 2
    else:
        mesh, groups = init_device_mesh("tpu", (world,)), [dist.group.WORLD]
    model = _fsdp_tp(mesh) if tp else _sharded(mesh, fsdp2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def train_step(x):
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return loss

    step = torch.compile(train_step, backend="tpu")
    x = _data().chunk(replicas)[rank * replicas // world].to("tpu")
    losses, launched = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(WHOLE_STEPS):
            launched.clear()
            seqs, before = [g._seq for g in groups], metrics.snapshot()
            HOOKS.launch_observer = torch._dynamo.disable(
                lambda label, fn, args: (launched.append(str(label)), fn(*args))[1])
            try:
                loss = step(x)
            finally:
                HOOKS.launch_observer = None
            after = metrics.snapshot()
            losses.append(loss.cpu())
    counts = {k: after.get(k, 0) - before.get(k, 0)
              for k in ("executions", "collective_programs", "captures")}
    counts["eager_collectives"] = [g._seq - s for g, s in zip(groups, seqs, strict=True)]
    params = [p.full_tensor().cpu() for p in model.parameters()]
    (kept,) = step._steps.values()
    collectives = _hlo_collectives(kept.captured.hlo())
    dist.barrier()
    return (torch.stack(losses), params, [str(w.message) for w in caught], counts,
            [label.split("[")[0] for label in launched], collectives)


def _check_whole_step(results: list) -> None:
    """Each rank's whole step trained as CPU AdamW on the full batch, in one launch a step."""
    ref_losses, ref_params = _adamw_reference(WHOLE_STEPS)
    torch.testing.assert_close(torch.stack([r[0] for r in results]).mean(0), ref_losses,
                               atol=1e-5, rtol=1e-5)
    for rank, (_, params, caught, counts, launched, _) in enumerate(results):
        for got, want in zip(params, ref_params, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not [w for w in caught if "cannot run as one captured program" in w], caught
        # A steady step: one launch, the captured SPMD program with every collective inside,
        # no eager collective on any group, nothing captured again.
        assert launched == ["captured_graph"], (rank, launched)
        assert counts == {"executions": 1, "collective_programs": 1, "captures": 0,
                          "eager_collectives": [0] * len(counts["eager_collectives"])}, (
            rank, counts)


def _captured_mpmd_and_mismatch(rank, world):
    """torch.tpu.graph of a collective: ranks capturing other code around the same all_reduce
    agree; ranks whose all_reduce differs only in what the header does not carry (PREMUL_SUM's
    factor) raise at the first replay, on every rank."""
    import torch.distributed as dist

    from torchtpu.distributed import CollectiveMismatchError

    x = torch.arange(4.0, device="tpu")
    out = torch.empty(4, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        y = x * 2 if rank == 0 else x.sin()
        dist.all_reduce(y)
        out.copy_(y + 1)
    g.replay()
    agreed = out.cpu()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        dist.all_reduce(x.clone(), op=dist._make_nccl_premul_sum(1.0 + rank))
    try:
        g.replay()
    except CollectiveMismatchError as e:
        return agreed, str(e)
    return agreed, None


def _whole_step_scenarios(rank, world):
    return _whole_step(rank, world), _captured_mpmd_and_mismatch(rank, world)


@pytest.mark.full  # 92-148 s on this shared 2-core box (loads 16-30): over the default budget
def test_sharded_whole_step_is_one_program_per_rank_and_equals_cpu():
    results = run(_whole_step_scenarios, 2, env=XLA, pg_timeout=120, timeout=500)
    _check_whole_step([r[0] for r in results])
    x = torch.arange(4.0)
    for rank, (whole, (agreed, mismatch)) in enumerate(results):
        # Merged (eager/spanning.py): Linear 1's weight and bias gathered by one all-gather,
        # their gradients reduce-scattered by one, Linear 2's replicated gradients all-reduced
        # by one; the clipping norm's all-reduce waits for those, so it is its own.
        g = "[[0, 1]]"
        assert whole[5] == {("all_gather", g): 1, ("reduce_scatter", g): 1,
                            ("all_reduce", g): 2}, (rank, whole[5])
        torch.testing.assert_close(agreed, x * 2 + x.sin() + 1)
        assert mismatch is not None, rank
        assert "mismatched compiled programs in process group" in mismatch
        assert f"rank(s) [{1 - rank}]" in mismatch
