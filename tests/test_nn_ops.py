"""Neural-network, convolution/pooling and linear-algebra ops: forward and backward against CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtpu.testing.compare import assert_same, to_device

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
