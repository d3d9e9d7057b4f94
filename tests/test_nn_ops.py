"""Neural-network, convolution/pooling and linear-algebra ops: forward and backward against CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtpu.testing.compare import assert_permutation, assert_same, check_against_cpu, to_device

TOL = {"atol": 1e-4, "rtol": 1e-4}


def _grad_inputs(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def check_fwd_bwd(fn, *args, **tol):
    """fn's result and the gradients of its inputs (those requiring grad) match CPU."""
    tol = tol or TOL
    expected = fn(*args)
    expected_grads = torch.autograd.grad(expected.sum(), _grad_inputs(args))
    dev_args = to_device(args)
    actual = fn(*dev_args)
    actual_grads = torch.autograd.grad(actual.sum(), _grad_inputs(dev_args))
    assert_same(actual, expected, **tol)
    assert_same(actual_grads, expected_grads, **tol)


def r(*shape):
    return torch.randn(*shape, requires_grad=True)


def _model():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * 4 * 4, 8), nn.LayerNorm(8), nn.GELU(), nn.Dropout(0.0),
        nn.Linear(8, 3),
    )


def test_sequential_train_and_eval():
    cpu = _model()
    dev = _model()
    dev.load_state_dict(cpu.state_dict())
    dev.to("tpu")
    x = r(2, 3, 8, 8)
    xd = to_device(x)
    for _ in range(2):  # two steps: running stats accumulate
        out_c, out_d = cpu(x), dev(xd)
        assert_same(out_d, out_c, **TOL)
        out_c.square().sum().backward()
        out_d.square().sum().backward()
    assert_same(xd.grad, x.grad, **TOL)
    for pc, pd in zip(cpu.parameters(), dev.parameters(), strict=True):
        assert_same(pd.grad, pc.grad, **TOL)
    bn_c, bn_d = cpu[1], dev[1]
    assert bn_d.num_batches_tracked.item() == 2
    assert_same(bn_d.running_mean, bn_c.running_mean, **TOL)
    assert_same(bn_d.running_var, bn_c.running_var, **TOL)
    # Eval mode normalizes with the running stats just compared.
    cpu.eval()
    dev.eval()
    x = r(2, 3, 8, 8)
    xd = to_device(x)
    out_c, out_d = cpu(x), dev(xd)
    assert_same(out_d, out_c, **TOL)
    out_c.sum().backward()
    out_d.sum().backward()
    assert_same(xd.grad, x.grad, **TOL)
    assert_same(bn_d.running_mean, bn_c.running_mean, **TOL)


@pytest.mark.parametrize("kind", ["conv1d", "conv3d", "transposed2d", "transposed1d"])
def test_convolution_variants(kind):
    if kind == "conv1d":
        check_fwd_bwd(lambda x, w: F.conv1d(x, w, padding=2, dilation=2, stride=2),
                      r(2, 3, 9), r(4, 3, 3))
    elif kind == "conv3d":
        check_fwd_bwd(lambda x, w, b: F.conv3d(x, w, b, stride=(1, 2, 1), groups=2),
                      r(1, 4, 4, 5, 4), r(6, 2, 2, 2, 2), r(6))
    elif kind == "transposed2d":
        check_fwd_bwd(lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1,
                                                         output_padding=1, groups=2, dilation=2),
                      r(2, 4, 5, 5), r(4, 3, 3, 3), r(6))
    else:
        check_fwd_bwd(lambda x, w: F.conv_transpose1d(x, w, stride=3, output_padding=2),
                      r(1, 2, 4), r(2, 3, 4))


def test_conv_transpose_module():
    cpu = nn.ConvTranspose2d(2, 3, 3, stride=2, output_padding=1)
    dev = nn.ConvTranspose2d(2, 3, 3, stride=2, output_padding=1)
    dev.load_state_dict(cpu.state_dict())
    dev.to("tpu")
    x = r(1, 2, 5, 5)
    xd = to_device(x)
    cpu(x).sum().backward()
    out = dev(xd)
    out.sum().backward()
    assert tuple(out.shape) == (1, 3, 12, 12)
    assert_same(xd.grad, x.grad, **TOL)
    assert_same(dev.weight.grad, cpu.weight.grad, **TOL)
    assert_same(dev.bias.grad, cpu.bias.grad, **TOL)


