"""Reductions, scans and sorts against CPU: dtypes, dim/keepdim, NaN and tie semantics."""

import math

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

from torchtpu.testing.compare import assert_permutation, assert_same, check_against_cpu


def _with_nan(x):
    x = x.clone()
    x[1, 2] = math.nan
    return x


X = torch.randn(3, 5)
INTS = torch.randint(-5, 6, (3, 5))

DIMS = [{}, {"dim": 1}, {"dim": -2, "keepdim": True}, {"dim": (0, 1)}]
REDUCE = ["sum", "mean", "prod", "amax", "amin", "nansum", "logsumexp", "var", "std",
          "var_mean", "std_mean", "count_nonzero", "any", "all", "norm", "nanmean"]


@pytest.mark.parametrize("kw", DIMS, ids=str)
@pytest.mark.parametrize("name", REDUCE)
def test_reductions(name, kw):
    fn = getattr(torch, name)
    if name == "count_nonzero":
        kw = {k: v for k, v in kw.items() if k != "keepdim"}
    if name == "logsumexp" and "dim" not in kw:
        kw = {"dim": (0, 1)}
    if name == "prod" and isinstance(kw.get("dim"), tuple):
        kw = {"dim": 0}  # prod takes a single dim
    x = X if name not in ("any", "all") else X > 0
    check_against_cpu(lambda x: fn(x, **kw), x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["sum", "prod", "amax", "amin", "count_nonzero", "any", "all",
                                  "cumsum", "cumprod", "max", "nansum"])
def test_reductions_int(name):
    fn = getattr(torch, name)
    if name.startswith("cum"):
        fn = lambda x, f=fn: f(x, 1)  # noqa: E731
    check_against_cpu(fn, INTS)  # sum/prod/cumsum of int64 stay int64
    check_against_cpu(fn, INTS.to(torch.int32))  # and int32 -> int64
    check_against_cpu(fn, INTS > 0)  # bool


def test_dtype_argument_and_half():
    check_against_cpu(lambda x: (torch.sum(x, dtype=torch.float64), x.sum(1, dtype=torch.int32),
                                 x.prod(0, dtype=torch.float32), x.cumsum(0, dtype=torch.float64)),
                      INTS)
    check_against_cpu(lambda x: torch.mean(x, dtype=torch.float64), X)
    for dtype in (torch.float16, torch.bfloat16):
        check_against_cpu(lambda x: (x.sum(), x.mean(1), x.var()), X.to(dtype), atol=1e-2,
                          rtol=1e-2)
    with pytest.raises(RuntimeError):
        INTS.to("tpu").mean()  # as on CPU: mean of integers is refused


def test_var_std_correction():
    for corr in (0, 1, 2.5, 5):
        check_against_cpu(lambda x, c: (torch.var(x, 1, correction=c),
                                        torch.std_mean(x, 0, correction=c, keepdim=True)),
                          X, corr, atol=1e-5, rtol=1e-5)
    check_against_cpu(lambda x: (x.var(unbiased=False), x.std(1, unbiased=True)), X)
    z = torch.randn(3, 4, dtype=torch.complex64)
    check_against_cpu(lambda z: (z.var(1), z.sum(), z.mean(0)), z, atol=1e-5, rtol=1e-5)


def test_norms():
    for ord_ in (2, 1, 0, math.inf, -math.inf, 3, 0.5):
        check_against_cpu(lambda x, o: torch.linalg.vector_norm(x, o, dim=1), X, ord_,
                          atol=1e-5, rtol=1e-5)
    check_against_cpu(lambda x: (x.norm(), x.norm(p=1, dim=0, keepdim=True),
                                 torch.linalg.norm(x, dim=1)), X, atol=1e-5, rtol=1e-5)


