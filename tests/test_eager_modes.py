"""Eager modes: Strict, Debug and DeferAndFuse compute the same numbers and refuse bad indices as
CPU does; DeferAndFuse fuses, caches its programs and flushes where it must."""

import os
import traceback

import pytest
import torch

import torchtpu
from torchtpu.device import asserts
from torchtpu.eager import defer
from torchtpu.testing.compare import assert_same

MODES = [torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
         torch.tpu.EagerMode.DEFER_AND_FUSE]
DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE
DEBUG = torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING


def _compiles() -> int:
    return torchtpu.metrics.snapshot()["executable_compiles"]


def _train(device: str, steps: int, after_step=None) -> tuple[list, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(5, 8).to(device), torch.randn(5, 4).to(device)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())  # a host read inside the loop
        if after_step is not None:
            after_step(step)
    return torch.tensor(losses), {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_mlp_training_matches_cpu(mode):
    expected = _train("cpu", 3)
    with torch.tpu.set_eager_mode(mode):
        actual = _train("tpu", 3)
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)


def test_defer_training_compiles_nothing_after_its_first_step():
    compiles, runs = [], []

    def count(step):
        snap = torchtpu.metrics.snapshot()
        compiles.append(snap["executable_compiles"])
        runs.append(snap["executions"])

    with torch.tpu.set_eager_mode(DEFER):
        before = torchtpu.metrics.snapshot()
        _train("tpu", 6, after_step=count)
        after = torchtpu.metrics.snapshot()
    # AdamW's state is made outside the first step's recording, so that step records the
    # steady program already.
    assert compiles[0] == compiles[5], compiles
    # One fused program per step (the loss read flushes), old parameter buffers donated.
    assert [b - a for a, b in zip(runs, runs[1:])] == [1] * 5, runs
    assert after.get("donated_inputs", 0) > before.get("donated_inputs", 0)


def _views_and_inplace(a, b):
    a = a.clone()
    a[1:3].mul_(2)             # write through a slice
    a.t()[0].add_(b[0, :4])    # write through a transposed view
    c = a @ a.t()
    d = c.view(-1)
    d[::3].sub_(1)             # strided write into a reshaped view
    e = c[:, 1] * 3
    return a, c, e


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_views_and_inplace_match_cpu(mode):
    a, b = torch.randn(4, 6), torch.randn(6, 4)
    expected = _views_and_inplace(a, b)
    with torch.tpu.set_eager_mode(mode):
        actual = _views_and_inplace(a.to("tpu"), b.to("tpu"))
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)


def test_pending_values_cross_mode_changes():
    a = torch.randn(3, 3)
    t = a.to("tpu")
    with torch.tpu.set_eager_mode(DEFER):
        assert torch.tpu.eager_mode is DEFER
        b = t * 2 + 1
        c = b.mm(t)
        assert not torch.tpu.is_materialized(b) and not torch.tpu.is_materialized(c)
        assert "func.func" in torch.tpu.pending_hlo()
        torch.tpu.eager_mode = DEBUG  # leaving DeferAndFuse runs what it holds
        assert torch.tpu.is_materialized(b) and torch.tpu.is_materialized(c)
        d = c - b
        torch.tpu.eager_mode = DEFER
        e = d * c
    assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_NEVER
    assert torch.tpu.is_materialized(e)
    b_cpu = a * 2 + 1
    c_cpu = b_cpu.mm(a)
    assert_same((b, c, d, e), (b_cpu, c_cpu, c_cpu - b_cpu, (c_cpu - b_cpu) * c_cpu))


def test_defer_flushes_at_host_reads_and_size_limit(monkeypatch):
    t = torch.ones(4, device="tpu")
    with torch.tpu.set_eager_mode(DEFER):
        s = t * 3
        assert not torch.tpu.is_materialized(s)
        assert bool((s + 1)[0] == 4)  # bool() is a host read
        assert torch.tpu.is_materialized(s)
        monkeypatch.setattr(defer.RECORDER, "max_ops", 5)
        x = t
        for _ in range(7):
            x = x + 1
        assert torch.tpu.is_materialized(t.new_empty(0)) and torch.tpu.pending_hlo()
        torch.tpu.synchronize()
        assert torch.tpu.pending_hlo() == "" and torch.tpu.is_materialized(x)
    assert_same(x, torch.full((4,), 8.0))


def test_defer_rng_matches_strict():
    torch.tpu.manual_seed(7)
    strict = torch.rand(5, device="tpu") + torch.randn(5, device="tpu")
    torch.tpu.manual_seed(7)
    with torch.tpu.set_eager_mode(DEFER):
        deferred = torch.rand(5, device="tpu") + torch.randn(5, device="tpu")
    # The same random stream; fusion may round the transforms differently by an ulp.
    assert_same(deferred, strict.cpu(), atol=1e-6, rtol=1e-6)


def _bad_gather(t):
    return torch.gather(t, 1, torch.tensor([[0, 7]], device=t.device))


def _bad_index_select(t):
    return torch.index_select(t, 0, torch.tensor([1, 5], device=t.device))


