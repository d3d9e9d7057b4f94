"""Random ops on the device: distributions, dtypes, and the generator's repeatability.

Values cannot equal CPU's stream, so these tests check statistics on 1e5 samples, ranges and
dtypes, and that seeding replays the same draws.
"""

import math

import pytest
import torch
import torch.nn.functional as F

N = 100_000


def _stats(t: torch.Tensor) -> tuple[float, float]:
    c = t.cpu().double()
    return c.mean().item(), c.var().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_rand_randn_dtypes(dtype):
    u = torch.rand(N, device="tpu", dtype=dtype)
    assert u.dtype == dtype and u.device.type == "tpu" and u.shape == (N,)
    c = u.cpu()
    assert c.min() >= 0 and c.max() <= 1
    mean, var = _stats(u)
    assert abs(mean - 0.5) < 0.01 and abs(var - 1 / 12) < 0.005
    mean, var = _stats(torch.randn(N, device="tpu", dtype=dtype))
    assert abs(mean) < 0.02 and abs(var - 1) < 0.03


def test_uniform_normal_inplace_parameters():
    x = torch.empty(N, device="tpu")
    x.uniform_(-3, 5)
    c = x.cpu()
    assert c.min() >= -3 and c.max() < 5 and abs(c.mean() - 1) < 0.05
    x.normal_(2.0, 3.0)
    mean, var = _stats(x)
    assert abs(mean - 2) < 0.05 and abs(var - 9) < 0.2


def test_normal_tensor_overloads():
    mean = torch.full((N,), 3.0, device="tpu")
    std = torch.full((N,), 2.0, device="tpu")
    for t, m, v in [(torch.normal(mean, std), 3, 4), (torch.normal(mean, 0.5), 3, 0.25),
                    (torch.normal(-1.0, std), -1, 4)]:
        assert t.shape == (N,) and t.dtype == torch.float32
        tm, tv = _stats(t)
        assert abs(tm - m) < 0.05 and abs(tv - v) / v < 0.03


def test_randint_ranges_and_dtypes():
    r = torch.randint(-4, 7, (N,), device="tpu")
    assert r.dtype == torch.int64
    c = r.cpu()
    assert c.min() == -4 and c.max() == 6
    counts = torch.bincount(c + 4).double() / N
    assert torch.allclose(counts, torch.full((11,), 1 / 11, dtype=torch.float64), atol=0.01)
    r8 = torch.randint(3, (1000,), device="tpu", dtype=torch.uint8).cpu()
    assert r8.dtype == torch.uint8 and set(r8.tolist()) == {0, 1, 2}
    rf = torch.randint(0, 10, (1000,), device="tpu", dtype=torch.float32).cpu()
    assert rf.dtype == torch.float32 and torch.equal(rf, rf.round()) and rf.max() == 9


def test_random_default_bounds():
    f = torch.empty(N, device="tpu", dtype=torch.float16).random_().cpu().float()
    assert f.min() >= 0 and f.max() <= 2**11 and torch.equal(f, f.round())
    i8 = torch.empty(N, device="tpu", dtype=torch.int8).random_().cpu()
    assert i8.min() == 0 and i8.max() == 127
    b = torch.empty(1000, device="tpu", dtype=torch.bool).random_().cpu()
    assert 300 < b.sum() < 700
    big = torch.empty(N, device="tpu", dtype=torch.int64).random_(2**40).cpu()
    assert big.min() >= 0 and big.max() < 2**40 and big.max() > 2**39


def test_bernoulli_overloads():
    p = torch.full((N,), 0.3, device="tpu")
    b = torch.bernoulli(p)
    assert b.dtype == torch.float32 and set(b.cpu().unique().tolist()) == {0.0, 1.0}
    assert abs(b.cpu().mean() - 0.3) < 0.01
    x = torch.empty(N, device="tpu", dtype=torch.float16).bernoulli_(0.8)
    assert x.dtype == torch.float16 and abs(x.cpu().float().mean() - 0.8) < 0.01
    y = torch.empty(N, device="tpu").bernoulli_(p)
    assert abs(y.cpu().mean() - 0.3) < 0.01
    assert torch.bernoulli(torch.zeros(10, device="tpu"), 1.0).cpu().eq(1).all()


@pytest.mark.parametrize("name, args, mean, var", [
    ("exponential_", (2.0,), 0.5, 0.25),
    ("geometric_", (0.25,), 4.0, 12.0),
    ("log_normal_", (0.0, 0.5), math.exp(0.125), (math.exp(0.25) - 1) * math.exp(0.25)),
])
def test_other_distributions(name, args, mean, var):
    t = getattr(torch.empty(N, device="tpu"), name)(*args)
    m, v = _stats(t)
    assert abs(m - mean) / mean < 0.03 and abs(v - var) / var < 0.08
    if name == "geometric_":
        c = t.cpu()
        assert c.min() >= 1 and torch.equal(c, c.round())


def test_cauchy_median():
    c = torch.empty(N, device="tpu").cauchy_(1.0, 2.0).cpu()
    assert abs(c.median() - 1.0) < 0.05
    assert abs((c - 1).abs().median() - 2.0) < 0.1  # the half-width is sigma


