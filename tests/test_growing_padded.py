"""Padded values between bucketed eager calls (``compile/padded_values.py``).

A call ``eager_buckets`` runs padded leaves its result padded in its storage: the next bucketed
call reads it so (no host round trip, no cut), and anything else that reads it (``.cpu()``, a
view, an op that is not bucketed, an in-place write) sees exactly the real values CPU computes.
"""

import random

import pytest
import torch

from torchtpu import metrics
from torchtpu.compile import eager_buckets
from torchtpu.eager.modes import EagerMode, set_eager_mode


@pytest.fixture(scope="module", autouse=True)
def buckets_on():
    was = eager_buckets.enabled()
    eager_buckets.set_enabled(True)
    yield
    eager_buckets.set_enabled(was)


def _count(name: str) -> int:
    return metrics.snapshot().get(name, 0)


def _chain(x, w, b):
    # Every line's sizes grow with x: each call is bucketed after its first lengths.
    h = torch.nn.functional.linear(x, w, b)
    h = torch.nn.functional.gelu(h)
    h = torch.nn.functional.layer_norm(h, h.shape[-1:])
    return h.softmax(0)


def _inputs(n: int):
    g = torch.Generator().manual_seed(n)
    return (torch.randn(1, n, 8, generator=g), torch.randn(12, 8, generator=g),
            torch.randn(12, generator=g))


def test_a_chain_of_bucketed_calls_passes_padded_values_along():
    cuts = []
    for n in range(3, 20):
        x, w, b = _inputs(n)
        before = _count("eager_padded_cuts") + _count("eager_host_cuts")
        calls = _count("eager_bucketed_calls")
        out = _chain(*(t.to("tpu") for t in (x, w, b)))
        bucketed = _count("eager_bucketed_calls") - calls
        got = out.cpu()  # the one read: one cut
        cuts.append((bucketed, _count("eager_padded_cuts") + _count("eager_host_cuts") - before))
        torch.testing.assert_close(got, _chain(x, w, b), rtol=1e-5, atol=1e-6)
    # Once the lengths vary, all four calls run bucketed and only .cpu() cuts.
    assert cuts[-1] == (4, 1), cuts


def _grown(n: int):
    x, w, b = _inputs(n)
    return x, _chain(*(t.to("tpu") for t in (x, w, b))), _chain(x, w, b)


def test_padded_results_read_otherwise_equal_cpu():
    for n in range(3, 12):
        _grown(n)  # the lines' sizes vary from here on
    x, dev, cpu = _grown(13)
    calls = _count("eager_padded_cuts")
    # A view of it, copied; an op at a line never run before (not bucketed); an in-place write.
    torch.testing.assert_close(dev[:, 2:5].clone().cpu(), cpu[:, 2:5].clone())
    torch.testing.assert_close(torch.exp(dev).cpu(), torch.exp(cpu))
    _, dev, cpu = _grown(13)
    dev.add_(1)
    cpu.add_(1)
    torch.testing.assert_close(dev.cpu(), cpu)
    assert _count("eager_padded_cuts") > calls


def _last_row_argmax(h):
    return h[:, -1, :].argmax(-1)


def test_a_row_at_a_growing_offset_is_read_through_a_window_not_a_cut():
    # h[:, -1] of a padded h: its offset moves with the length; read at a traced start.
    for n in range(3, 20):
        x, w, b = _inputs(n)
        h = torch.nn.functional.linear(x.to("tpu"), w.to("tpu"), b.to("tpu"))
        cuts, reads = _count("eager_padded_cuts"), _count("eager_padded_reads")
        got = _last_row_argmax(h)
        assert torch.equal(got.cpu(), _last_row_argmax(torch.nn.functional.linear(x, w, b)))
    assert _count("eager_padded_reads") > reads
    assert _count("eager_padded_cuts") == cuts  # not even for the argmax's .cpu()


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
                                  EagerMode.DEFER_AND_FUSE])
def test_other_modes_cut_at_once_and_equal_cpu(mode):
    with set_eager_mode(mode):
        for n in range(3, 20):
            x, w, b = _inputs(n)
            torch.testing.assert_close(_chain(*(t.to("tpu") for t in (x, w, b))).cpu(),
                                       _chain(x, w, b), rtol=1e-5, atol=1e-6)


def _heads(x, w):
    # (1, n, 8) -> (1, 2, n, 4) heads -> back to (1, n, 8) through reshape's clone -> linear
    h = torch.nn.functional.linear(x, w)
    h = h.view(1, h.shape[1], 2, 4).transpose(1, 2).softmax(-1)
    return torch.nn.functional.linear(h.transpose(1, 2).reshape(1, h.shape[2], 8), w)


def test_a_transposed_padded_value_copied_by_reshape_stays_padded():
    for n in range(3, 20):
        x, w, _ = _inputs(n)
        w = w[:8]
        cuts = _count("eager_padded_cuts") + _count("eager_host_cuts")
        copies = _count("eager_padded_copies")
        got = _heads(x.to("tpu"), w.to("tpu")).cpu()
        torch.testing.assert_close(got, _heads(x, w), rtol=1e-5, atol=1e-6)
    assert _count("eager_padded_copies") == copies + 1
    assert _count("eager_padded_cuts") + _count("eager_host_cuts") == cuts + 1  # .cpu()


def test_a_padded_value_with_a_cpu_scalar_tensor_equals_cpu():
    # TorchTitan scales its loss by a token count kept in a 0-d CPU tensor: a CPU operand of a
    # tpu op holds no device value to look into.
    for n in range(3, 20):
        x, w, b = _inputs(n)
        scale = torch.tensor(float(n))
        h = torch.nn.functional.linear(x.to("tpu"), w.to("tpu"), b.to("tpu"))
        got = (h * scale / torch.tensor(3.0)).cpu()
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b) * scale / 3.0)


def _free_list(device: str, steps: int = 50) -> list:
    # SGLang's token allocator, as its scheduler drives it: pages taken off the front of a free
    # list (slices), and freed ones appended in groups (a cat of clones). The cat is bucketed,
    # its result left padded; a slice of it may keep a single element, which the next cat reads
    # out of the padded storage (it raised "not enough values to unpack" in a Ray Serve replica).
    draw = random.Random(0)
    pages = torch.arange(1, 4097, dtype=torch.int64, device=device)
    held, sums = [], []
    for _ in range(steps):
        group = [held.pop(draw.randrange(len(held)))[draw.randint(0, 2):].clone()
                 for _ in range(draw.randint(0, 3)) if held and draw.random() < 0.5]
        if group:
            pages = torch.cat((pages, torch.cat(group)))
        n = draw.randint(1, 40)
        if n <= len(pages):
            held.append(pages[:n])
            pages = pages[n:]
        sums.append(int(pages.sum()))
    return sums


def test_a_free_list_of_slices_and_cats_matches_cpu():
    assert _free_list("tpu") == _free_list("cpu")
