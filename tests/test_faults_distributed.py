"""Ranks that die: the survivors get a Python error within the group's timeout and go on, and
a job torchrun restarts resumes from its last distributed checkpoint as if never interrupted.

A 2-process tpu_dist job on the XLA transport (JAX's multi-process runtime on XLA:CPU): rank 1
SIGKILLs itself inside an all_reduce, after the header exchange agreed on it and before its XLA
collective program runs, so rank 0's program meets a dead peer. Rank 0 must raise (not hang,
not be aborted by JAX's coordination service), then run what a process does on its way out
(JAX's runtime shutdown, which waits at a barrier for every task) and more device work.

``torchrun --max-restarts 1`` with a rank SIGKILLed mid-training: two 2-process jobs of one
script (a DDP MLP on tpu_dist's host transport, SGD with momentum, a
``torch.distributed.checkpoint`` of its tpu tensors after every step), one uninterrupted, one
whose rank 1 kills itself between the forward and the backward of step ``_KILL`` on its first
attempt; the restarted job resumes after the last checkpoint and ends with the uninterrupted
run's losses and weights, bit for bit.

Both start several rounds of processes: ``full``. The per-attempt store keys that let a
restarted job connect at all are checked in this process.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from torchtpu.distributed import launch
from torchtpu.distributed.spawn import run

_PG_TIMEOUT = 30  # seconds; also bounds JAX's runtime start and shutdown waits (jax_runtime)


def _rank_dies_inside_all_reduce(rank, world):
    import jax

    from torchtpu.distributed import xla

    warm = torch.ones(4, device="tpu")
    dist.all_reduce(warm)  # the program compiled, XLA's peer connections made
    assert warm.cpu().tolist() == [2.0] * 4
    value = torch.full((4,), 2.0, device="tpu")
    value.cpu()
    if rank == 1:
        def die(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        xla.XlaProcessGroup._run = die  # past the header exchange, before the program
    start = time.monotonic()
    try:
        dist.all_reduce(value)
        value.cpu()
    except Exception as e:  # noqa: BLE001 (whatever the runtime raises, it must be Python's)
        error = (type(e).__name__, str(e), time.monotonic() - start)
    else:
        raise AssertionError("the all_reduce returned with its peer dead")
    jax.distributed.shutdown()  # what exit runs: aborted the process before recoverability
    after = (torch.arange(3.0, device="tpu") * 2).cpu().tolist()
    return error, after


@pytest.mark.full
def test_rank_killed_inside_xla_all_reduce_leaves_a_python_error():
    outcomes = run(_rank_dies_inside_all_reduce, 2, pg_timeout=_PG_TIMEOUT, timeout=300,
                   env={"TORCHTPU_DIST_TRANSPORT": "xla"}, expect_failure=True)
    assert outcomes[1] is None  # it died
    assert outcomes[0] is not None, "rank 0 died too (JAX's runtime aborted it)"
    ok, value = outcomes[0]
    assert ok, value
    (kind, text, seconds), after = value
    assert "by peer" in text, (kind, text)  # the connection to the dead rank
    assert kind == "DistBackendError" and "rank 1 (process" in text, (kind, text)
    assert seconds < _PG_TIMEOUT, (seconds, text)
    assert after == [0.0, 2.0, 4.0]


def _rank_dies_before_ddp_backward(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    # 1 MB of gradients: the bulk all_reduce, which runs on the group's communication thread
    # and finishes the Work's future there, the future DDP's reducer reads.
    model = DDP(torch.nn.Linear(512, 512).to("tpu"))
    model(torch.randn(4, 512, device="tpu")).sum().backward()
    loss = model(torch.randn(4, 512, device="tpu")).sum()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        loss.backward()
        model.module.weight.grad.cpu()
    except Exception as e:  # noqa: BLE001 (whatever it is, it must be Python's)
        return type(e).__name__, str(e), time.monotonic() - start
    raise AssertionError("the backward returned with its peer dead")


@pytest.mark.parametrize("transport", [
    "host", pytest.param("xla", marks=pytest.mark.full)])
def test_rank_killed_before_ddp_backward_leaves_a_python_error_naming_it(transport):
    # The host transport's survivor segfaulted in DDP's reducer (issue 37): the future it
    # reads held the exception object as its value.
    outcomes = run(_rank_dies_before_ddp_backward, 2, pg_timeout=_PG_TIMEOUT, timeout=300,
                   env={"TORCHTPU_DIST_TRANSPORT": transport}, expect_failure=True)
    assert outcomes[1] is None  # it died
    assert outcomes[0] is not None, "rank 0 died too (a crash, not a Python error)"
    ok, value = outcomes[0]
    assert ok, value
    kind, text, seconds = value
    assert "DistBackendError" in f"{kind}: {text}", (kind, text)
    assert "rank 1 (process" in text and "exited" in text, text
    assert seconds < _PG_TIMEOUT, (seconds, text)


def test_each_torchrun_attempt_has_its_own_store_keys(monkeypatch):
    # torchrun keeps one store across a job's restarts: the keys of attempt 0 (a dead rank's
    # gloo address) must not be what attempt 1 reads.
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    launch._this_attempt(store).set("tpu_dist/rank_0", "attempt 0's address")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = launch._this_attempt(store)
    assert not again.check(["tpu_dist/rank_0"])
    again.set("tpu_dist/rank_0", "attempt 1's address")
    assert again.get("tpu_dist/rank_0") == b"attempt 1's address"


_STEPS, _KILL = 5, 3

_SCRIPT = r"""
import json, os, signal, sys
from pathlib import Path
import torch, torchtpu
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

