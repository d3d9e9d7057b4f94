"""FSDP2's (``fully_shard``) whole training step compiled on the XLA transport (processes on
localhost, XLA:CPU): ``torch.compile(train_step)`` and ``torch.tpu.graph`` capture FSDP2's
step (its all-gathers and reduce-scatters, clipping, AdamW on the shards) as one SPMD program
per rank per step, on a 1-D mesh, HSDP's 2-D mesh and FSDP x TP's; a block compiled before
``fully_shard`` is recorded into the capture; a step the capture refuses falls back and still
trains right. Each equals single-process CPU AdamW on the full batch; counts are deltas around
a steady step. The helpers are tests/test_compiled_fsdp.py's (simple_fsdp's whole step)."""

import pytest
import torch
from test_compiled_fsdp import (
    WHOLE_STEPS,
    XLA,
    _adamw_reference,
    _check_whole_step,
    _data,
    _sharded,
    _whole_step,
)

from torchtpu.distributed.spawn import run


def _fsdp2_hsdp(rank, world):
    return _whole_step(rank, world, hsdp=True, fsdp2=True)


@pytest.mark.full  # 4 processes on 2 cores
def test_fsdp2_hsdp_whole_step_is_one_program_over_the_2d_mesh():
    results = run(_fsdp2_hsdp, 4, env=XLA, pg_timeout=240, timeout=900)
    _check_whole_step(results)
    within, across = "[[0, 1], [2, 3]]", "[[0, 2], [1, 3]]"
    for rank, r in enumerate(results):
        # FSDP2's HSDP: within a slice its all-gathers (1, as on one slice) and one
        # reduce-scatter of the gradients, which it then all-reduces across slices: ONE
        # cross-slice all-reduce per step (merged); the clipping norm's all-reduce.
        assert r[5] == {("all_gather", within): 1, ("reduce_scatter", within): 1,
                        ("all_reduce", across): 1, ("all_reduce", within): 1}, (rank, r[5])


def _fsdp2_graph(rank, world):
    """FSDP2's step (forward, backward, clipping, capturable AdamW) as torch.tpu.graph, the
    pattern of PyTorch's CUDA Graphs notes: one eager warm-up step, the capture, replays. The
    losses, and each replay's counts (deltas around it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtpu import metrics

    model = _sharded(init_device_mesh("tpu", (world,)), fsdp2=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)
    x = _data().chunk(world)[rank].to("tpu")

    def train_step():
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    losses, counts = [train_step().cpu()], []
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_loss = train_step()
    for _ in range(WHOLE_STEPS - 1):
        seq, before = dist.group.WORLD._seq, metrics.snapshot()
        g.replay()
        after = metrics.snapshot()
        counts.append({k: after.get(k, 0) - before.get(k, 0)
                       for k in ("executions", "collective_programs", "captures")})
        counts[-1]["eager_collectives"] = dist.group.WORLD._seq - seq
        losses.append(static_loss.cpu())
    return torch.stack(losses), counts


def _fsdp2_refused(rank, world):
    """FSDP2's whole step reading the loss on the host inside it: the capture refuses it (a
    warning) after FSDP2 gathered the root's parameters into the capture's storages, and the
    step runs through Dynamo's graphs; the losses."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    model = _sharded(init_device_mesh("tpu", (world,)), fsdp2=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    logged: list = []

    def train_step(x):
        loss = model(x).square().mean()
        logged.append(loss.item())  # a host read: no captured program can repeat it
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return loss

    step = torch.compile(train_step, backend="tpu")
    x = _data().chunk(world)[rank].to("tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [step(x).cpu() for _ in range(WHOLE_STEPS)]
    return torch.stack(losses), [str(w.message) for w in caught]


def _fsdp2_whole_step(rank, world, fsdp2=True):
    return _whole_step(rank, world, fsdp2=fsdp2)


def test_fsdp2_whole_step_is_one_program_per_rank_and_equals_cpu():
    results = run(_fsdp2_whole_step, 2, env=XLA, pg_timeout=120, timeout=500)
    # torch.compile(train_step): each steady step one launch, FSDP2's all-gathers and
    # reduce-scatters, the clipping norm's all-reduce and AdamW inside it.
    _check_whole_step(results)
    for rank, whole in enumerate(results):
        # FSDP2's gathers of the root's group (Linear 2) and Linear 1's in the forward and of
        # Linear 1's again in the backward (resharded after forward): ONE all-gather, as
        # simple_fsdp's, eager/spanning.py running each group's copy-in early (it reads only
        # the sharded parameters; 2 without that); both groups' gradients reduce-scattered by
        # one; the clipping norm's all-reduce.
        assert whole[5] == {("all_gather", "[[0, 1]]"): 1, ("reduce_scatter", "[[0, 1]]"): 1,
                            ("all_reduce", "[[0, 1]]"): 1}, (rank, whole[5])


def _fsdp2_scenarios(rank, world):
    return (_whole_step(rank, world, fsdp2="compiled"), _fsdp2_graph(rank, world),
            _fsdp2_refused(rank, world))


@pytest.mark.full  # 130 s at load 7-10 (the refused step's Dynamo graphs take half)
def test_fsdp2_over_compiled_blocks_captured_and_refused_steps_equal_cpu():
    results = run(_fsdp2_scenarios, 2, env=XLA, pg_timeout=120, timeout=500)
    # A block compiled before fully_shard (TorchTitan's order): its graphs are recorded into
    # the capture (compile/backend.CompiledGraph._recorded), the step still one program.
    _check_whole_step([r[0] for r in results])
    ref_losses, _ = _adamw_reference(WHOLE_STEPS)
    # torch.tpu.graph: every replay one program, no eager collective.
    torch.testing.assert_close(torch.stack([r[1][0] for r in results]).mean(0), ref_losses,
                               atol=1e-5, rtol=1e-5)
    for rank, (_, (_, counts), _) in enumerate(results):
        assert counts[1:] == [{"executions": 1, "collective_programs": 1, "captures": 0,
                               "eager_collectives": 0}] * (WHOLE_STEPS - 2), (rank, counts)
    # Refused: FSDP2's state rolled back with the capture (distributed/fsdp_capture.py); the
    # step through Dynamo's graphs still trains as CPU (before: the capture's placeholder
    # arrays stayed the root's gathered parameters, and every loss was wrong).
    torch.testing.assert_close(torch.stack([r[2][0] for r in results]).mean(0), ref_losses,
                               atol=1e-5, rtol=1e-5)
    for rank, (_, _, (_, caught)) in enumerate(results):
        assert any("cannot run as one captured program" in w and "host read" in w
                   for w in caught), (rank, caught)


def _fsdp_tp(rank, world):
    return _whole_step(rank, world, tp=True)


@pytest.mark.full  # 4 processes on 2 cores: 55 s at load 10-12
def test_fsdp2_x_tp_whole_step_is_one_program_over_the_2d_mesh():
    results = run(_fsdp_tp, 4, env=XLA, pg_timeout=240, timeout=900)
    _check_whole_step(results)
    dp, tp = "[[0, 2], [1, 3]]", "[[0, 1], [2, 3]]"
    for rank, r in enumerate(results):
        # FSDP2 over dp: one all-gather, one reduce-scatter, one all-reduce; TP over tp: two
        # all-reduces (among them the row-parallel output's); nothing eager.
        assert r[5] == {("all_gather", dp): 1, ("reduce_scatter", dp): 1, ("all_reduce", dp): 1,
                        ("all_reduce", tp): 2}, (rank, r[5])