def test_pooling_and_upsampling():
    x = r(2, 3, 8, 7)
    check_fwd_bwd(lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=False), x)
    check_fwd_bwd(lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True), x)
    check_fwd_bwd(lambda t: F.avg_pool2d(t, 2, divisor_override=3), x)
    check_fwd_bwd(lambda t: F.max_pool2d(t, 3, 2, 1, ceil_mode=True), x)
    check_fwd_bwd(lambda t: F.adaptive_avg_pool2d(t, (3, 2)), x)
    check_fwd_bwd(lambda t: F.interpolate(t, size=(5, 9), mode="nearest"), x)
    check_fwd_bwd(lambda t: F.interpolate(t, scale_factor=1.5, mode="bilinear"), x)
    check_fwd_bwd(lambda t: F.interpolate(t, size=(4, 4), mode="bilinear", align_corners=True), x)
    v = r(1, 2, 5, 4, 5)
    check_fwd_bwd(lambda t: F.avg_pool3d(t, 2, ceil_mode=True), v)
    check_fwd_bwd(lambda t: F.max_pool3d(t, 2, padding=1), v)
    check_fwd_bwd(lambda t: F.adaptive_avg_pool3d(t, (3, 2, 2)), v)


def test_normalization_layers():
    check_fwd_bwd(lambda x, w, b: F.group_norm(x, 2, w, b), r(2, 4, 3, 3), r(4), r(4))
    check_fwd_bwd(lambda x, w: F.rms_norm(x, (5,), w), r(3, 5), r(5))
    check_fwd_bwd(lambda x, w, b: F.layer_norm(x, (5,), w, b), r(3, 5), r(5), r(5))


def test_group_norm_layouts_and_statistics():
    # channels_last input reaches native_group_norm as it is (PyTorch's composite kernel cannot
    # view it); 3-d spatial sizes, no affine, and the saved mean / rstd are CPU's too.
    x = r(2, 6, 3, 4).detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    check_fwd_bwd(lambda x, w, b: F.group_norm(x, 3, w, b), x, r(6), r(6))
    check_fwd_bwd(lambda x: F.group_norm(x, 2), r(3, 4, 2, 3, 2))
    args = (torch.randn(2, 6, 5), torch.randn(6), torch.randn(6), 2, 6, 5, 3, 1e-5)
    stats = torch.ops.aten.native_group_norm(*args)
    assert_same(torch.ops.aten.native_group_norm(*to_device(args)), stats, **TOL)
    half = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    assert_same(F.group_norm(half.to("tpu"), 2), F.group_norm(half, 2), atol=1e-2, rtol=1e-2)


def test_activations():
    x = r(3, 5)
    for fn in (lambda t: F.softmax(t, -1), lambda t: F.log_softmax(t, 0), F.gelu,
               lambda t: F.gelu(t, approximate="tanh"), F.silu, lambda t: F.leaky_relu(t, 0.2),
               F.elu, F.hardtanh, lambda t: F.softplus(t, 2, 1), F.mish, F.hardswish,
               F.hardsigmoid):
        check_fwd_bwd(fn, x)


