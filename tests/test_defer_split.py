"""DeferAndFuse's split at backward's start (``Recorder._split``): a bounded recording flushes at
the first call inside backward after ``split_min_ops`` calls outside it, so the device runs the
forward while the host records the rest. Every step splits at the same call (two programs, none
compiled once the loop is steady), values stay CPU's, the replay's places go on across the
split, and an unbounded recording (a ``torch_xla.compile`` region) never splits. The split is
on by default (``TORCHTPU_DEFER_SPLIT=0`` turns it off): each test turns it on whatever the
environment says."""

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import torchtpu.integrations.torch_xla as torch_xla
from torchtpu import metrics
from torchtpu.eager import defer, defer_replay
from torchtpu.testing.llama import LlamaConfig, seeded_step

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE
COUNTS = ("executions", "deferred_splits", "executable_compiles", "persistent_cache_hits")


@pytest.fixture(autouse=True)
def fresh_tape(monkeypatch):
    """Each test keeps its own calls (the process's kept calls outlive the mode); the split on
    (the default threshold)."""
    defer_replay.REPLAY.tape.clear()
    monkeypatch.setattr(defer.RECORDER, "split_min_ops", defer.SPLIT_CALLS)


def _step_counts(fn) -> tuple:
    """(fn's result, per counter its delta inside fn, the calls the replay appended)."""
    before, replayed = metrics.snapshot(), defer_replay.REPLAY.replayed
    out = fn()
    after = metrics.snapshot()
    return out, {k: after.get(k, 0) - before.get(k, 0) for k in COUNTS}, \
        defer_replay.REPLAY.replayed - replayed


def test_a_training_loop_runs_two_programs_a_step_with_cpus_values():
    config = LlamaConfig(layers=2, seq=8, vocab=64, dim=32, heads=2, hidden=64)
    model, step, x, y = seeded_step(config, "tpu")
    cpu_model, cpu_step, cx, cy = seeded_step(config, "cpu")
    rows = []
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(5):
            loss, counts, replayed = _step_counts(lambda: step(x, y).item())
            rows.append((counts, replayed))
            torch.testing.assert_close(loss, cpu_step(cx, cy).item(), rtol=2e-2, atol=1e-2)
    for counts, _ in rows:
        assert counts["executions"] == 2 and counts["deferred_splits"] == 1, rows
    for counts, replayed in rows[2:]:  # steady: the same two programs, calls replayed
        assert counts["executable_compiles"] + counts["persistent_cache_hits"] == 0, rows
        assert replayed > 250, rows  # both programs' places kept apart (~300 calls a step)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=2e-2, atol=1e-2)


def _mlp(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1)).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _penalized(model, x):
    """The loss of a forward that checkpoints its body and differentiates inside itself (a
    gradient penalty): backward's graph tasks inside the forward and inside backward."""
    x = x.clone().requires_grad_(True)
    out = checkpoint(model, x, use_reentrant=False)
    grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.pow(2).mean() + 0.1 * grad.pow(2).sum()


# (A backward called on another thread makes its first gradient there, outside backward: the
# recorder warns of that thread's calls, as it does without the split.)
@pytest.mark.filterwarnings("ignore:torchtpu.unsupported. DeferAndFuse records thread")
@pytest.mark.parametrize("where", ["caller", "thread"])
def test_checkpointing_and_a_gradient_inside_the_forward_split_alike_every_step(
        monkeypatch, where):
    monkeypatch.setattr(defer.RECORDER, "split_min_ops", 4)  # the small model's forward splits
    xs = torch.randn(6, 8, 6, generator=torch.Generator().manual_seed(3))
    cpu_model, cpu_opt = _mlp("cpu")
    model, opt = _mlp("tpu")

    def step(m, o, x):
        loss = _penalized(m, x)
        if where == "thread" and x.device.type == "tpu":  # backward on a thread of its own
            t = threading.Thread(target=loss.backward)
            t.start()
            t.join()
        else:
            loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)
        return loss.detach()

    rows = []
    with torch.tpu.set_eager_mode(DEFER):
        for x in xs:
            loss, counts, _ = _step_counts(lambda x=x: step(model, opt, x.to("tpu")).item())
            rows.append(counts)
            torch.testing.assert_close(loss, step(cpu_model, cpu_opt, x).item(), rtol=1e-4,
                                       atol=1e-5)
    for counts in rows[2:]:
        assert counts["deferred_splits"] == rows[1]["deferred_splits"] >= 1, rows
        assert counts["executable_compiles"] + counts["persistent_cache_hits"] == 0, rows
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)


def test_a_torch_xla_compile_region_is_one_program(monkeypatch):
    monkeypatch.setattr(defer.RECORDER, "split_min_ops", 1)  # any backward would split
    cpu_model, _ = _mlp("cpu")
    model, _ = _mlp("tpu")
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    x_tpu = x.to("tpu")

    def region():
        with torch_xla.compile():
            model(x_tpu).pow(2).mean().backward()

    _, counts, _ = _step_counts(region)
    assert counts["executions"] == 1 and counts["deferred_splits"] == 0, counts
    cpu_model(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)
