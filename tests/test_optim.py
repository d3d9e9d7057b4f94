"""Optimizers on the device: _foreach_* ops, fused Adam/AdamW, and every optimizer code path
(fused, foreach, for-loop) giving CPU's parameters."""

import copy

import pytest
import torch

from torchtpu.testing.compare import assert_same, check_against_cpu, to_device


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(model, make_opt, device: str, steps: int = 3) -> list:
    model = copy.deepcopy(model).to(device)
    opt = make_opt(model.parameters())
    torch.manual_seed(2)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x.to(device)) - y.to(device)) ** 2).mean()
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def _adamw(**kw):
    return lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, **kw)


@pytest.mark.parametrize("mode", ["fused", "foreach", "loop"])
def test_adamw_paths_match_cpu(mode):
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[mode]
    model = _model()
    expected = _train(model, _adamw(foreach=False), "cpu")
    actual = _train(model, _adamw(**kw), "tpu")
    assert_same(actual, expected, rtol=1e-5, atol=1e-6)


def test_fused_adam_amsgrad_maximize_matches_cpu():
    def make(**kw):
        return lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1, amsgrad=True,
                                           maximize=True, **kw)

    model = _model()
    expected = _train(model, make(foreach=False), "cpu")
    assert_same(_train(model, make(fused=True), "tpu"), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["fused", "foreach", "loop"])
def test_sgd_momentum_weight_decay_matches_cpu(mode):
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[mode]
    def make(**kw):
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01,
                                          nesterov=True, **kw)

    model = _model()
    expected = _train(model, make(foreach=False), "cpu")
    assert_same(_train(model, make(**kw), "tpu"), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_matches_cpu(norm_type):
    torch.manual_seed(3)
    grads = [torch.randn(4, 3) * 5, torch.randn(7), torch.randn(2, 2, 2)]

    def clip(gs):
        params = [torch.zeros_like(g, requires_grad=True) for g in gs]
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type)
        return norm, [p.grad for p in params]

    check_against_cpu(clip, grads, rtol=1e-5, atol=1e-6)


def test_foreach_ops_match_cpu():
    torch.manual_seed(4)
    xs = [torch.rand(3, 2) + 0.5, torch.rand(5) + 0.5]
    ys = [torch.rand(3, 2) + 0.5, torch.rand(5) + 0.5]
    zs = [torch.rand(3, 2) + 0.5, torch.rand(5) + 0.5]

    def ops(xs, ys, zs, scalar_t):
        out = {
            "add_s": torch._foreach_add(xs, 2.5),
            "add_l": torch._foreach_add(xs, ys, alpha=-0.5),
            "add_sl": torch._foreach_add(xs, [1.0, -2.0]),
            "mul_t": torch._foreach_mul(xs, scalar_t),
            "div_l": torch._foreach_div(xs, ys),
            "sub_s": torch._foreach_sub(xs, 1),
            "addcmul": torch._foreach_addcmul(xs, ys, zs, value=0.3),
            "addcdiv_sl": torch._foreach_addcdiv(xs, ys, zs, [0.1, -0.2]),
            "addcdiv_t": torch._foreach_addcdiv(xs, ys, zs, torch.tensor([0.5, 2.0])),
            "lerp_s": torch._foreach_lerp(xs, ys, 0.7),
            "lerp_l": torch._foreach_lerp(xs, ys, zs),
            "pow_st": torch._foreach_pow(2.0, xs),
            "pow_s": torch._foreach_pow(xs, 3),
            "maximum": torch._foreach_maximum(xs, ys),
            "clamp_max": torch._foreach_clamp_max(xs, 0.8),
            "sqrt": torch._foreach_sqrt(xs),
            "neg_sign": torch._foreach_sign(torch._foreach_neg(xs)),
            "exp": torch._foreach_exp(xs),
            "norm2": torch._foreach_norm(xs),
            "norm1": torch._foreach_norm(xs, 1),
            "norm_inf": torch._foreach_norm(xs, float("inf")),
            "max": torch._foreach_max(xs),
        }
        inplace = [x.clone() for x in xs]
        torch._foreach_mul_(inplace, 3.0)
        torch._foreach_addcmul_(inplace, ys, zs, value=2)
        out["inplace"] = inplace
        copied = [x.clone() for x in xs]
        torch._foreach_copy_(copied, ys)
        out["copy"] = copied
        zeroed = [x.clone() for x in xs]
        torch._foreach_zero_(zeroed)
        out["zero"] = zeroed
        return out

    check_against_cpu(ops, xs, ys, zs, torch.tensor(1.5), rtol=1e-5, atol=1e-6)


def test_foreach_half_precision_and_int_lists():
    torch.manual_seed(5)
    xs = [torch.randn(4, dtype=torch.bfloat16), torch.randn(3, dtype=torch.bfloat16)]
    check_against_cpu(lambda xs: torch._foreach_add(xs, xs, alpha=2), xs)
    ints = [torch.arange(4), torch.arange(3) - 1]
    check_against_cpu(lambda xs: torch._foreach_mul(xs, 3), ints)
    check_against_cpu(lambda xs: torch._foreach_div(xs, 2), ints)  # true division: float


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_fused_adamw_grad_scale_and_found_inf(tensor_lr):
    torch.manual_seed(6)
    params = [torch.randn(3, 2), torch.randn(4)]

    def step(params, found_inf):
        params = [p.clone() for p in params]
        grads = [torch.ones_like(p) * 4 for p in params]
        exp_avgs = [torch.full_like(p, 0.1) for p in params]
        exp_avg_sqs = [torch.full_like(p, 0.2) for p in params]
        steps = [torch.tensor(3.0, device=p.device) for p in params]
        lr = torch.tensor(0.01, device=params[0].device) if tensor_lr else 0.01
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=0.9,
                            beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False,
                            maximize=False, grad_scale=torch.tensor(2.0, device=params[0].device),
                            found_inf=found_inf)
        return params, grads, exp_avgs, exp_avg_sqs

    for found in (0.0, 1.0):
        expected = step(params, torch.tensor(found))
        actual = step(to_device(params), torch.tensor(found, device="tpu"))
        assert_same(actual, expected, rtol=1e-5, atol=1e-6)
    # found_inf set: nothing moves, not even the gradients.
    assert torch.equal(expected[0][0], params[0])
    assert torch.equal(expected[1][0], 4 * torch.ones(3, 2))


def test_lr_schedule_does_not_recompile_fused_adamw():
    import torchtpu

    model = torch.nn.Linear(4, 4).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    x = torch.randn(2, 4).to("tpu")

    def step():
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        sched.step()

    for _ in range(3):
        step()
    compiles = torchtpu.metrics.snapshot()["executable_compiles"]
    for _ in range(3):
        step()
    assert torchtpu.metrics.snapshot()["executable_compiles"] == compiles


def test_foreach_adamw_does_not_recompile_per_step():
    import torchtpu

    p = torch.nn.Parameter(torch.randn(3).to("tpu"))
    opt = torch.optim.AdamW([p], foreach=True)
    for i in range(6):
        if i == 3:
            compiles = torchtpu.metrics.snapshot()["executable_compiles"]
        p.sum().backward()
        opt.step()
        opt.zero_grad()
    # Bias corrections change every step; they are traced scalars, not program constants.
    assert torchtpu.metrics.snapshot()["executable_compiles"] == compiles