def test_losses():
    target = torch.tensor([0, 1, -100, 3])
    check_fwd_bwd(lambda x, t: F.cross_entropy(x, t, ignore_index=-100, label_smoothing=0.1),
                  r(4, 5), target)
    check_fwd_bwd(lambda x, t, w: F.cross_entropy(x, t, weight=w, ignore_index=-100),
                  r(4, 5), target, torch.rand(5))
    check_fwd_bwd(lambda x, t: F.nll_loss(F.log_softmax(x, 1), t),
                  r(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4)))
    check_fwd_bwd(lambda x, t: F.nll_loss(x, t), r(5), torch.tensor(2))  # one sample, (C,)
    # CPU skips ignored samples: all ignored, the mean is NaN and the gradient 0 (not 0 / 0);
    # an ignored sample's loss is 0 where its class 0 is -inf, and its gradient 0 where the
    # output gradient is not finite.
    ignored = torch.full((4,), -100)
    check_fwd_bwd(lambda x, t: F.cross_entropy(x, t), r(4, 5), ignored)
    check_fwd_bwd(lambda x, t: F.nll_loss(x, t), r(5), ignored[0])
    minus_inf = torch.randn(4, 5)
    minus_inf[:, 0] = -torch.inf
    minus_inf.requires_grad_()
    check_fwd_bwd(lambda x, t: F.nll_loss(x, t, reduction="sum"), minus_inf,
                  torch.tensor([1, 1, -100, 3]))
    check_fwd_bwd(lambda x, t: F.nll_loss(x, t, reduction="none") * torch.tensor(
        [1.0, 1.0, torch.inf, 1.0], device=x.device), minus_inf, target)
    # A class masked out by -inf (never a target): the target's value is picked, not a NaN.
    masked = torch.randn(4, 5)
    masked[:, 4] = -torch.inf
    check_fwd_bwd(lambda x, t: F.cross_entropy(x, t), masked.requires_grad_(),
                  torch.tensor([0, 1, 2, 3]))
    check_fwd_bwd(lambda x, y: F.mse_loss(x, y), r(3, 5), r(3, 5))
    check_fwd_bwd(lambda x, y: F.binary_cross_entropy(torch.sigmoid(x), y), r(3, 5),
                  torch.rand(3, 5))
    check_fwd_bwd(lambda x, y, w: F.binary_cross_entropy_with_logits(x, y, pos_weight=w),
                  r(3, 5), torch.rand(3, 5), torch.rand(5))
    check_fwd_bwd(lambda x, y: F.smooth_l1_loss(x, y, beta=0.5), r(3, 5), r(3, 5))


def test_scaled_dot_product_attention():
    sdpa = F.scaled_dot_product_attention
    check_fwd_bwd(lambda q, k, v: sdpa(q, k, v, is_causal=True), r(2, 2, 4, 8), r(2, 2, 4, 8),
                  r(2, 2, 4, 8))
    bool_mask = torch.rand(4, 6) > 0.3
    bool_mask[:, 0] = True  # no fully masked row (CPU gives NaN there)
    check_fwd_bwd(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), r(2, 2, 4, 8), r(2, 2, 6, 8),
                  r(2, 2, 6, 8), bool_mask)
    check_fwd_bwd(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m, scale=0.3), r(2, 2, 4, 8),
                  r(2, 2, 6, 8), r(2, 2, 6, 8), r(4, 6))
    check_fwd_bwd(lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True), r(1, 4, 4, 8),
                  r(1, 2, 4, 8), r(1, 2, 4, 8))


def _spd(n, *batch):
    a = torch.randn(*batch, n, n)
    return (a @ a.mT + n * torch.eye(n)).requires_grad_()


def test_matrix_products():
    check_fwd_bwd(lambda a, b: torch.bmm(a, b), r(2, 3, 4), r(2, 4, 5))
    check_fwd_bwd(lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2), r(3, 5), r(3, 4),
                  r(4, 5))
    check_fwd_bwd(lambda c, a, b: torch.addbmm(c, a, b, beta=0.5, alpha=2), r(3, 5),
                  r(2, 3, 4), r(2, 4, 5))
    check_fwd_bwd(lambda c, a, b: torch.baddbmm(c, a, b, alpha=2), r(2, 3, 5), r(2, 3, 4),
                  r(2, 4, 5))
    check_fwd_bwd(lambda a, b: torch.dot(a, b), r(4), r(4))
    check_fwd_bwd(lambda a, b: torch.mv(a, b), r(3, 4), r(4))
    check_fwd_bwd(lambda c, a, b: torch.addmv(c, a, b, beta=0.5), r(3), r(3, 4), r(4))


def test_linalg_reports_singular_and_indefinite_inputs():
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.inv(torch.zeros(3, 3, device="tpu"))
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(-torch.eye(3, device="tpu"))