def test_max_min_nan_and_ties():
    x = torch.tensor([[1.0, 3.0, 3.0, -1.0], [2.0, math.nan, 5.0, math.nan]])
    check_against_cpu(lambda x: (x.max(), x.min(), x.amax(1), x.amin(0)), x)
    check_against_cpu(lambda x: (x.max(1), x.min(1, keepdim=True), x.max(0)), x)
    check_against_cpu(lambda x: (x.argmax(), x.argmin(1), x.argmax(1, keepdim=True),
                                 x.argmax(keepdim=True)), x)
    check_against_cpu(lambda x: torch.aminmax(x, dim=1), x)
    i = torch.tensor([[4, 1, 4, 1]])
    check_against_cpu(lambda i: (i.argmax(1), i.argmin(1), i.max(1), i.min(1)), i)
    check_against_cpu(lambda x, y: (torch.max(x, y), torch.min(x, y)), X, X.flip(0))


def test_scans():
    x = _with_nan(X)
    check_against_cpu(lambda x: (x.cumsum(1), x.cumprod(0), torch.logcumsumexp(x, 1)), X,
                      atol=1e-5, rtol=1e-5)
    check_against_cpu(lambda x: (x.cummax(1), x.cummin(0)), x)
    ties = torch.tensor([[1, 3, 3, 2, 3], [5, 5, 1, 0, 0]])
    check_against_cpu(lambda t: (t.cummax(1), t.cummin(1)), ties)
    check_against_cpu(lambda s: (s.cumsum(0), s.cummax(0)), torch.tensor(2.5))


def check_unstable_sort(x, dim=-1, descending=False):
    """An unstable sort defines the values, not which of equal elements comes first: the
    indices must be a permutation that gathers the values."""
    values, indices = (t.cpu() for t in x.to("tpu").sort(dim, descending=descending))
    assert_same(values, x.sort(dim, descending=descending).values, atol=0, rtol=0)
    assert_same(x.gather(dim, indices), values, atol=0, rtol=0)
    assert_permutation(indices, dim)
    argsorted = x.to("tpu").argsort(dim, descending=descending).cpu()
    assert_same(x.gather(dim, argsorted), values, atol=0, rtol=0)


def test_sort_family():
    x = torch.tensor([[3.0, 1.0, math.nan, 1.0, -0.0, 0.0, 2.0],
                      [5.0, 5.0, -1.0, math.inf, 5.0, -math.inf, 0.0]])
    check_against_cpu(lambda x: (x.sort(dim=0, stable=True),
                                 x.sort(stable=True, descending=True)), x)
    check_against_cpu(lambda x: torch.argsort(x, dim=1, descending=True, stable=True), x)
    for t, kw in ((x, {}), (x, {"descending": True}), (INTS, {"dim": 1, "descending": True}),
                  (INTS > 0, {"dim": 1})):
        check_unstable_sort(t, **kw)
    y = torch.randperm(12).reshape(3, 4).float()  # distinct values: topk/kthvalue are determined
    check_against_cpu(lambda y: (y.topk(2), y.topk(3, dim=0, largest=False), y.topk(4, 1),
                                 y.kthvalue(2), y.kthvalue(1, 0, keepdim=True)), y)
    n = torch.tensor([[3.0, math.nan, -1.0, 7.0], [0.5, 2.0, math.inf, 1.0]])
    check_against_cpu(lambda n: (n.topk(2), n.topk(2, largest=False)), n)  # NaN is the largest


def test_median():
    y = torch.randperm(15).reshape(3, 5).float()
    check_against_cpu(lambda y: (y.median(), y.median(1), y.median(0, keepdim=True),
                                 y.nanmedian(), y.nanmedian(1)), y)
    z = _with_nan(y)
    check_against_cpu(lambda z: (z.median(), z.median(1).values, z.nanmedian(),
                                 z.nanmedian(1)), z)


def test_out_and_inplace():
    def fn(x):
        s = torch.empty(0, device=x.device)
        torch.sum(x, 1, out=s)
        v = torch.empty(0, device=x.device)
        i = torch.empty(0, dtype=torch.long, device=x.device)
        torch.max(x, 0, out=(v, i))
        c = x.clone()
        c[1:].cumsum_(1)
        return s, v, i, c

    assert_same(fn(X.to("tpu")), fn(X))


def test_mode():
    x = torch.tensor([[3.0, 1, 3, 1, 2, 2, 2, 1], [5, 5, 5, 4, 4, 4, 4, 0]])
    check_against_cpu(lambda x: (x.mode(), x.mode(0), x.mode(1, keepdim=True),
                                 torch.tensor(2.0, device=x.device).mode()), x)


