"""Whose sizes a call site remembers (``compile/call_sites.py``): a model's own, not those of
another model built from the same class, alive beside it or dead before it. A sweep or a test
suite builds model after model in one process; the sizes the earlier ones took must not make a
later one's fixed-size calls look growing (padded, and under DeferAndFuse each cut at once: a
2-layer Llama's autocast step ran 69 programs instead of 3 after a long run of other tests)."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtpu import metrics
from torchtpu.compile import call_sites
from torchtpu.demo.gpt import TinyGPT
from torchtpu.eager.modes import EagerMode, set_eager_mode
from torchtpu.testing.buckets import fresh_buckets


def _twice(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) * 2  # a helper's line, called from every model's forward


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = sum(p(x) for p in (self.a, self.b))  # a generator expression's own frame
        return _twice(h)


@pytest.fixture(autouse=True)
def fresh_sites():
    with fresh_buckets():
        yield


def _grow(model: nn.Module) -> None:
    """model's sites see 5 lengths: they vary, and its calls run padded."""
    before = metrics.snapshot().get("eager_bucketed_calls", 0)
    with torch.no_grad():
        for n in (3, 5, 6, 7, 9):
            model(torch.randn(1, n, 8, device="tpu")).cpu()
    assert metrics.snapshot().get("eager_bucketed_calls", 0) > before  # the premise


def _fixed(model: nn.Module, cpu: nn.Module, mode: EagerMode, length: int) -> dict:
    """model at one length, twice, in mode: values equal cpu's; the counters' deltas."""
    x = torch.randn(2, length, 8)
    keys = ("eager_bucketed_calls", "executions")
    before = metrics.snapshot()
    with set_eager_mode(mode), torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x.to("tpu")).cpu(), cpu(x), rtol=1e-5, atol=1e-5)
    after = metrics.snapshot()
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE])
def test_another_models_sizes_do_not_make_a_models_calls_grow(mode):
    torch.manual_seed(0)
    cpu = Mixer()
    grown, model = Mixer().to("tpu"), Mixer().to("tpu")
    model.load_state_dict(cpu.state_dict())
    _grow(grown)
    delta = _fixed(model, cpu, mode, 11)
    assert delta["eager_bucketed_calls"] == 0, delta
    if mode is EagerMode.DEFER_AND_FUSE:  # the forward one program a read, not a cut a call
        assert delta["executions"] == 2, delta


def test_a_dead_models_sizes_are_forgotten():
    torch.manual_seed(0)
    cpu = Mixer()
    grown = Mixer().to("tpu")
    _grow(grown)
    del grown
    gc.collect()
    model = Mixer().to("tpu")
    model.load_state_dict(cpu.state_dict())
    # at the dead one's last length: a live one there would lead the new sites' growth (the
    # blocks of one model), a dead one must not
    assert _fixed(model, cpu, EagerMode.DEFER_AND_FUSE, 9) == {"eager_bucketed_calls": 0,
                                                                "executions": 2}


def test_an_object_at_a_dead_ones_address_gets_another_token():
    class Owner:
        pass

    first = Owner()
    address, token = id(first), call_sites._token(first)
    assert call_sites._token(first) == token  # the same while it lives
    del first  # (freed at once: a collection would hand its block to others)
    for _ in range(1000):  # CPython hands a freed block of the same size out again
        other = Owner()
        if id(other) == address:
            assert call_sites._token(other) != token
            return
        del other  # (held while the next is built, its block would not be free)
    pytest.skip("no object was built at the dead one's address")


def test_sampling_between_training_steps_keeps_them_fused():
    # A loop that samples at growing lengths under no_grad between its training steps: the
    # sampler's calls grow, the training step's, at one length, keep their exact programs
    # (one fused program a step; before: 27, each padded call cut). Two blocks: the second's
    # sites first see the training sizes the first block's calls ran exact.
    torch.manual_seed(0)
    cpu = TinyGPT(13, 32, n_layer=2, n_head=2, n_embd=16)
    model = TinyGPT(13, 32, n_layer=2, n_head=2, n_embd=16).to("tpu")
    model.load_state_dict(cpu.state_dict())
    x, y = torch.randint(13, (4, 32)), torch.randint(13, (4, 32))

    def train(m, opt, dev, counts=None):
        before = metrics.snapshot()
        m(x.to(dev), y.to(dev))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = [p.detach().cpu().clone() for p in m.parameters()]
        after = metrics.snapshot()
        if counts is not None:
            counts.append({k: after.get(k, 0) - before.get(k, 0)
                           for k in ("executions", "eager_bucketed_calls")})
        return value

    sgd = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cpu, model)]
    want = [train(cpu, sgd[0], "cpu") for _ in range(4)]
    counts: list = []
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        got = [train(model, sgd[1], "tpu", counts) for _ in range(2)]
        bucketed = metrics.snapshot().get("eager_bucketed_calls", 0)
        idx = torch.zeros(1, 1, dtype=torch.long, device="tpu")
        with torch.no_grad():
            for _ in range(8):
                logits, _ = model(idx)
                idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert metrics.snapshot().get("eager_bucketed_calls", 0) > bucketed  # it grew
        got += [train(model, sgd[1], "tpu", counts) for _ in range(2)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert counts[3] == counts[1] == {"executions": 1, "eager_bucketed_calls": 0}, counts