def test_linalg():
    la = torch.linalg
    check_fwd_bwd(la.inv, _spd(3, 2))
    check_fwd_bwd(la.solve, _spd(3, 2), r(2, 3, 2))
    check_fwd_bwd(lambda a, b: la.solve(a, b, left=False), _spd(3), r(2, 3))
    check_fwd_bwd(la.det, r(2, 3, 3))
    check_fwd_bwd(lambda a: la.slogdet(a)[1], r(2, 3, 3))
    check_fwd_bwd(la.cholesky, _spd(3, 2))
    check_fwd_bwd(lambda a: la.cholesky(a, upper=True), _spd(3))
    check_fwd_bwd(lambda a: la.qr(a)[1].abs(), r(4, 3))
    check_fwd_bwd(la.svdvals, r(4, 3))
    check_fwd_bwd(la.eigvalsh, _spd(3))
    check_fwd_bwd(lambda a: sum(t.sum() for t in la.lu(a)), r(2, 3, 5))
    upper = (torch.randn(3, 3).triu() + 3 * torch.eye(3)).requires_grad_()
    check_fwd_bwd(lambda a, b: la.solve_triangular(a, b, upper=True), upper, r(3, 2))
    check_fwd_bwd(lambda a, b: la.solve_triangular(a.mT, b, upper=False, left=False), upper,
                  r(2, 3))


def test_solve_gradients_and_empty_matrices():
    # solve saves the LU of A itself (det saves A^T's); the backward depends on which.
    check_fwd_bwd(torch.linalg.solve, r(5, 5), r(5))
    check_fwd_bwd(lambda a, b: torch.linalg.solve_ex(a, b)[0], r(2, 4, 4), r(2, 4, 3))
    check_fwd_bwd(torch.linalg.tensorsolve, r(6, 2, 3), r(6))
    for fn in (torch.linalg.inv, torch.linalg.cholesky, torch.linalg.inv_ex,
               torch.linalg.cholesky_ex):
        check_against_cpu(fn, torch.empty(2, 0, 0))


def test_linalg_factorization_helpers():
    spd = _spd(4, 2)
    factor = torch.linalg.cholesky(spd).detach().requires_grad_()
    check_fwd_bwd(torch.cholesky_solve, r(2, 4, 3), factor)
    check_fwd_bwd(lambda b, u: torch.cholesky_solve(b, u, upper=True), r(4, 2),
                  factor[0].mT.detach().requires_grad_())
    check_fwd_bwd(torch.cholesky_inverse, factor[0].detach().requires_grad_())
    a = torch.randn(5, 3)
    check_against_cpu(torch.geqrf, a, atol=1e-5, rtol=1e-5)
    h, tau = torch.geqrf(a)
    check_fwd_bwd(torch.linalg.householder_product, h.requires_grad_(), tau.requires_grad_())
    check_against_cpu(lambda *t: torch.ormqr(*t, left=False, transpose=True), h, tau,
                      torch.randn(2, 5), atol=1e-5, rtol=1e-5)
    m = torch.randn(2, 4, 4)
    check_eig(m)
    check_against_cpu(torch.linalg.matrix_exp, m, atol=1e-5, rtol=1e-5)


def assert_same_spectrum(actual, expected, atol=1e-5):
    """Equal multisets of eigenvalues along the last dim: LAPACK builds order them differently."""
    distance = (actual[..., :, None] - expected[..., None, :]).abs()
    nearest = distance.argmin(-1)
    assert_permutation(nearest)  # each eigenvalue pairs with a different one
    torch.testing.assert_close(actual, expected.gather(-1, nearest), atol=atol, rtol=atol)


def check_eig(m):
    """What linalg.eig defines: A V = V diag(w), unit-norm columns, the spectrum. The order of
    the eigenvalues and each eigenvector's phase are the implementation's choice."""
    w, v = (t.cpu() for t in torch.linalg.eig(m.to("tpu")))
    a = m.to(w.dtype)
    torch.testing.assert_close(a @ v, v * w.unsqueeze(-2), atol=1e-5, rtol=1e-5)
    norms = torch.linalg.vector_norm(v, dim=-2)
    torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-5, rtol=1e-5)
    expected = torch.linalg.eigvals(m)
    assert_same_spectrum(w, expected)
    assert_same_spectrum(torch.linalg.eigvals(m.to("tpu")).cpu(), expected)


@pytest.mark.parametrize("p", [0.0, 1.0, 1.5, 2.0, 3.0, float("inf")])
def test_cdist_pdist(p):
    x1, x2 = torch.randn(2, 4, 3), torch.randn(2, 5, 3)
    x2[0, 1] = x1[0, 1]  # a zero distance: PyTorch's gradient is 0 there
    check_fwd_bwd(lambda a, b: torch.cdist(a, b, p=p), x1.requires_grad_(), x2.requires_grad_())
    check_fwd_bwd(lambda a: torch.pdist(a, p=p), torch.cat([x1[1], x1[1, :1]]).detach()
                  .requires_grad_())
    if p == 2:  # more than 25 rows: the CPU switches to the matmul formula
        check_fwd_bwd(torch.cdist, r(30, 3), r(27, 3))


