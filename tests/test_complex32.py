"""complex32 (``torch.chalf``) on tpu against PyTorch on CPU: storage, copies, views, indexing,
casts and the arithmetic CPU has for it, bit for bit. XLA has no complex32: storage holds float16
pairs and values compute as complex64, rounded back when stored (``device/dtypes.py``)."""

import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.runtime import platform

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental",
                                        "ignore:Casting complex values to real")

IDX = torch.tensor([2, 0])
M = torch.tensor([True, False, True])
# The widest complex a round trip can go through: a TPU has no complex128.
WIDE = torch.complex64 if platform.platform() == "tpu" else torch.complex128


def _value():
    g = torch.Generator().manual_seed(0)
    # 1.0001 is not a float16: every cast into complex32 below must round as CPU rounds.
    return torch.randn(3, 4, dtype=torch.complex64, generator=g) * 1.0001


def _set(t, key, value):
    t = t.clone()
    t[key] = value
    return t


OPS = {
    "smoke": lambda x, i, m: (
        x.t().contiguous(), torch.view_as_real(x), (x.to(WIDE) * 1.0001).to(x.dtype),
        x[i], _set(x, i, x[1]), x * x, x - 1),  # x - 1: a call Strict holds (lazy_casts)
    "storage and strided views": lambda x, i, m: (
        x.clone(), x.t().contiguous(), x[1:, ::2], x.diagonal(), x.as_strided((2, 2), (1, 2)),
        x.unfold(1, 2, 1), x.view(12), x.conj().resolve_conj(), x.narrow(1, 1, 2).clone()),
    "reinterpreting views": lambda x, i, m: (
        torch.view_as_real(x), x.real, x.imag, x.view(torch.float32), x.view(torch.float16),
        torch.view_as_complex(torch.view_as_real(x).clone()), x.view(torch.int16).view(x.dtype)),
    "casts": lambda x, i, m: (
        x.to(torch.complex64), x.to(WIDE), x.to(torch.float16), x.to(torch.bool),
        (x * 4).to(torch.int32), x.real.float().mul(1.0001).to(x.dtype), i.to(x.dtype),
        m.to(x.dtype), (x.to(WIDE) * 1.0001).to(x.dtype)),
    "copies into views": lambda x, i, m: (
        torch.empty(4, 3, dtype=x.dtype, device=x.device).t().copy_(x),
        _set(x, (slice(None), 1), x[:, 2] * 1.0001), _set(x, (slice(0, 1),), 2 - 1j),
        x.clone().copy_(torch.full((3, 4), 1.0001, device=x.device))),
    "indexing": lambda x, i, m: (
        x[i], x[:, i], x.index_select(1, i), _set(x, i, x[1]), _set(x, m, x[0]),
        x.clone().index_put_((i,), x[0], accumulate=True), x.clone().index_add_(0, i, x[:2]),
        x.clone().index_copy_(0, i, x[:2]), x.clone().index_fill_(0, i, 1),
        x.masked_fill(m[:, None], 3j), torch.where(m[:, None], x, x * 2), x.nonzero()),
    "shape ops": lambda x, i, m: (
        torch.cat([x, x[:1]]), torch.stack([x, x]), x.flip(0), x.roll(1), x.tril(), x.repeat(2, 1),
        torch.nn.functional.pad(x, (1, 1)), torch.select_scatter(x, x[0], 0, 1),
        torch.zeros_like(x.t()), torch.ones(2, dtype=x.dtype, device=x.device),
        torch.full((2,), 1 + 1j, dtype=x.dtype, device=x.device), x.clone().zero_()),
    "arithmetic CPU has": lambda x, i, m: (
        x + x[0], x * x, x - 1, x * 2, x + x.to(torch.complex64), -x, x.abs(), x.sgn(),
        x == x[0], x.isfinite(), x.clone().mul_(x),
        x.clone().conj_physical_(), torch.complex(x.real.clone(), x.imag.clone())),
}


def _same(actual, expected):
    for a, e in zip(actual, expected):
        a = a.cpu()
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, a.shape, e.dtype, e.shape)
        if e.dtype == torch.complex32:  # bitwise: both parts are float16
            a, e = torch.view_as_real(a), torch.view_as_real(e)
        assert torch.equal(a.float() if a.is_floating_point() else a,
                           e.float() if e.is_floating_point() else e)


@pytest.mark.parametrize("name", [n if n == "smoke" else pytest.param(n, marks=pytest.mark.full)
                                  for n in OPS])
def test_complex32_matches_cpu(name):
    x = _value().to(torch.complex32)
    expected = OPS[name](x, IDX, M)
    _same(OPS[name](x.to("tpu"), IDX.to("tpu"), M.to("tpu")), expected)


def test_complex32_compound_ops_round_once():
    # CPU rounds addcmul's product to complex32 before adding; CUDA computes it in complex64
    # (its opmath type) and rounds once, as tpu does: they differ by at most a float16 ulp.
    x = _value().to(torch.complex32)
    d = x.to("tpu")
    once = torch.addcmul(*(x.to(torch.complex64),) * 3).to(torch.complex32)
    _same([torch.addcmul(d, d, d)], [once])
    torch.testing.assert_close(torch.view_as_real(torch.addcmul(x, x, x)).float(),
                               torch.view_as_real(once).float(), atol=0, rtol=2 ** -10)


def test_complex32_rounds_where_values_are_stored_when_deferred():
    # Fused or not, an intermediate complex32 result is stored rounded to float16 pairs.
    x = _value().to(torch.complex32)
    expected = (x * 1.0001 + x) * x
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        d = x.to("tpu")
        actual = (d * 1.0001 + d) * d
    _same([actual], [expected])


def test_complex32_graphed_callable_binds_new_inputs():
    # A replay binds each new input's value to the captured storage, which holds float16 pairs.
    x = _value().to(torch.complex32)
    graphed = torch.tpu.make_graphed_callables(lambda a: a * a, (x.to("tpu"),))
    y = (x.to(torch.complex64) * 2.0001).to(torch.complex32)
    _same([graphed(y.to("tpu"))], [y * y])


def test_complex32_value_dependent_selection_keeps_its_dtype():
    x = _value().to(torch.complex32)
    d = x.to("tpu")
    for select in (lambda t: t[M.to(t.device)], lambda t: t.masked_select(M[:, None].to(t.device))):
        out = select(d)
        assert out.dtype is torch.complex32
        _same([out], [select(x)])
