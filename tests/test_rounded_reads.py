"""A recorded log-softmax backward whose result is cast to bfloat16 right after (a bf16 step's
loss gradient, read by the head's products) takes the TPU's fast ``exp`` (``eager/rounded_reads``,
``registry.rounded_fast``; bench/RESULTS.md, whole12), in a capture and a DeferAndFuse flush, with
CPU's values; a float32 result, or a cast of another op's result, keeps the accurate forms. The
captured program is lowered for the TPU platform with ``jax.export`` (no TPU needed)."""

import jax
import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from torchtpu import metrics
from torchtpu.runtime import tpu_accuracy

ACCURATE = "result_accuracy_mode<HIGHEST>"
R, D, V = 12, 16, 64


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(V, D, generator=g), torch.randn(R, D, generator=g),
            torch.randint(V, (R,), generator=g))


def _head_loss(w, h, t, dtype):
    with torch.autocast(w.device.type, dtype, enabled=dtype is not None):
        logits = h @ w.t()
        return F.cross_entropy(logits.float(), t)


def _softmax_head(w, h, t, dtype):
    # a softmax's backward (no declared op) cast to bf16 for the head's products
    with torch.autocast(w.device.type, dtype, enabled=dtype is not None):
        logits = h @ w.t()
        return (F.softmax(logits.float(), -1) * F.one_hot(t, V)).sum()


def _double_head(w, h, t, dtype):
    # float64 logits: the log-softmax backward's float32 result is cast wider, not rounded
    return F.cross_entropy((h.double() @ w.double().t()).float(), t)


def _run(loss_fn, dtype, mode):
    w0, h0, t0 = _inputs()
    device = "cpu" if mode == "cpu" else "tpu"
    w, h = (x.to(device).requires_grad_() for x in (w0, h0))
    t = t0.to(device)
    before = metrics.snapshot().get("rounded_reads", 0)
    g = None
    if mode == "capture":
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g):
            loss = loss_fn(w, h, t, dtype)
            loss.backward()
        g.replay()
    elif mode == "defer":
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            loss = loss_fn(w, h, t, dtype)
            loss.backward()
            loss = loss.cpu()
    else:
        loss = loss_fn(w, h, t, dtype)
        loss.backward()
    rounded = metrics.snapshot().get("rounded_reads", 0) - before
    return (loss.cpu(), w.grad.cpu(), h.grad.cpu()), rounded, g


@pytest.mark.parametrize("mode", ["capture", "defer"])
@pytest.mark.parametrize("loss_fn, dtype, taken", [
    (_head_loss, torch.bfloat16, 1), (_head_loss, torch.float16, 1),
    (_head_loss, None, 0),  # float32 throughout: no cast, the accurate exp
    (_softmax_head, torch.bfloat16, 0), (_double_head, None, 0)])
def test_a_cast_loss_gradient_matches_cpu(loss_fn, dtype, taken, mode):
    want, _, _ = _run(loss_fn, dtype, "cpu")
    got, rounded, _ = _run(loss_fn, dtype, mode)
    assert rounded == taken
    tol = dict(atol=1e-5, rtol=1e-5) if dtype is None else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def _accurate_exps(g) -> int:
    c = g.captured
    text = jax.export.export(c._fn.jitted, platforms=["tpu"])(*c._io.arguments()).mlir_module()
    return sum(ACCURATE in line and "stablehlo.exponential" in line for line in text.splitlines())


def test_on_a_tpu_the_cast_loss_gradient_takes_the_fast_exp(monkeypatch):
    _, rounded, g = _run(_head_loss, torch.bfloat16, "capture")
    assert rounded == 1
    fast = _accurate_exps(g)
    # the same step with no op declared: the backward's exp asks for the accurate form too
    monkeypatch.setattr("torchtpu.eager.rounded_reads.ROUNDED_FAST", set())
    _, rounded, g = _run(_head_loss, torch.bfloat16, "capture")
    assert rounded == 0
    assert _accurate_exps(g) == fast + 1 and fast >= 1  # the forward's stay accurate


def test_the_scope_is_the_fast_form_only_while_tracing_inside_it():
    assert tpu_accuracy.rounded() is None
    with tpu_accuracy.rounded_to_half():
        with tpu_accuracy.rounded_to_half():
            assert tpu_accuracy.rounded() is tpu_accuracy.FAST
        assert tpu_accuracy.rounded() is tpu_accuracy.FAST
    assert tpu_accuracy.rounded() is None