def _bad_embedding(t):
    return torch.nn.functional.embedding(torch.tensor([0, 9], device=t.device), t)


def _bad_index(t):
    return t[torch.tensor([0, -3], device=t.device)]


def _frames(error: BaseException) -> list:
    return [(f.filename, f.name) for f in traceback.extract_tb(error.__traceback__)]


def _internal_frames(error: BaseException) -> list:
    package = os.path.dirname(torchtpu.__file__) + os.sep
    return [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(package)]


@pytest.mark.parametrize("stall", [False, True], ids=["host-readable", "as-on-a-tpu"])
@pytest.mark.parametrize("mode", MODES[:2], ids=["strict", "debug"])
@pytest.mark.parametrize("fn", [_bad_gather, _bad_index_select, _bad_embedding, _bad_index],
                         ids=["gather", "index_select", "embedding", "index"])
def test_bad_index_raises_as_on_cpu_at_user_line(fn, mode, stall, monkeypatch):
    # as-on-a-tpu: index values cannot be read at the call without stalling the device, so
    # the check runs there; Debug still raises at the call, Strict at the next host read.
    monkeypatch.setattr(asserts, "_host_reads_stall", lambda: stall)
    t = torch.randn(2, 3)
    with pytest.raises(Exception) as expected:
        fn(t)
    with torch.tpu.set_eager_mode(mode):
        with pytest.raises(type(expected.value)) as info:
            out = fn(t.to("tpu"))
            if stall and mode is not DEBUG:
                out.cpu()
                raise AssertionError("the device's check did not raise at the host read")
        if stall and mode is not DEBUG:  # the op in the message, the line in a note
            assert str(info.value).startswith("torchtpu.check: aten.")
            assert info.value.__notes__[0].startswith("Checked on the device")
            return
        assert str(info.value) == str(expected.value)
        # CPU's traceback: the user's frames (and torch.nn.functional's for embedding), no
        # torchtpu frame, no chained error.
        assert _frames(info.value) == _frames(expected.value)
        assert _internal_frames(info.value) == []
        assert info.value.__suppress_context__ or info.value.__context__ is None
        assert_same(t.to("tpu") + 1, t + 1)  # the device still works


def _divide(a, b):
    return a / b


def test_debug_nans(monkeypatch):
    monkeypatch.setenv("TORCHTPU_DEBUG_NANS", "1")
    t = torch.tensor([1.0, 0.0], device="tpu")
    with torch.tpu.set_eager_mode(DEBUG):
        ok = t * 2
        with pytest.raises(FloatingPointError, match="aten.div") as info:
            _divide(t, t)
        frames = traceback.extract_tb(info.value.__traceback__)
        assert [f.name for f in frames[-2:]] == ["test_debug_nans", "_divide"]
        assert _internal_frames(info.value) == []
        assert_same(ok + 1, torch.tensor([3.0, 1.0]))


def test_defer_integer_index_records_and_mask_flushes():
    x, idx = torch.randn(5, 3), torch.tensor([4, 0, 4])
    mask = torch.tensor([True, False, True, False, True])
    t, t_idx, t_mask = x.to("tpu"), idx.to("tpu"), mask.to("tpu")
    with torch.tpu.set_eager_mode(DEFER):
        y = t * 2
        before = torchtpu.metrics.snapshot()["executions"]
        gathered = y[t_idx]
        rows = y[t_idx, 1:]
        assert torchtpu.metrics.snapshot()["executions"] == before
        assert not torch.tpu.is_materialized(y) and not torch.tpu.is_materialized(gathered)
        masked = y[t_mask]  # its shape needs the mask's values: runs what is pending
        assert torch.tpu.is_materialized(y)
    assert_same((gathered, rows, masked), ((x * 2)[idx], (x * 2)[idx, 1:], (x * 2)[mask]))


# Model parity in the other two modes (Strict runs the full model suites): GPT training and a tiny
# Llama's forward/backward, plus greedy generation, whose host reads flush DeferAndFuse per token.
OTHER_MODES = [DEBUG, DEFER]


# Debug's GPT (launch-blocking Strict: Strict's programs, each waited for) in the full stage.
@pytest.mark.parametrize("mode", [pytest.param(DEBUG, marks=pytest.mark.full, id=DEBUG.name),
                                  pytest.param(DEFER, id=DEFER.name)])
def test_gpt_training_matches_cpu(mode):
    from test_models import CONFIG, cpu_and_tpu_models

    from torchtpu.demo.gpt import train_steps

    data = torch.randint(0, CONFIG["vocab"], (600,), generator=torch.Generator().manual_seed(1))
    cpu, tpu = cpu_and_tpu_models()
    expected = train_steps(cpu, data, 4, "cpu")
    with torch.tpu.set_eager_mode(mode):
        actual = train_steps(tpu, data, 4, "tpu")
    assert expected[-1] < expected[0]
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-3, atol=0)
    assert_same(tpu.state_dict(), cpu.state_dict(), rtol=1e-3, atol=1e-4)
