"""pytorch/examples' ``distributed/tensor_parallelism`` tensor- and sequence-parallel scripts'
pattern on device "tpu", against the same steps on CPU: a ``ToyModel`` MLP under
``ColwiseParallel`` / ``RowwiseParallel`` (and the sequence-parallel plan's ``Shard(0)``
layouts), forward, ``output.sum().backward()`` and AdamW(foreach) steps with no ``zero_grad``,
so each backward adds into the gradients the last step read.

That accumulation is what broke the examples (issue 49: "Array has been deleted" in a backward,
on both ranks, and in one process without any parallelism): on a9d310d the optimizer's fused
step placed a gradient made by a program with no inputs (not committed to a device) with
``device_put``, whose new array object shares the buffer, and donated it by that object's
reference count while the gradient's storage still held the old one; the next backward's held
accumulation (``eager/lazy_casts.py``) read the deleted buffer. The one-process cases reach it
without a process group; the two-rank ones run as threads here and as ``tpu_dist`` processes
(Strict and DeferAndFuse) in the ``full`` run.
"""

import contextlib
import copy

import pytest
import torch
from runners import OPT_IN, THREADS
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchtpu.distributed.spawn import run as run_processes

STEPS, ROWS = 4, 20
DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE


class ToyModel(nn.Module):
    """The examples' model."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


def _model() -> ToyModel:
    torch.manual_seed(0)
    return ToyModel()


def _inputs(world: int) -> list:
    """Each step's input per rank (the examples draw them on the device; here on CPU, so that
    CPU's run reads the same numbers)."""
    g = torch.Generator().manual_seed(0)
    return [[torch.rand(ROWS, 10, generator=g) for _ in range(world)] for _ in range(STEPS)]


def _train(model: nn.Module, steps: list, mode=None) -> list:
    """The examples' loop on tpu, in Strict or ``mode``: each step's output sum (what the
    backward differentiates)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.25, foreach=True)
    sums = []
    with contextlib.nullcontext() if mode is None else torch.tpu.set_eager_mode(mode):
        for x in steps:
            loss = model(x.to("tpu")).sum()
            loss.backward()
            opt.step()
            sums.append(loss.item())
    return sums


def _cpu(sequence: bool, world: int, inputs: list) -> tuple:
    """Each rank's sums and the final parameters of the unsharded model on CPU: tensor parallel
    computes every rank's output whole from the same input; sequence parallel, each rank's rows
    of the output of all ranks' inputs together."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.25, foreach=True)
    sums = []
    for xs in inputs:
        x = torch.cat(xs) if sequence else xs[0]
        out = model(x)
        out.sum().backward()
        opt.step()
        parts = out.detach().chunk(world) if sequence else [out.detach()] * world
        sums.append([p.sum().item() for p in parts])
    return [list(s) for s in zip(*sums)], [p.detach() for p in model.parameters()]


def _rank(rank: int, world: int, ref: nn.Module, sequence: bool, inputs: list,
          mode=None) -> tuple:
    # Built by the caller: ranks as threads share the default generator, so seeding it in each
    # rank would not give each the same weights.
    model = copy.deepcopy(ref)
    if sequence:
        plan = {"in_proj": ColwiseParallel(input_layouts=Shard(0)),
                "out_proj": RowwiseParallel(output_layouts=Shard(0))}
    else:
        plan = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    mesh = init_device_mesh("tpu", (world,))
    model = parallelize_module(model.to("tpu"), mesh, plan)
    steps = [xs[rank] if sequence else xs[0] for xs in inputs]
    return _train(model, steps, mode), [p.full_tensor().cpu() for p in model.parameters()]


def _check(results: list, expected_sums: list, expected_params: list) -> None:
    for rank, (sums, params) in enumerate(results):
        assert sums == pytest.approx(expected_sums[rank], rel=1e-4, abs=1e-4), rank
        for got, want in zip(params, expected_params):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", [None, DEFER], ids=["strict", "defer"])
def test_one_process_accumulating_steps_equal_cpu(mode):
    """No process group: the accumulation alone (it failed in the third backward)."""
    inputs = _inputs(1)
    expected, params = _cpu(False, 1, inputs)
    model = _model().to("tpu")
    sums = _train(model, [xs[0] for xs in inputs], mode)
    _check([(sums, [p.cpu() for p in model.parameters()])], expected, params)


@pytest.mark.parametrize("sequence", [False, True], ids=["tensor", "sequence"])
@pytest.mark.parametrize("run", [THREADS, OPT_IN])
def test_two_ranks_equal_cpu(run, sequence):
    inputs = _inputs(2)
    results = run(_rank, 2, args=(_model(), sequence, inputs))
    _check(results, *_cpu(sequence, 2, inputs))


@pytest.mark.full
@pytest.mark.parametrize("sequence", [False, True], ids=["tensor", "sequence"])
def test_two_rank_processes_under_defer_and_fuse_equal_cpu(sequence):
    inputs = _inputs(2)
    results = run_processes(_rank, 2, args=(_model(), sequence, inputs, DEFER),
                            timeout=400, pg_timeout=120)
    _check(results, *_cpu(sequence, 2, inputs))