def test_adaptive_max_pool_and_upsampling_backwards():
    for fn, x in ((lambda t: F.adaptive_max_pool1d(t, 4, True), torch.randn(2, 3, 7)),
                  (lambda t: F.adaptive_max_pool2d(t, (3, 4), True), torch.randn(2, 3, 7, 9)),
                  (lambda t: F.adaptive_max_pool3d(t, (2, 3, 4), True), torch.randn(2, 5, 6, 7))):
        check_against_cpu(fn, x)  # values and indices
        check_fwd_bwd(lambda t, f=fn: f(t)[0], x.requires_grad_())
    x = r(1, 2, 5, 6)
    check_fwd_bwd(lambda t: F.interpolate(t, size=(7, 4), mode="nearest-exact"), x)
    check_fwd_bwd(lambda t: F.interpolate(t[0], size=9, mode="nearest-exact"), x)
    check_fwd_bwd(lambda t: F.interpolate(t, size=(7, 4), mode="bicubic"), x)
    for align in (False, True):
        check_fwd_bwd(lambda t, a=align: F.interpolate(t, size=(3, 11), mode="bilinear",
                                                      antialias=True, align_corners=a), x)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_antialiased_upsampling_uint8(mode):
    # CPU filters uint8 images width then height, rounding and clamping after each pass; its
    # fixed-point weights may still differ by one in a few pixels.
    x = torch.randint(0, 256, (1, 3, 40, 30), dtype=torch.uint8)
    for size, align in ((9, 7), False), ((57, 45), True):
        expected = F.interpolate(x, size=size, mode=mode, antialias=True, align_corners=align)
        actual = F.interpolate(x.to("tpu"), size=size, mode=mode, antialias=True,
                               align_corners=align).cpu()
        assert actual.dtype == torch.uint8
        diff = (actual.int() - expected.int()).abs()
        assert diff.max() <= 1 and diff.float().mean() < 0.02, (diff.max(), diff.float().mean())


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8])
@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic", "linear"])
def test_upsampling_integer_inputs(mode, dtype):
    # CPU refuses integer inputs, but uint8 in 2-d and nearest modes: tpu refuses the same
    # calls with CPU's error, and computes the others as CPU does.
    x = torch.arange(32).reshape((1, 2, 16) if mode == "linear" else (1, 2, 4, 4)).to(dtype)

    def outcome(t):
        try:
            return F.interpolate(t, scale_factor=1.5, mode=mode), None
        except Exception as e:
            return None, e

    (expected, cpu_error), (actual, tpu_error) = outcome(x), outcome(x.to("tpu"))
    if cpu_error is not None:
        assert (type(tpu_error), str(tpu_error)) == (type(cpu_error), str(cpu_error))
    else:
        assert tpu_error is None, tpu_error
        assert_same(actual, expected, atol=1, rtol=0)  # uint8 rounding may differ by one


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_antialiased_upsampling(mode, dtype):
    # Down- and upscaling, both corner modes; float64 to float64's precision (CPU computes a
    # float64 input's filter weights in float64).
    tol = {"atol": 1e-12, "rtol": 1e-12} if dtype == torch.float64 else TOL
    x = torch.randn(1, 2, 9, 7, dtype=dtype, requires_grad=True)
    for size, align in ((4, 3), False), ((4, 3), True), ((13, 10), False), ((13, 10), True):
        check_fwd_bwd(lambda t, s=size, a=align: F.interpolate(
            t, size=s, mode=mode, antialias=True, align_corners=a), x, **tol)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample(mode):
    grid = (torch.rand(2, 4, 3, 2) * 2.4 - 1.2).requires_grad_()
    for padding in ("zeros", "border", "reflection"):
        check_fwd_bwd(lambda x, g, p=padding: F.grid_sample(x, g, mode=mode, padding_mode=p,
                                                            align_corners=p == "border"),
                      r(2, 3, 5, 6), grid)


