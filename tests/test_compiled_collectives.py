"""Collectives inside compiled programs on the XLA transport (torchtpu/lowering/collectives.py,
compile/spmd.py, compile/eager_split.py, distributed/programs.py): a compiled graph holding
functional collectives is one SPMD program per rank, with XLA collectives inside, equal to the
same collectives computed on CPU; a tensor-parallel MLP compiles and trains like the CPU model;
ranks whose programs hold different collectives raise on every rank. Two processes on
localhost, started and stopped by the test (TORCHTPU_DIST_TRANSPORT=xla on XLA:CPU)."""

import pytest
import torch
from torch import nn

from torchtpu.distributed import CollectiveMismatchError
from torchtpu.distributed.spawn import run

XLA = {"TORCHTPU_DIST_TRANSPORT": "xla"}


def _input(rank):
    return torch.arange(24, dtype=torch.float32).reshape(8, 3) * (rank + 1) - 5


def _collectives(x, group):
    import torch.distributed._functional_collectives as funcol

    return (funcol.all_reduce(x, "sum", group), funcol.all_gather_tensor(x, 0, group),
            funcol.reduce_scatter_tensor(x * 2, "avg", 0, group),
            funcol.all_to_all_single(x, None, None, group), funcol.all_reduce(x, "max", group),
            funcol.all_reduce(x, "sum", group).sum())


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 6))


def _in_programs(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from torchtpu import metrics

    group = dist.group.WORLD
    fn = torch.compile(lambda x: _collectives(x, group), backend="tpu")
    x = _input(rank).to("tpu")
    fn(x)  # compiles, checks the signature across ranks
    seq, before = group._seq, metrics.snapshot()
    outs = fn(x)
    after = metrics.snapshot()
    counts = {"programs": after.get("collective_programs", 0)
              - before.get("collective_programs", 0),
              "eager_collectives": group._seq - seq}
    # Tensor parallel: Linear 1 column-wise, Linear 2 row-wise (its all_reduce in the graph).
    mesh = init_device_mesh("tpu", (world,))
    model = parallelize_module(_mlp().to("tpu"), mesh, {"0": ColwiseParallel(),
                                                        "2": RowwiseParallel()})
    compiled = torch.compile(model, backend="tpu")
    data = torch.randn(4, 6, generator=torch.Generator().manual_seed(3)).to("tpu")
    loss = compiled(data).square().mean()
    loss.backward()
    grads = [p.grad.full_tensor().cpu() for p in model.parameters()]
    return [o.cpu() for o in outs], counts, loss.detach().cpu(), grads


def _mismatched(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    # Rank 1 traced other code around its collective: a different shape.
    rows = 4 if rank == 0 else 6
    fn = torch.compile(lambda x: funcol.all_reduce(x * 2, "sum", group), backend="tpu")
    try:
        fn(torch.ones(rows, 2, device="tpu"))
    except CollectiveMismatchError as e:
        return str(e)
    return None


def _mpmd(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD

    @torch.compile(backend="tpu")
    def compiled(x):  # a different graph on each rank around the same collective
        y = x * 2 if rank == 0 else x.sin()
        return funcol.all_reduce(y, "sum", group) + 1

    return compiled(torch.arange(4.0, device="tpu")).cpu()


def _scenarios(rank, world):
    # One pair of processes for the three scenarios (each start costs seconds of imports); the
    # mismatch goes last: its programs never run.
    return _mpmd(rank, world), _in_programs(rank, world), _mismatched(rank, world)


@pytest.fixture(scope="module")
def results():
    return run(_scenarios, 2, env=XLA, pg_timeout=120, timeout=600)


def test_compiled_collectives_run_inside_one_program_per_rank(results):
    xs = [_input(r) for r in range(2)]
    total = xs[0] + xs[1]
    gathered = torch.cat(xs)
    for rank, (_, (outs, counts, loss, grads), _) in enumerate(results):
        expect = [total, gathered, (2 * total / 2).chunk(2)[rank],
                  torch.cat([x.chunk(2)[rank] for x in xs]), torch.maximum(*xs), total.sum()]
        for got, want in zip(outs, expect, strict=True):
            torch.testing.assert_close(got, want)
        # One program per call, no collective outside it (no header exchange after the first).
        assert counts == {"programs": 1, "eager_collectives": 0}, counts
        model = _mlp()
        data = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
        ref = model(data).square().mean()
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
        for g, p in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-5)


def test_ranks_compiling_other_collectives_raise_on_every_rank(results):
    for rank, (_, _, message) in enumerate(results):
        assert message is not None, rank
        assert "mismatched compiled programs in process group" in message
        assert f"rank(s) [{1 - rank}]" in message


def test_ranks_compiling_other_code_around_the_same_collectives_agree(results):
    x = torch.arange(4.0)
    for out, _, _ in results:
        torch.testing.assert_close(out, x * 2 + x.sin() + 1)