def test_logcumsumexp_gradient_at_large_values():
    # The backward cancels terms of size |x|: it matches CPU only if the forward accumulates
    # float32 in float64 as CPU does.
    x = torch.cat([torch.full((1, 5), 1e4), torch.randn(4, 5) * 5])
    g = torch.randn(5, 5)

    def grad(x, g):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(torch.logcumsumexp(x, 0), x, g)[0]

    assert_same(grad(x.to("tpu"), g.to("tpu")), grad(x, g))


def test_histograms():
    # Outer edges inclusive, the last bin closed, NaN and out-of-range points ignored.
    x = torch.tensor([0.0, 1.0, 1.0, 2.5, 3.0, math.nan, -1.0, 4.0, 2.0, 0.75])
    w = torch.arange(10.0)
    check_against_cpu(lambda x: torch.histc(x, bins=4, min=0, max=3), x)
    check_against_cpu(lambda x: torch.histc(x, bins=5, min=2, max=2), x[:5])  # data's extent
    check_against_cpu(lambda x: torch.histc(x, bins=3), torch.full((3,), 2.0))  # widened by 1
    check_against_cpu(lambda x: torch.histogram(x, bins=3), x[:5])
    check_against_cpu(lambda x: torch.histogram(x, bins=3, density=True), torch.full((3,), 2.0))
    check_against_cpu(lambda x, w: torch.histogram(x, bins=4, range=(0.0, 3.0), weight=w,
                                                   density=True), x, w)
    check_against_cpu(lambda x, b, w: torch.histogram(x, b, weight=w), x,
                      torch.tensor([0.0, 0.5, 2.0, 3.0]), w)
    # Points on interior edges: linear interpolation must agree with the edge comparisons.
    check_against_cpu(lambda x: torch.histogram(x, bins=13), torch.linspace(0, 1, 101) * 3.3)
    pts = torch.randn(40, 2)
    check_against_cpu(lambda p: torch.histogramdd(p, bins=[3, 4], range=[-1.0, 1.0, 0.0, 1.0],
                                                  density=True), pts)
    check_against_cpu(lambda p, b0, b1, w: torch.histogramdd(p, bins=[b0, b1], weight=w), pts,
                      torch.tensor([-1.0, 0.0, 2.0]), torch.tensor([-2.0, 0.0, 1.0]),
                      torch.rand(40))


def test_hash_tensor():
    # An xor of the values' 64-bit patterns (floats as float64, integers as int64).
    x = torch.tensor([[1.0, -0.0, math.nan], [2.0, 3.0, 4.0]])
    check_against_cpu(lambda x: torch.hash_tensor(x, dim=1, keepdim=True), x)
    # Widened from float32 bits with 32-bit integer ops (a TPU's float64 is a pair of float32s):
    # zeros, infinities, NaNs of both signs and subnormals, which become normal float64s.
    edge = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-40, -1e-45,
                         1.17549435e-38, 3.4e38, 0.1, -2.5])
    # NaNs of other payloads, quiet and signaling, keep sign and payload (a TPU's conversions
    # would make each the canonical NaN, as they did on a v5e chip).
    nans = {torch.float32: (torch.int32, [-4194303, 2139095041, -1]),  # 0xFFC00001 0x7F800001
            torch.bfloat16: (torch.int16, [-63, 32641, -1]),            # 0xFFC1 0x7F81
            torch.float16: (torch.int16, [-511, 31745, -1])}            # 0xFE01 0x7C01
    for dtype, (as_int, patterns) in nans.items():
        values = torch.cat([edge.to(dtype), torch.tensor(patterns, dtype=as_int).view(dtype)])
        check_against_cpu(lambda e: [torch.hash_tensor(v) for v in e.unbind()], values)


def test_float32_hash_needs_no_float64_on_a_tpu():
    from torchtpu.lowering.reduction import hash_tensor

    x = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    text = jax.export.export(jax.jit(lambda x: hash_tensor(x, [1])), platforms=["tpu"])(x)
    assert "f64" not in text.mlir_module()
    check_against_cpu(torch.hash_tensor, torch.tensor([[1, 2, 3], [-4, 5, 6]], dtype=torch.int32))
    check_against_cpu(torch.hash_tensor, torch.tensor([True, False, True]))