def test_embedding_bag():
    weight, weights = r(10, 3), torch.rand(8, requires_grad=True)
    idx, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4, 4])
    for mode in ("sum", "mean", "max"):
        check_fwd_bwd(lambda w, m=mode: F.embedding_bag(idx.to(w.device), w,
                                                        offsets.to(w.device), mode=m,
                                                        padding_idx=4), weight)
    check_fwd_bwd(lambda w, s: F.embedding_bag(idx.to(w.device), w, offsets.to(w.device),
                                               mode="sum", per_sample_weights=s), weight, weights)
    check_fwd_bwd(lambda w: F.embedding_bag(idx.reshape(2, 4).to(w.device), w, mode="max"),
                  weight)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_include_last_offset_repeated(mode):
    # TorchRec's pooled lookups (offsets of batch + 1 entries). The second call repeats the
    # first's signature (Strict's short path), whose bag sizes are made in the meta kernel's
    # shape, one per offset: a lowering giving one per bag left them reaching past their
    # array, and the backward refused them.
    weight = r(16, 8)
    idx, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 2, 4, 5])
    for _ in range(2):
        check_fwd_bwd(lambda w: F.embedding_bag(idx.to(w.device), w, offsets.to(w.device),
                                                mode=mode, include_last_offset=True), weight)


def test_margin_losses_and_shrink():
    x = r(4, 5)
    target = torch.tensor([1, 0, 4, 2])
    for p, reduction in ((1, "mean"), (2, "none")):
        check_fwd_bwd(lambda t, y, w, p=p, red=reduction: F.multi_margin_loss(
                          t, y, p=p, margin=0.7, weight=w, reduction=red),
                      x, target, torch.rand(5))
    # Labels stop at the first -1; PyTorch's decomposition also counted the slots after it.
    labels = torch.tensor([[1, 3, -1, 0, 0], [0, -1, 2, 2, 2], [4, 3, 2, 1, 0], [-1, 0, 0, 0, 0]])
    for reduction in ("none", "sum"):
        check_fwd_bwd(lambda t, y, red=reduction: F.multilabel_margin_loss(t, y, reduction=red),
                      x, labels)
    check_fwd_bwd(lambda t: F.softshrink(t, 0.5) + F.hardshrink(t, 0.7), x)
    scalar = torch.randn((), requires_grad=True)  # a 0-dim input: one sample, one class
    check_fwd_bwd(lambda t, y: F.multi_margin_loss(t, y), scalar, torch.tensor(0))
    check_fwd_bwd(lambda t, y: F.multilabel_margin_loss(t, y), scalar, torch.tensor(0))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_nll_loss_uint8_target(reduction):
    # CPU takes uint8 class indices (PyTorch's meta kernels want int64), forward and backward;
    # per pixel (nll_loss2d) it refuses them, and so must tpu, in CPU's words.
    x = torch.randn(6, 4).log_softmax(1).requires_grad_()
    target = torch.randint(0, 4, (6,), dtype=torch.uint8)
    check_fwd_bwd(lambda t, y: F.nll_loss(t, y, reduction=reduction), x, target)
    x, target = torch.randn(2, 3, 4, 5), torch.zeros(2, 4, 5, dtype=torch.uint8)
    with pytest.raises(RuntimeError) as cpu_error:
        F.nll_loss(x, target, reduction=reduction)
    with pytest.raises(RuntimeError) as tpu_error:
        F.nll_loss(x.to("tpu"), target.to("tpu"), reduction=reduction)
    assert str(tpu_error.value) == str(cpu_error.value)


def test_threshold():
    # Its scalars are cast to the input's dtype before comparing (-1.5 -> -1 for integers,
    # 2.001 -> 2 in bfloat16); NaN stays NaN.
    for x, th, value in ((torch.tensor([1.0, float("nan"), -2.0, 0.5]), 0.5, -1.0),
                         (torch.tensor([-1, -2, 0, 3]), -1.5, 9),
                         (torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16), 2.001, 0.1)):
        check_against_cpu(lambda t, a=th, b=value: torch.threshold(t, a, b), x)
    # In place into an expand-ed tensor, which CPU writes (threshold is idempotent).
    base = torch.randn(1, 6)
    expected, actual = base.clone().expand(6, 6), base.to("tpu").expand(6, 6)
    F.threshold(expected, 0.2, 0.5, inplace=True)
    F.threshold_(actual, 0.2, 0.5)
    assert_same(actual, expected)


