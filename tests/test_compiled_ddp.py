"""``torch.compile(DDP(model))`` on the XLA transport (2 processes on localhost, XLA:CPU) trains
like single-process training on the full batch, in the three modes Dynamo has for DDP:

- ``optimize_ddp=True`` (the default, DDPOptimizer): the forward is split at DDP's bucket
  boundaries and the gradients are all-reduced by DDP's C++ reducer in its bucket hooks, as
  eager collectives on the group's communication thread (the reducer's hooks fire inside the
  autograd engine, outside any graph AOTAutograd sees); the buffers are broadcast before each
  forward. That broadcast used to abort the process: c10d's C++ ``_broadcast_coalesced``
  called the Python group while Dynamo's frame hook was active, and Dynamo tried to trace the
  group's ``broadcast`` as user code (``torchtpu.distributed`` now hides its transport modules
  from Dynamo).
- ``optimize_ddp=False``: Dynamo traces DDP's forward itself, the same broadcast inside it.
- ``optimize_ddp="python_reducer"`` with compiled autograd: DDP's Python reducer all-reduces
  each gradient with functional collectives in its post-accumulate hooks, which compiled
  autograd traces into the backward graph: the whole backward with its all-reduces is one SPMD
  program, no eager collective.

Program and collective counts are deltas around one steady step."""

import torch
from torch import nn

from torchtpu.distributed.spawn import run
from torchtpu.testing.models import sgd_full_batch

XLA = {"TORCHTPU_DIST_TRANSPORT": "xla"}
STEPS = 3
MODES = ("ddp_optimizer", "no_optimization", "python_reducer")


class _Net(nn.Module):
    """An MLP with a buffer (DDP broadcasts it before each forward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 7)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x):
        return self.second(torch.relu(self.first(x)) * self.scale)


def _data():
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(1))


def _reference():
    return sgd_full_batch(_Net(), _data(), STEPS)


def _train(rank, world, mode):
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo import compiled_autograd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchtpu import metrics

    group = dist.group.WORLD
    optimize = {"ddp_optimizer": True, "no_optimization": False}.get(mode, mode)
    with torch._dynamo.config.patch(optimize_ddp=optimize):
        model = DDP(_Net().to("tpu"))
        compiled = torch.compile(model, backend="tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = _data().chunk(world)[rank].to("tpu")
        losses = []
        for _ in range(STEPS):
            before, seq = metrics.snapshot(), group._seq
            loss = compiled(x).square().mean()
            if mode == "python_reducer":
                # Static sizes: an SPMD program holds no padded (bucketed dynamic) graph.
                backend = torch.compile(backend="tpu", dynamic=False)
                with compiled_autograd._enable(backend, dynamic=False):
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().cpu())
            after = metrics.snapshot()
        counts = {"collective_programs": after.get("collective_programs", 0)
                  - before.get("collective_programs", 0), "eager_collectives": group._seq - seq}
    torch._dynamo.reset()
    return torch.stack(losses), [p.detach().cpu() for p in model.module.parameters()], counts


def _modes(rank, world):
    # One pair of processes for the three modes (each start costs seconds of imports);
    # python_reducer last: DDP then makes Dynamo inline torch.nn.parallel for the process.
    return {mode: _train(rank, world, mode) for mode in MODES}


def test_compiled_ddp_trains_like_one_process_in_each_dynamo_mode():
    ref_losses, ref_params = _reference()
    results = run(_modes, 2, env=XLA, pg_timeout=120, timeout=600)
    for mode in MODES:
        # Equal per-rank batches: the mean of the ranks' losses is the full batch's.
        torch.testing.assert_close(torch.stack([r[mode][0] for r in results]).mean(0),
                                   ref_losses, atol=1e-5, rtol=1e-5, msg=mode)
        for rank, r in enumerate(results):
            _, params, counts = r[mode]
            for got, want in zip(params, ref_params, strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                           msg=f"{mode} rank {rank}")
            if mode == "python_reducer":
                # The backward and its four all-reduces: one program, nothing eager.
                assert counts == {"collective_programs": 1, "eager_collectives": 0}, (
                    mode, rank, counts)
            else:
                # The buffer's broadcast and the one bucket's all-reduce, eager.
                assert counts == {"collective_programs": 0, "eager_collectives": 2}, (
                    mode, rank, counts)


def test_every_transport_module_is_hidden_from_dynamo():
    """A module of the process group left traceable makes a compiled DDP step fail when c10d
    calls into it (group_core.py, split out of group.py, was: "Attempted to access unregistered
    member on an OpaqueObject"). Each module of the package is either transport or listed here
    as left traceable (the user-facing ones, and those that run inside traced code)."""
    from pathlib import Path

    import torchtpu.distributed as dist

    traceable = {"simple_fsdp", "topology", "dtensor_sdpa", "peers", "uneven", "fsdp_capture",
                 "spawn"}
    modules = {p.stem for p in Path(dist.__file__).parent.glob("*.py")} - {"__init__"}
    assert modules - traceable == set(dist._TRANSPORT)
