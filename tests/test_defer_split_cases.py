"""DeferAndFuse's split at backward's start (on by default) in the loops users write besides the
plain training step: inference, gradient accumulation, ``retain_graph``, a loss read before
backward, ``torch.no_grad`` evaluation between steps, and autocast. Each loop's losses and weights
are CPU's, and each step runs the programs the split promises (counted around the step), the same
ones every step once the loop is steady. Each step's gradient norm is CPU's too."""

import pytest
import torch

from torchtpu import metrics
from torchtpu.eager import defer, defer_replay, defer_split
from torchtpu.testing.llama import Llama, LlamaConfig

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE
COUNTS = ("executions", "deferred_splits", "deferred_recomputed_calls", "executable_compiles",
          "persistent_cache_hits")
CONFIG = LlamaConfig(layers=2, seq=8, vocab=64, dim=32, heads=2, hidden=64)
STEPS = 4


@pytest.fixture(autouse=True)
def split_default(monkeypatch):
    """The split at its default threshold whatever the environment says; values of any size
    recomputed (the model is tiny); each test keeps its own calls."""
    defer_replay.REPLAY.tape.clear()
    monkeypatch.setattr(defer.RECORDER, "split_min_ops", defer.SPLIT_CALLS)
    monkeypatch.setattr(defer_split, "MIN_BYTES", 0)
    yield
    defer_replay.REPLAY.tape.clear()


def _setup(device: str):
    torch.manual_seed(0)
    model = Llama(CONFIG).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(CONFIG.vocab, (2, CONFIG.seq + 1), generator=g)
    return model, opt, ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def _update(model, opt) -> torch.Tensor:
    """The optimizer step; the gradients' norm (compared to CPU's: AdamW's small steps hide a
    wrong gradient from the weights' tolerance)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def _infer(model, opt, x, y) -> list:
    with torch.no_grad():
        return [model(x, y).item()]


def _infer_with_grad(model, opt, x, y) -> list:  # a graph built and dropped, never backward
    return [model(x, y).item()]


def _accumulate(model, opt, x, y) -> list:
    losses = []
    for i in range(2):  # two micro-batches, one backward each
        loss = model(x[i:i + 1], y[i:i + 1]) / 2
        loss.backward()
        losses.append(loss)
    losses.append(_update(model, opt))
    return [v.item() for v in losses]


def _retain(model, opt, x, y) -> list:
    loss = model(x, y)
    loss.backward(retain_graph=True)
    loss.backward()  # the gradients twice
    norm = _update(model, opt)
    return [loss.item(), norm.item()]


def _read_first(model, opt, x, y) -> list:
    loss = model(x, y)
    value = loss.item()  # runs the forward: backward starts a fresh recording
    loss.backward()
    norm = _update(model, opt)
    return [value, norm.item()]


def _eval_between(model, opt, x, y) -> list:
    loss = model(x, y)
    loss.backward()
    norm = _update(model, opt)
    with torch.no_grad():
        evaluated = model(y, x)
    return [loss.item(), evaluated.item(), norm.item()]


def _autocast_accumulate(model, opt, x, y) -> list:
    device = x.device.type
    losses = []
    for i in range(2):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(x[i:i + 1], y[i:i + 1]) / 2
        loss.backward()
        losses.append(loss)
    losses.append(_update(model, opt))
    return [v.item() for v in losses]


# body, (programs, splits) a step, the tolerance against CPU
CASES = {
    "inference": (_infer, (1, 0), 1e-5),
    "inference_with_grad": (_infer_with_grad, (1, 0), 1e-5),
    "accumulation": (_accumulate, (3, 2), 1e-4),
    "retain_graph": (_retain, (2, 1), 1e-4),
    "read_before_backward": (_read_first, (2, 0), 1e-4),
    "no_grad_eval_between": (_eval_between, (3, 1), 1e-4),
    "autocast_accumulation": (_autocast_accumulate, (3, 2), 2e-2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_loop_splits_where_it_should_with_cpus_values(case):
    body, (programs, splits), tol = CASES[case]
    cpu = _setup("cpu")
    cpu_losses = [body(*cpu) for _ in range(STEPS)]
    tpu = _setup("tpu")
    rows = []
    with torch.tpu.set_eager_mode(DEFER):
        for step in range(STEPS):
            before = metrics.snapshot()
            losses = body(*tpu)
            after = metrics.snapshot()
            rows.append({k: after.get(k, 0) - before.get(k, 0) for k in COUNTS})
            torch.testing.assert_close(losses, cpu_losses[step], rtol=tol, atol=tol)
    for p, q in zip(tpu[0].parameters(), cpu[0].parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=tol, atol=tol)
    for row in rows[1:]:  # the first step makes AdamW's moments outside the recording
        assert (row["executions"], row["deferred_splits"]) == (programs, splits), rows
        assert (row["deferred_recomputed_calls"] > 0) == (splits > 0), rows
    for row in rows[2:]:
        assert row["executable_compiles"] + row["persistent_cache_hits"] == 0, rows