def test_ctc_loss():
    log_probs = torch.randn(7, 3, 5).log_softmax(2).detach().requires_grad_()
    padded = torch.tensor([[1, 2, 2], [3, 1, 0], [4, 0, 0]])
    lengths = ([7, 6, 5], [3, 2, 0])  # a repeated label, a shorter input, an empty target
    for targets, reduction in ((padded, "mean"), (torch.tensor([1, 2, 2, 3, 1]), "none")):
        check_fwd_bwd(lambda lp, t, red=reduction: F.ctc_loss(lp, t, *lengths, reduction=red),
                      log_probs, targets)
    # No alignment fits: infinite loss, zeroed with zero_infinity.
    check_fwd_bwd(lambda lp, t: F.ctc_loss(lp, t, [3], [3], zero_infinity=True),
                  log_probs[:3, :1].detach().requires_grad_(), torch.tensor([[1, 1, 1]]))
    # Every target empty (l' one blank wide), concatenated and padded: -sum of blank log-probs.
    for targets in (torch.zeros(0, dtype=torch.long), torch.zeros(3, 0, dtype=torch.long)):
        check_fwd_bwd(lambda lp, t: F.ctc_loss(lp, t, [7, 6, 5], [0, 0, 0], reduction="none"),
                      log_probs, targets)


def test_lstsq_drivers():
    # Each driver returns a different set of results (rank, singular values, residuals).
    torch.manual_seed(0)
    for driver in ("gels", "gelsy", "gelsd", "gelss"):
        for m, n in ((4, 3), (2, 3)):
            check_against_cpu(lambda a, b, d=driver: tuple(torch.linalg.lstsq(a, b, driver=d)),
                              torch.randn(2, m, n), torch.randn(2, m, 2), atol=1e-5, rtol=1e-5)
    deficient = torch.randn(5, 3)
    deficient[:, 2] = deficient[:, 1]  # rank 2: min-norm solution, no residuals for gelsd
    check_against_cpu(lambda a, b: tuple(torch.linalg.lstsq(a, b, driver="gelsd")), deficient,
                      torch.randn(5, 2), atol=1e-5, rtol=1e-5)
    check_against_cpu(lambda a, b: tuple(torch.linalg.lstsq(a, b, driver="gels")),
                      torch.randn(4, 3), torch.randn(4), atol=1e-5, rtol=1e-5)
    check_fwd_bwd(lambda a, b: torch.linalg.lstsq(a, b).solution, r(3, 4, 3), r(3, 4, 2))


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_inference_fast_paths(monkeypatch, norm_first):
    # Eval mode without autograd takes PyTorch's fused ops on tpu too; they must run on the
    # device (no CPU fallback) and give CPU's numbers, padding and causal masks included.
    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "error")
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True,
                                       norm_first=norm_first, activation="gelu").eval()
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x, memory = torch.randn(3, 5, 16), torch.randn(3, 7, 16)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    calls = [
        (layer, (x,), {"src_key_padding_mask": padding}),
        (layer, (x,), {"src_mask": causal}),
        (mha, (x, memory, memory), {"key_padding_mask": torch.zeros(3, 7, dtype=torch.bool)}),
        (mha, (x, x, x), {"average_attn_weights": False}),
    ]
    with torch.no_grad():
        for module, args, kwargs in calls:
            expected = module(*args, **kwargs)
            actual = module.to("tpu")(*to_device(args), **to_device(kwargs))
            module.cpu()
            assert_same(actual, expected, **TOL)


def test_eig_on_a_tpu_takes_the_counted_cpu_fallback(monkeypatch):
    # JAX has no TPU rule for a nonsymmetric eig (NotImplementedError on a v5e chip): there
    # the op has no lowering, so it runs on CPU, counted; on CPU it is LAPACK through XLA.
    from torchtpu.lowering import registry
    from torchtpu.runtime import platform

    eig, eigvals = torch.ops.aten.linalg_eig.default, torch.ops.aten._linalg_eigvals.default
    assert registry.lookup(eig) is not None and registry.lookup(eigvals) is not None
    monkeypatch.setattr(platform, "platform", lambda: "tpu")
    assert registry.lookup(eig) is None and registry.lookup(eigvals) is None
    assert registry.lookup(torch.ops.aten.mm.default) is not None
