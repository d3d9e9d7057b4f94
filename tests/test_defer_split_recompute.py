"""What the split at backward's start carries over (``eager/defer_split.py``): the forward's
program writes only values its cheap live values are computed from, the backward's program
recomputes them; values stay CPU's, both programs are the same every step, the replay's places
go on, and a random draw is never drawn again."""

import math

import pytest
import torch

from torchtpu import metrics
from torchtpu.eager import defer, defer_replay, defer_split
from torchtpu.testing.llama import LlamaConfig, seeded_step

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE
COUNTS = ("executions", "deferred_splits", "deferred_recomputed_calls", "executable_compiles",
          "persistent_cache_hits")


@pytest.fixture(autouse=True)
def split_on(monkeypatch):
    """The split on; values of any size considered (the test's model is tiny); each test
    keeps its own calls."""
    defer_replay.REPLAY.tape.clear()
    monkeypatch.setattr(defer.RECORDER, "split_min_ops", defer.SPLIT_CALLS)
    monkeypatch.setattr(defer_split, "MIN_BYTES", 0)


def _written(monkeypatch) -> list:
    """Per launched program, the bytes of its results."""
    rows: list = []
    run = defer.launch.run

    def counted(label, fn, args):
        out = run(label, fn, args)
        rows.append(sum(x.nbytes for x in out))
        return out

    monkeypatch.setattr(defer.launch, "run", counted)
    return rows


def _loop(recompute: bool, monkeypatch, steps: int = 4) -> tuple:
    """recompute False: no value is worth recomputing (``MIN_BYTES`` above every value's), so
    the forward's program writes every live value, as a split without recomputation would."""
    monkeypatch.setattr(defer_split, "MIN_BYTES", 0 if recompute else math.inf)
    written = _written(monkeypatch)
    config = LlamaConfig(layers=2, seq=8, vocab=64, dim=32, heads=2, hidden=64)
    model, step, x, y = seeded_step(config, "tpu")
    losses, rows = [], []
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(steps):
            before, replayed = metrics.snapshot(), defer_replay.REPLAY.replayed
            del written[:]
            losses.append(step(x, y).item())
            after = metrics.snapshot()
            rows.append(({k: after.get(k, 0) - before.get(k, 0) for k in COUNTS},
                         defer_replay.REPLAY.replayed - replayed, list(written)))
    defer_replay.REPLAY.tape.clear()
    return model, losses, rows


def test_the_forward_writes_less_and_values_stay_cpus(monkeypatch):
    config = LlamaConfig(layers=2, seq=8, vocab=64, dim=32, heads=2, hidden=64)
    cpu_model, cpu_step, cx, cy = seeded_step(config, "cpu")
    model, losses, rows = _loop(True, monkeypatch)
    for loss in losses:
        torch.testing.assert_close(loss, cpu_step(cx, cy).item(), rtol=2e-2, atol=1e-2)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=2e-2, atol=1e-2)
    _, plain_losses, plain_rows = _loop(False, monkeypatch)
    # The same values, recomputed or written (up to the fusions' rounding).
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-6)
    for counts, _, _ in rows:
        assert counts["executions"] == 2 and counts["deferred_splits"] == 1, rows
        assert counts["deferred_recomputed_calls"] > 20, rows  # norms, casts, SiLU, softmax
    for (counts, replayed, written), (_, plain_replayed, plain_written) in zip(
            rows[2:], plain_rows[2:]):
        assert counts["executable_compiles"] + counts["persistent_cache_hits"] == 0, rows
        assert replayed == plain_replayed > 250, (rows, plain_rows)  # every place kept
        # The forward's program (the step's first) writes ~half what it wrote without.
        assert written[0] < 0.7 * plain_written[0], (written, plain_written)


def test_a_random_draw_is_kept_not_drawn_again(monkeypatch):
    """Dropout's output is saved for backward through a cheap product of it: recomputing the
    product must read the forward's draw (random calls are never carried)."""
    torch.manual_seed(5)
    w = torch.randn(16, 16, device="tpu", requires_grad=True)
    x = torch.randn(4, 16, device="tpu")
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(3):
            h = x
            for _ in range(80):  # enough calls outside backward to split
                h = h * 1.01
            y = torch.nn.functional.dropout(h @ w, p=0.5, training=True)
            t = (y * 3.0).tanh()  # saved by tanh, recomputed from y (saved by the product)
            before = metrics.snapshot().get("deferred_recomputed_calls", 0)
            (t * y).sum().backward()
            assert metrics.snapshot().get("deferred_recomputed_calls", 0) > before
            yc, tc = y.cpu(), t.cpu()
            torch.testing.assert_close(
                w.grad.cpu(), h.cpu().t() @ ((3.0 * (1 - tc**2) * yc + tc) * 2.0 * (yc != 0)),
                rtol=1e-4, atol=1e-4)
            w.grad = None


def test_the_plan_is_the_inputs_shapes(monkeypatch):
    """One loop at two batch sizes records the same calls; only the larger batch's values are
    worth recomputing (the threshold between them): each size keeps its own plan."""
    monkeypatch.setattr(defer_split, "MIN_BYTES", 4 * 16 * 24)
    torch.manual_seed(6)
    w = torch.randn(16, 16)
    wt = w.to("tpu").requires_grad_(True)
    w.requires_grad_(True)
    carried = {}
    with torch.tpu.set_eager_mode(DEFER):
        for rows in (4, 32, 4, 32):
            x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows))
            outs = []
            for weight, xs in ((wt, x.to("tpu")), (w, x)):
                h = xs
                for _ in range(70):  # enough calls outside backward to split
                    h = h * 1.01
                p = h @ weight
                t = (p * 2.0).tanh()  # saved by tanh: recomputed from p (saved by the product)
                before = metrics.snapshot().get("deferred_recomputed_calls", 0)
                (t * p).sum().backward()
                if weight is wt:
                    carried[rows] = metrics.snapshot().get("deferred_recomputed_calls", 0) - before
                outs.append(weight.grad.cpu())
                weight.grad = None
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
            assert (carried[rows] > 0) == (rows == 32), carried