ckpt, out, steps, kill = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("tpu_dist")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                            torch.nn.Linear(32, 4)).to("tpu")
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
done = sorted(int(p.parent.name[4:]) for p in ckpt.glob("step*/.metadata"))
start = 0
if done:  # resume after the last whole checkpoint, before DDP holds the parameters
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt / f"step{done[-1]}")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    start = done[-1] + 1
ddp = DDP(model)
for step in range(start, steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(ddp(x.to("tpu")), y.to("tpu"))
    if step == kill and attempt == 0 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: rank 0 waits in the backward's allreduce
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        with open(out / "losses.txt", "a") as f:
            f.write(f"{attempt} {step} {loss.item().hex()}\n")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt / f"step{step}")
if rank == 0:
    weights = [p.detach().cpu().double().sum().item().hex() for p in model.parameters()]
    (out / "weights.json").write_text(json.dumps(weights))
dist.destroy_process_group()
"""


def _torchrun(tmp_path, name: str, kill: int) -> tuple[dict, list, list]:
    """One torchrun job: ({step: loss hex} as last written, every line written, weights)."""
    work = tmp_path / name
    (work / "ckpt").mkdir(parents=True)
    script = work / "train.py"
    script.write_text(_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
               str(script), str(work / "ckpt"), str(work), str(_STEPS), str(kill)]
    proc = subprocess.Popen(command, env={**os.environ, "TORCHTPU_CPU_FALLBACK": "error"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:  # past the deadline: torchrun and every worker it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, "\n".join(x for x in log.splitlines() if "rror" in x)[-6000:]
    lines = [line.split() for line in (work / "losses.txt").read_text().splitlines()]
    losses = {int(step): value for _, step, value in lines}
    return losses, lines, json.loads((work / "weights.json").read_text())


@pytest.mark.full
def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path):
    plain, plain_lines, plain_weights = _torchrun(tmp_path, "plain", kill=-1)
    assert sorted(plain) == list(range(_STEPS))
    assert {a for a, _, _ in plain_lines} == {"0"}
    killed, lines, weights = _torchrun(tmp_path, "killed", kill=_KILL)
    first = [int(s) for a, s, _ in lines if a == "0"]
    second = [int(s) for a, s, _ in lines if a == "1"]
    assert first == list(range(_KILL)), lines  # died in step _KILL
    assert second == list(range(_KILL, _STEPS)), lines  # resumed after the last checkpoint
    assert killed == plain
    assert weights == plain_weights