@pytest.mark.parametrize("weights", [None, torch.float32, torch.float64, torch.int64, torch.half])
def test_bincount_counts_and_weighs_like_cpu(weights):
    x = torch.tensor([3, 0, 3, 7, 1, 3])
    w = None if weights is None else torch.tensor([0.5, 1, 2, 3, 4, 5]).to(weights)
    for minlength in (0, 4, 12):
        # Weighted sums keep float32, every other weight dtype sums in float64 (as on CPU).
        check_against_cpu(lambda a, b, m=minlength: torch.bincount(a, b, minlength=m), x, w)
    empty_weights = None if w is None else w[:0]
    check_against_cpu(lambda a, b: torch.bincount(a, b, minlength=3), x[:0], empty_weights)


def test_bincount_refuses_what_cpu_refuses():
    for bad in (torch.tensor([1, -1]), torch.tensor([[1]]), torch.tensor([1.0])):
        with pytest.raises((RuntimeError, NotImplementedError)) as cpu:
            torch.bincount(bad)
        with pytest.raises(type(cpu.value), match=str(cpu.value)[:20]):
            torch.bincount(bad.to("tpu"))


def test_scan_outs_of_another_dtype_are_refused_as_on_cpu():
    # logcumsumexp, cummax and cummin want out= of the input's dtype exactly (indices int64);
    # their meta kernels cast, so tpu wrote float32 results into them (test_torch's
    # test_logcumsumexp).
    x = torch.randn(5, 2, dtype=torch.float64)
    calls = [
        lambda x, d: torch.logcumsumexp(x, 1, out=torch.zeros(5, 2, device=d)),
        lambda x, d: torch.cummax(x, 1, out=(torch.zeros(5, 2, device=d),
                                             torch.zeros(5, 2, dtype=torch.long, device=d))),
        lambda x, d: torch.cummin(x, 1, out=(torch.zeros(5, 2, dtype=torch.float64, device=d),
                                             torch.zeros(5, 2, dtype=torch.int32, device=d))),
    ]
    for call in calls:
        with pytest.raises(RuntimeError) as cpu:
            call(x, "cpu")
        with pytest.raises(RuntimeError, match=str(cpu.value)):
            call(x.to("tpu"), "tpu")
    out = torch.zeros(5, 2, dtype=torch.float64, device="tpu")
    torch.logcumsumexp(x.to("tpu"), 1, out=out)  # the same dtype is fine
    assert_same(out, torch.logcumsumexp(x, 1))


@pytest.mark.parametrize("shape", [(0, 0), (3, 4), (2, 4, 3, 3)], ids=["empty", "1d", "2d"])
def test_nll_loss_refuses_class_weights_of_another_dtype_as_cpu(shape):
    # test_modules' NLLLoss error input: the meta kernel does not check the weight's dtype.
    def call(device):
        x = torch.randn(shape, device=device)
        target = torch.zeros((shape[0], *shape[2:]), dtype=torch.long, device=device)
        F.nll_loss(x, target, weight=torch.ones(shape[1], dtype=torch.float16, device=device))

    with pytest.raises(RuntimeError) as cpu:
        call("cpu")
    with pytest.raises(RuntimeError, match=str(cpu.value)):
        call("tpu")


@pytest.mark.parametrize("warn_only", [False, True])
def test_deterministic_mode_runs_median_dim_and_histc_as_cpu_does(warn_only):
    """PyTorch's meta kernels raise CUDA's deterministic alerts for these; CPU raises none."""
    x = torch.randn(4, 7)
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warn_only must not warn either
            check_against_cpu(lambda a: torch.median(a, 1), x)
            check_against_cpu(lambda a: torch.histc(a, bins=5, min=-1, max=1), x)
            check_against_cpu(lambda a: torch.histc(a, min=0, max=3), x[:0, 0])
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled() == warn_only
    finally:
        torch.use_deterministic_algorithms(False)
