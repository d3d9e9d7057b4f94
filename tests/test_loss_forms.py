"""A recorded cross-entropy makes no pass over its [rows, classes] logits for the NLL's pick or
the log-softmax backward's row sums (``eager/producer_forms.py``, ``layers``'s producer forms;
bench/RESULTS.md, loss1), in a capture and in a DeferAndFuse flush, with CPU's values in every
variant: the facts each form depends on (the argument is its producer's whole result, the
producer's op, the class dim, the result's memory order) changed one at a time."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from torchtpu import metrics
from torchtpu.lowering.registry import PRODUCER_FORMS

R, V = 16, 64


def _targets(n=R, classes=V, ignore=-100):
    t = torch.randint(classes, (n,), generator=torch.Generator().manual_seed(1))
    t[3] = ignore
    return t


def _mean(x, t):
    return F.cross_entropy(x.float(), t)


# name -> (loss of (logits, targets), the forms it takes: the pick's, the backward's)
VARIANTS = {
    "mean": (_mean, 2),
    "sum": (lambda x, t: F.cross_entropy(x.float(), t, reduction="sum"), 2),
    "none": (lambda x, t: F.cross_entropy(x.float(), t, reduction="none").square().sum(), 2),
    "weight": (lambda x, t: F.cross_entropy(
        x.float(), t, weight=torch.linspace(0.5, 2, V, device=x.device)), 2),
    "ignore_index": (lambda x, t: F.cross_entropy(x.float(), t.clamp(min=0), ignore_index=5), 2),
    # the backward reads the NLL's gradient plus the smoothing term's: no backward form
    "smoothing": (lambda x, t: F.cross_entropy(x.float(), t, label_smoothing=0.1), 1),
    "bfloat16": (lambda x, t: F.cross_entropy(x, t).float(), 2),  # a bf16 log-softmax
    "one_sample": (lambda x, t: F.cross_entropy(x[0].float(), t[0]), 2),  # (C,) and a 0-d target
    "spatial": (lambda x, t: F.cross_entropy(  # (2, classes, 2, 4): nll_loss2d
        x.float().view(2, 2, 4, V).permute(0, 3, 1, 2).contiguous(), t.view(2, 2, 4)), 2),
    # the class dim is not the log-softmax's: the forms compute the ops' own lowerings
    "other_dim": (lambda x, t: F.nll_loss(F.log_softmax(x.float(), 0), t), 2),
    # the NLL reads the log-probabilities through a view: no pick form (its gradient does)
    "view": (lambda x, t: F.nll_loss(F.log_softmax(x.float(), 1)[:, :V - 8],
                                     t.clamp(max=V - 9)), 0),
    # the NLL's input is no log-softmax's
    "log_of_softmax": (lambda x, t: F.nll_loss(F.softmax(x.float(), 1).log(), t), 0),
    # column-major logits (the log-softmax's result is row-major still)
    "column_major": (lambda x, t: F.cross_entropy(x.float().t().contiguous().t(), t), 2),
    # CPU skips an ignored sample: every target ignored, the mean is 0 / 0 (NaN) and the
    # gradient 0; an ignored row's class 0 (its safe target) at -inf adds 0, not 0 x inf
    "all_ignored": (lambda x, t: F.cross_entropy(x.float(), torch.full_like(t, -100)), 2),
    "ignored_row_at_minus_inf": (lambda x, t: F.cross_entropy(
        F.pad(x.float()[:, 1:], (1, 0), value=-math.inf), t + (t == 0)), 2),
}


def _run(loss_fn, logits, t, mode):
    x = logits.detach().to(mode == "cpu" and "cpu" or "tpu").requires_grad_()
    tt = t.to(x.device)
    if mode == "capture":
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g):
            loss = loss_fn(x, tt)
            loss.backward()
        g.replay()
        return loss, x.grad, g
    if mode == "defer":
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            loss = loss_fn(x, tt)
            loss.backward()
            return loss.cpu(), x.grad.cpu(), None
    loss = loss_fn(x, tt)
    loss.backward()
    return loss, x.grad, None


@pytest.mark.parametrize("mode", ["capture", "defer"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_recorded_cross_entropy_matches_cpu(variant, mode):
    loss_fn, forms = VARIANTS[variant]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if variant == "bfloat16" else torch.float32
    logits = (3 * torch.randn(R, V)).to(dtype)
    t = _targets()
    want, want_grad, _ = _run(loss_fn, logits, t, "cpu")
    before = metrics.snapshot()
    got, grad, _ = _run(loss_fn, logits, t, mode)
    formed = metrics.snapshot().get("producer_forms", 0) - before.get("producer_forms", 0)
    assert formed == forms
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.cpu(), want, equal_nan=True, **tol)
    torch.testing.assert_close(grad.cpu(), want_grad, **tol)


def _row_reductions(captured) -> int:
    """The optimized XLA:CPU program's reductions of a [rows, classes] array to one number a row."""
    text = captured._fn.jitted.lower(*captured._io.arguments()).compile().as_text()
    return len(re.findall(rf"= f32\[{R}\]\{{0\}} reduce\(", text))