def test_randperm():
    p = torch.randperm(1000, device="tpu")
    assert p.dtype == torch.int64
    assert torch.equal(p.cpu().sort().values, torch.arange(1000))
    assert not torch.equal(p.cpu(), torch.arange(1000))
    p32 = torch.randperm(10, device="tpu", dtype=torch.int32)
    assert p32.dtype == torch.int32 and sorted(p32.cpu().tolist()) == list(range(10))


def test_multinomial():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [1.0, 1.0, 1.0, 1.0]], device="tpu")
    s = torch.multinomial(probs, 20_000, replacement=True)
    assert s.shape == (2, 20_000) and s.dtype == torch.int64
    freq = torch.stack([torch.bincount(row, minlength=4) for row in s.cpu()]).double() / 20_000
    expected = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.25] * 4], dtype=torch.float64)
    assert torch.allclose(freq, expected, atol=0.015)
    w = torch.multinomial(probs, 3, replacement=False).cpu()
    assert w.shape == (2, 3)
    for row in w:
        assert len(set(row.tolist())) == 3
    assert 1 not in w[0].tolist()  # zero probability is never drawn
    # Without replacement the largest weight is drawn first most often.
    first = torch.multinomial(probs[0].expand(2000, 4).contiguous(), 1).cpu()
    assert abs((first == 2).double().mean() - 0.6) < 0.04


def test_dropout_forward_and_backward():
    x = torch.ones(N, device="tpu", requires_grad=True)
    y = F.dropout(x, 0.25)
    c = y.detach().cpu()
    kept = c != 0
    assert abs(kept.double().mean() - 0.75) < 0.01
    assert torch.allclose(c[kept], torch.full_like(c[kept], 1 / 0.75))
    y.sum().backward()
    assert torch.equal(x.grad.cpu(), c)  # the gradient is masked and scaled alike
    assert torch.equal(F.dropout(x, 0.25, training=False).detach().cpu(), torch.ones(N))
    out, mask = torch.ops.aten.native_dropout(x.detach(), 0.5, True)
    assert mask.dtype == torch.bool
    assert torch.equal(out.cpu(), mask.cpu().float() * 2)


def test_manual_seed_repeats_and_draws_differ():
    torch.manual_seed(123)
    a = torch.randn(64, device="tpu").cpu()
    b = torch.randn(64, device="tpu").cpu()
    torch.manual_seed(123)
    assert torch.equal(torch.randn(64, device="tpu").cpu(), a)
    assert torch.equal(torch.randn(64, device="tpu").cpu(), b)
    assert not torch.equal(a, b)


def test_generator_object_is_repeatable_and_independent():
    g = torch.Generator(device="tpu").manual_seed(7)
    assert g.device.type == "tpu"
    torch.manual_seed(0)
    a = torch.rand(64, device="tpu", generator=g).cpu()
    d1 = torch.rand(64, device="tpu").cpu()
    g.manual_seed(7)
    torch.manual_seed(0)
    # Drawing from g first must not move the default stream, and vice versa.
    d2 = torch.rand(64, device="tpu").cpu()
    assert torch.equal(torch.rand(64, device="tpu", generator=g).cpu(), a)
    assert torch.equal(d1, d2)
    assert not torch.equal(a, d1)
    g.manual_seed(7)
    p1 = torch.randperm(50, device="tpu", generator=g).cpu()
    m1 = torch.multinomial(torch.ones(10, device="tpu"), 5, generator=g).cpu()
    g.manual_seed(7)
    assert torch.equal(torch.randperm(50, device="tpu", generator=g).cpu(), p1)
    assert torch.equal(torch.multinomial(torch.ones(10, device="tpu"), 5, generator=g).cpu(), m1)


def test_rng_state_roundtrip():
    torch.manual_seed(5)
    torch.rand(3, device="tpu")
    state = torch.tpu.get_rng_state()
    a = torch.randint(0, 1000, (32,), device="tpu").cpu()
    x = F.dropout(torch.ones(32, device="tpu"), 0.5).cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.randint(0, 1000, (32,), device="tpu").cpu(), a)
    assert torch.equal(F.dropout(torch.ones(32, device="tpu"), 0.5).cpu(), x)


def test_a_generator_steps_back_one_draw_by_cudas_offset_of_four():
    # vLLM undoes the sample of a request still prefilling with set_offset(get_offset() - 4),
    # CUDA's Philox step for one small op: the next draw repeats the undone one
    g = torch.Generator(device="tpu").manual_seed(3)
    torch.rand(4, device="tpu", generator=g)
    undone = torch.empty(8, device="tpu").exponential_(generator=g).cpu()
    g.set_offset(g.get_offset() - 4)
    assert torch.equal(torch.empty(8, device="tpu").exponential_(generator=g).cpu(), undone)
    following = torch.rand(4, device="tpu", generator=g).cpu()
    assert not torch.equal(following[:4], undone[:4])
    with pytest.raises(RuntimeError, match="at least 0"):
        g.set_offset(-4)