@pytest.mark.parametrize("undone", [False, True])
def test_the_loss_reduces_its_logits_for_the_log_softmax_and_the_pick_only(undone, monkeypatch):
    if undone:  # the forms undone: the backward sums its one-hot gradient too
        monkeypatch.setattr("torchtpu.eager.producer_forms.PRODUCER_FORMS", {})
    assert PRODUCER_FORMS  # (the table itself is untouched)
    logits, t = torch.randn(R, V), _targets()
    *_, g = _run(_mean, logits, t, "capture")
    # the log-softmax's max and sum of exponentials (the pick's own, the same instructions, are
    # one with them) and the pick's masked sum of the logits (one pass with the sum of
    # exponentials on a TPU: bench/loss_capture.py)
    assert _row_reductions(g.captured) == (4 if undone else 3)


def _jaxpr(fn, *shapes):
    return jax.make_jaxpr(fn)(*(jnp.zeros(s, d) for s, d in shapes)).jaxpr


def _row_reduces(jaxpr) -> int:
    return sum(e.primitive.name.startswith("reduce") and e.invars[0].aval.shape == (R, V)
               for e in jaxpr.eqns)


def test_the_pick_reads_the_log_softmax_input_and_the_backward_sums_no_one_hot():
    from torchtpu.lowering import layers

    def pick(logp, z, t):
        return layers._nll_loss_of_log_softmax([logp, t, None, 1, -100], [z, 1, False])

    j = _jaxpr(pick, ((R, V), jnp.float32), ((R, V), jnp.float32), ((R,), jnp.int32))
    # the log-probabilities are not read; the logits' max, sum of exponentials and pick are
    assert all(v is not j.invars[0] for e in j.eqns for v in e.invars)
    assert _row_reduces(j) == 3

    def backward(grad, logp, gout, z, t, total):
        return layers._log_softmax_backward_of_nll([grad, logp, 1, jnp.float32],
                                                   [gout, z, t, None, 1, -100, total])

    j = _jaxpr(backward, ((R, V), jnp.float32), ((R, V), jnp.float32), ((), jnp.float32),
               ((R, V), jnp.float32), ((R,), jnp.int32), ((), jnp.float32))
    assert _row_reduces(j) == 0
    # (the lowering it replaces sums the gradient)
    j = _jaxpr(lambda g, o: layers.log_softmax_backward(g, o, 1, jnp.float32),
               ((R, V), jnp.float32), ((R, V), jnp.float32))
    assert _row_reduces(j) == 1


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]')")
def test_on_a_tpu_target_the_loss_makes_one_pass_less_than_without_its_forms(tmp_path):
    """bench/loss_capture.py at the Llama row's 8,192 x 32,768 logits, compile-only for v5e:
    the forms take the pick's pass off (its estimated cycles), and write nothing more."""
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    env = dict(os.environ, TORCHTPU_NOTICES="0",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    sides = {}
    for forms in ("producer", ""):
        out = tmp_path / f"loss_{forms or 'none'}.json"
        done = subprocess.run([sys.executable, os.path.join(root, "bench", "loss_capture.py"),
                               "--sides", "ours", "--forms", forms, "--json", str(out)],
                              env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        sides[forms or "none"] = json.loads(out.read_text())["ours"]
    # 15.58 M against 19.32 M: the [8192, 32768] pass of the pick and the one-hot's row sums
    assert sides["producer"]["mcycles"] < sides["none"]["mcycles"] - 3, sides
    assert sides["producer"]["temporaries_gib"] <= sides["none"]["temporaries_gib"], sides
